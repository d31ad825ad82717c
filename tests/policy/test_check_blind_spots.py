"""``check`` and the agent on the bundled demo node: GPUs nobody could see are not healthy, a
kernel-log file's earlier boots are not judged, and the expected inventory comes from the instance
type the firmware names. Real host-root files; NVML is the stub libnvidia-ml.so.1 compiled with cc
where a test needs NVML itself (run in a child process so it cannot leak into this one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from healthagent.cli import main
from healthagent.demo import stub_nvml
from healthagent.demo.node import build_demo_root
from healthagent.demo.stub_setup import stub_nvml_env
from tests.support.nvml_stub import NO_CC

REPO = Path(__file__).parents[2]
EARLIER_BOOTS = REPO / "tests" / "fixtures" / "kmsg" / "kern-earlier-boots.log"


@pytest.fixture
def node(tmp_path):
    return build_demo_root(tmp_path / "host")


def needs_cc() -> None:
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)


def check_child(*args: str, scenario: Path | None = None,
                blind_nvml_root: Path | None = None) -> subprocess.CompletedProcess:
    """``healthagent check`` in a child process whose NVML is the stub answering from ``scenario``.
    ``blind_nvml_root``: the stub pointed at a scenario that does not exist, so nvmlInit fails as
    on a node whose driver is not loaded."""
    env = dict(os.environ)
    env.pop(stub_nvml.SCENARIO_ENV, None)
    if blind_nvml_root is not None:
        scenario = blind_nvml_root / "no-such-scenario.json"
    if scenario is not None:
        env = stub_nvml_env(scenario, base=env)
    return subprocess.run([sys.executable, "-m", "healthagent", "check", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=env)


# -- GPUs nobody could see -----------------------------------------------------------------------

@pytest.mark.integration
def test_gpus_that_could_not_be_observed_are_exit_3_not_healthy(node):
    needs_cc()
    done = check_child("--host-root", str(node.root), blind_nvml_root=node.root)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "GPUs could not be observed: nvml unavailable: " in done.stdout
    assert "Verdict: none (could not run)" in done.stdout
    assert "healthy" not in done.stdout.split("Verdict:", 1)[1]
    as_json = check_child("--host-root", str(node.root), "--json", blind_nvml_root=node.root)
    report = json.loads(as_json.stdout)
    assert (as_json.returncode, report["exit_code"], report["unobserved"], report["verdict"]) == (3, 3, ["gpu"], "none")


@pytest.mark.integration
def test_a_fault_seen_in_the_kernel_log_stands_when_nvml_is_blind(node):
    needs_cc()
    node.inject_xid(3, 94, via="kmsg")
    done = check_child("--host-root", str(node.root), blind_nvml_root=node.root)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "GPUs could not be observed: nvml unavailable: " in done.stdout
    assert "Verdict: replace_node (node action required)" in done.stdout


def test_no_nvml_turns_the_could_not_run_exit_off_but_still_says_so(node, capsys):
    assert main(["check", "--host-root", str(node.root), "--no-nvml"]) == 0
    out = capsys.readouterr().out
    # The demo node is a p5.48xlarge (DMI product name), so 8 GPUs are expected without a flag.
    assert "GPUs could not be observed: no GPU source is configured, and 8 GPUs are expected" in out
    assert "Verdict: none (healthy as far as seen; not observed: gpu)" in out


# -- earlier boots in a kernel-log file ----------------------------------------------------------

def test_xids_from_earlier_boots_in_a_kernel_log_file_are_not_judged(node, tmp_path, capsys):
    log = tmp_path / "old.log"
    shutil.copyfile(EARLIER_BOOTS, log)  # XID 94 + 154 and a fatal SXid, January 2024
    code = main(["check", "--host-root", str(node.root), "--kernel-log", str(log), "--no-nvml"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "3 XID events from earlier boots (not judged)" in out
    assert "GPU_XID" not in out and "NVSWITCH_SXID" not in out
    assert main(["check", "--host-root", str(node.root), "--kernel-log", str(log), "--no-nvml", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["xid_events"], report["xid_events_earlier_boots"], report["findings"]) == (3, 3, [])


# -- expected inventory from the instance type ---------------------------------------------------

def test_a_missing_efa_device_at_boot_is_not_judged_without_an_expectation(node, capsys):
    """The instance type says how many EFA interfaces it supports, not how many were attached at
    launch: without being asked to expect them all, 31 of 32 is not a fault."""
    node.remove_efa_device(node.efa_devices[5])
    assert main(["check", "--host-root", str(node.root), "--no-nvml", "--json"]) == 0
    assert "EFA_DEVICE_MISSING" not in capsys.readouterr().out


def test_a_missing_efa_device_at_boot_is_found_from_the_instance_type(node, capsys, monkeypatch):
    monkeypatch.setenv("HEALTHAGENT_EFA_EXPECTED_FROM_INSTANCE_TYPE", "true")
    node.remove_efa_device(node.efa_devices[5])  # the node came up with 31 of its 32 EFAs
    assert main(["check", "--host-root", str(node.root), "--no-nvml", "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    (finding,) = [f for f in report["findings"] if f["code"] == "EFA_DEVICE_MISSING"]
    assert finding["evidence"].startswith("31 EFA devices read, expected 32")
    assert report["verdict"] == "reboot_node"


def test_explicit_settings_win_over_the_instance_type(node, capsys):
    node.remove_efa_device(node.efa_devices[5])
    assert main(["check", "--host-root", str(node.root), "--no-nvml", "--expected-efa-devices", "31"]) == 0
    assert "EFA_DEVICE_MISSING" not in capsys.readouterr().out


@pytest.mark.integration
def test_a_missing_gpu_at_boot_is_found_without_settings(node):
    needs_cc()
    stub_nvml.remove_gpu(node.scenario, 7)  # the node came up with 7 of its 8 GPUs
    done = check_child("--host-root", str(node.root), "--json", scenario=node.scenario)
    report = json.loads(done.stdout)
    (finding,) = [f for f in report["findings"] if f["code"] == "GPU_MISSING"]
    assert finding["evidence"].startswith("7 GPUs read, expected 8")
    assert (done.returncode, report["unobserved"]) == (2, [])


def test_the_agent_expects_the_instance_types_inventory(node, tmp_path):
    from prometheus_client import generate_latest

    from healthagent import __version__
    from healthagent.agent import Agent
    from healthagent.config import load_settings
    from healthagent.effects.state import StateStore
    from healthagent.telemetry.metrics import Telemetry
    from healthagent.wiring import build_classifier, expected_inventory

    settings = load_settings(flags={"host_root": str(node.root), "kube": "off", "nvml": "false",
                                    "efa_expected_from_instance_type": "true",
                                    "state_file": str(tmp_path / "state.json")})
    telemetry = Telemetry(__version__)
    expected_gpus, expected_efa_devices = expected_inventory(settings)
    agent = Agent(settings, sources=[], event_sources=[], classifier=build_classifier(settings),
                  state=StateStore(settings.state_file), telemetry=telemetry,
                  expected_gpus=expected_gpus, expected_efa_devices=expected_efa_devices)
    assert (agent.expected_gpus, agent.expected_efa_devices) == (8, 32)
    verdict = agent.cycle()
    assert verdict.unobserved == ("gpu",)  # 8 GPUs expected, no GPU source: not "healthy"
    exposition = generate_latest(telemetry.registry).decode()
    assert "healthagent_gpus_expected 8.0" in exposition
    assert "healthagent_efa_devices_expected 32.0" in exposition


def test_check_counts_every_xid_of_a_folded_storm(node, capsys):
    """A run of one XID is folded into a few events with repeat counts; check reports every XID."""
    for _ in range(40):
        node.inject_xid(3, 13, via="kmsg")
    main(["check", "--host-root", str(node.root), "--no-nvml", "--json"])
    assert json.loads(capsys.readouterr().out)["xid_events"] == 40
