"""EFA sysfs and dcgm-exporter as the worst node shows them: parts that are there but cannot be
read must be *unobserved* (never missing, never healthy, never a node action), and numbers must
reach the operator exactly.

Real parts wherever one can show the fault: the demo node's sysfs tree under a host root (a
directory made mode 000, read by a real agent process without CAP_DAC_OVERRIDE), a real HTTP
server standing in for dcgm-exporter, the real classifier and, for the node action, the running
agent writing to the fake API server. Two faults a real part cannot be made to show on demand go
through ``EfaSource``'s fault hook instead (its docstring says so): EIO from sysfs, and EACCES
when the tests run as root without ``setpriv`` to drop the capability.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from healthagent.config import load_settings
from healthagent.model import Action, Collection, SourceHealth
from healthagent.sources.dcgm import DcgmSource
from healthagent.sources.efa import EfaSource
from healthagent.wiring import build_classifier
from tests.fuzz.test_fuzz_dcgm_mapping import Exporter  # a real HTTP server answering what it is given
from tests.reliability.helpers import alive, events_by_reason, our_taints, scrape, wait_metric, wait_warm
from tests.support.live_agent import REPO_ROOT

pytestmark = [pytest.mark.reliability]

NOW = 1_795_176_000.0
FIXTURES = Path(__file__).parent.parent / "fixtures" / "dcgm"


def classifier():
    return build_classifier(load_settings(env={}, flags={}))


def observe(judge, result, now: float, expected_efa: int | None = 32, **kw):
    """One observation of the real classifier with a source's result."""
    return judge.observe(Collection(timestamp=now, gpus=result.gpus, xids=result.xids, efa=result.efa,
                                    health=(result.health,), expected_efa_devices=expected_efa, **kw)).verdict


def refusing(paths: list[Path], error: int = errno.EACCES):
    """A fault hook: every path under ``paths`` answers ``error``, as sysfs would."""
    prefixes = tuple(str(p) for p in paths)

    def hook(path: str) -> None:
        if path.startswith(prefixes):
            raise OSError(error, os.strerror(error), path)

    return hook


# -- EFA devices that cannot be read ---------------------------------------------------------------

@pytest.mark.parametrize("how_many", [1, 32])
def test_unreadable_efa_devices_are_unobserved_never_missing(demo, how_many):
    source = EfaSource(str(demo.root))
    judge = classifier()
    assert observe(judge, source.collect(NOW), NOW).action is Action.NONE  # 32 devices learned
    blind = demo.efa_devices[:how_many]
    source.fault = refusing([demo.efa_device_dir(d) for d in blind])
    for step in range(1, 4):  # the inventory condition raises after a few bad readings: take several
        result = source.collect(NOW + 10 * step)
        verdict = observe(judge, result, NOW + 10 * step)
    assert result.health.up is False and result.health.unobserved == tuple(blind)
    assert f"{how_many} could not be read" in result.health.detail and "Permission denied" in result.health.detail
    assert len({s.device for s in result.efa}) == 32 - how_many  # the rest is still read
    assert verdict.findings == () and verdict.action is Action.NONE
    assert "efa" in verdict.unobserved
    # A device really gone (its PCI function removed: ENOENT) while another is unreadable is missing.
    gone = demo.efa_devices[-1]
    demo.remove_efa_device(gone)
    for step in range(4, 8):
        verdict = observe(judge, source.collect(NOW + 10 * step), NOW + 10 * step)
    [finding] = verdict.findings
    assert finding.code == "EFA_DEVICE_MISSING"
    assert finding.evidence.split("not seen any more: ")[1].split(", ") == [gone]  # never the unreadable


def test_sysfs_answering_eio_makes_a_device_unobserved_and_one_bad_counter_only_that_counter(demo):
    source = EfaSource(str(demo.root))
    judge = classifier()
    observe(judge, source.collect(NOW), NOW)
    sick, bad_counter = demo.efa_devices[3], demo.efa_devices[4]
    counters = demo.efa_device_dir(sick) / "ports" / "1" / "hw_counters"
    one_file = demo.efa_device_dir(bad_counter) / "ports" / "1" / "hw_counters" / "rx_drops"
    eio_everywhere = refusing([counters, demo.efa_device_dir(sick) / "hw_counters", one_file], errno.EIO)
    source.fault = eio_everywhere
    for step in range(1, 4):
        result = source.collect(NOW + 10 * step)
        verdict = observe(judge, result, NOW + 10 * step)
    assert result.health.unobserved == (sick,) and "Input/output error" in result.health.detail
    by_device = {s.device: s for s in result.efa}
    assert sick not in by_device and "rx_drops" not in by_device[bad_counter].counters
    assert by_device[bad_counter].counters["tx_bytes"] > 0
    assert verdict.findings == () and "efa" in verdict.unobserved


def _without_dac_override() -> list[str] | None:
    """The argv prefix that runs a command as this user without CAP_DAC_OVERRIDE (and
    CAP_DAC_READ_SEARCH): nothing when not root, ``setpriv`` when root; None when that cannot be
    done here."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", "--"]


@pytest.mark.integration
@pytest.mark.parametrize("how_many", [1, 32])
def test_check_without_cap_dac_override_on_unreadable_efa_directories_takes_no_node_action(demo, tmp_path,
                                                                                          how_many):
    """The real ``healthagent check`` as a process that may not bypass file modes (root without
    CAP_DAC_OVERRIDE, as in a pod that drops it), on a sysfs whose device directories are mode 000."""
    prefix = _without_dac_override()
    if prefix is None:
        pytest.skip("running as root without setpriv (util-linux): cannot drop CAP_DAC_OVERRIDE")
    dirs = [demo.efa_device_dir(d) for d in demo.efa_devices[:how_many]]
    for directory in dirs:
        os.chmod(directory, 0)
    try:
        done = subprocess.run(prefix + [sys.executable, "-m", "healthagent", "check", "--host-root", str(demo.root),
                                        "--no-nvml", "--expected-efa-devices", "32", "--json"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    finally:
        for directory in dirs:
            os.chmod(directory, 0o755)
    report = json.loads(done.stdout)
    efa = next(s for s in report["sources"] if s["source"] == "efa")
    assert done.returncode in (0, 1), done.stderr  # never 2: nothing seen demands a node action
    assert report["verdict"] == "none" and not [f for f in report["findings"] if f["code"] == "EFA_DEVICE_MISSING"]
    assert "efa" in report["unobserved"]
    assert efa["up"] is False and len(efa["unobserved"]) == how_many
    assert "Permission denied" in efa["detail"]


@pytest.mark.integration
def test_check_on_looping_efa_links_names_efa_unobserved_and_takes_no_node_action(demo):
    """The real ``healthagent check`` on a host root where one EFA class entry is a looping link and
    another device's ``device`` link leads into a loop: ELOOP hides the devices, it never shows them
    gone, so the command exits 0 or 1 (never 2) and names EFA unobserved."""
    looping, loop_behind = demo.efa_devices[3], demo.efa_devices[4]
    class_link = demo.root / "sys" / "class" / "infiniband" / looping
    class_link.unlink()
    class_link.symlink_to("loop-a")
    os.symlink("loop-b", class_link.parent / "loop-a")
    os.symlink("loop-a", class_link.parent / "loop-b")
    behind = demo.efa_device_dir(loop_behind)
    os.symlink("loop-d", behind / "loop-c")
    os.symlink("loop-c", behind / "loop-d")
    os.unlink(behind / "device")
    os.symlink("loop-c", behind / "device")
    argv = [sys.executable, "-m", "healthagent", "check", "--host-root", str(demo.root), "--no-nvml",
            "--expected-efa-devices", "32"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(argv + ["--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    report = json.loads(done.stdout)
    efa = next(s for s in report["sources"] if s["source"] == "efa")
    assert done.returncode in (0, 1), done.stderr
    assert report["verdict"] == "none" and not [f for f in report["findings"] if f["code"] == "EFA_DEVICE_MISSING"]
    assert "efa" in report["unobserved"]
    assert efa["up"] is False and set(efa["unobserved"]) == {looping, loop_behind, "loop-a", "loop-b"}
    assert "ELOOP" in efa["detail"] and len(report["efa_devices"]) == 30
    text = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert text.returncode in (0, 1), text.stdout + text.stderr
    assert "EFA devices could not be observed" in text.stdout and "not observed: efa" in text.stdout


@pytest.mark.integration
def test_the_running_agent_takes_no_node_action_for_an_efa_device_it_may_not_read(demo, fake, start_agent):
    runtime = start_agent(efa_interval_seconds=0.1)
    wait_warm(runtime)
    efa = next(item.source.source for item in runtime.agent.scheduled if item.source.name == "efa")
    blind = demo.efa_devices[5]
    efa.fault = refusing([demo.efa_device_dir(blind)])
    seen = wait_metric(runtime, lambda s: s.value("healthagent_source_up", source="efa") == 0
                       and s.value("healthagent_efa_devices") == 31, "the device unobserved")
    cycles = runtime.agent.cycles
    wait_metric(runtime, lambda s: runtime.agent.cycles > cycles + 20, "twenty cycles more")
    now = scrape(runtime)
    assert now.value("healthagent_findings", code="EFA_DEVICE_MISSING", action="reboot_node") in (None, 0)
    assert now.value("healthagent_node_action", action="none") == 1
    assert our_taints(fake) == [] and "EFA_DEVICE_MISSING" not in events_by_reason(fake)
    assert seen.total("healthagent_source_errors_total", source="efa", kind="unreadable") >= 1
    assert alive(runtime)


# -- exact numbers ---------------------------------------------------------------------------------

def test_an_efa_counter_jumping_to_2_64_minus_1_reads_as_exact_integers(demo):
    source = EfaSource(str(demo.root))
    judge = classifier()
    device = demo.efa_devices[2]
    observe(judge, source.collect(NOW), NOW)
    before = int((demo.efa_device_dir(device) / "ports" / "1" / "hw_counters" / "rx_drops").read_text())
    top = 2**64 - 1
    demo.bump_efa_counter(device, "rx_drops", top - before)
    demo.bump_efa_counter(device, "no_completion_cmds", top)  # 0 before: a healthy driver
    verdict = observe(judge, source.collect(NOW + 10), NOW + 10)
    evidence = {f.code: f.evidence for f in verdict.findings}
    assert evidence["EFA_ADMIN_QUEUE_STUCK"] == f"no_completion_cmds 0 -> {top}"
    assert evidence["EFA_RX_DROPS"].startswith(f"rx_drops +{top - before} in 10 s")
    assert all("18446744073709551616" not in text and "e+" not in text for text in evidence.values())


# -- dcgm-exporter that lists GPUs it does not show ------------------------------------------------

@pytest.fixture
def exporter():
    server = Exporter()
    yield server
    server.close()


def judge_dcgm(exporter, scrapes: int = 4):
    source = DcgmSource(exporter.url, 2.0)
    judge = classifier()
    for step in range(scrapes):
        result = source.collect(NOW + 10 * step)
        verdict = judge.observe(Collection(timestamp=NOW + 10 * step, gpus=result.gpus, xids=result.xids,
                                           health=(result.health,), expected_gpus=8)).verdict
    return result, verdict


@pytest.mark.parametrize("body", ["profiling-only", "empty"])
def test_dcgm_exporter_that_shows_no_gpu_health_leaves_the_gpus_unobserved_not_missing(exporter, body):
    exporter.body = (FIXTURES / "dcgm-exporter-3.3-profiling-only.txt").read_bytes() if body != "empty" else b""
    result, verdict = judge_dcgm(exporter)
    assert result.health.up is False and result.gpus == ()
    if body == "empty":
        assert result.health.errors == {"no_gpus": 4} and "lists no GPU" in result.health.detail
    else:
        assert len(result.health.unobserved) == 8 and "DCGM_FI_DEV_XID_ERRORS" in result.health.detail
    assert verdict.findings == () and verdict.action is Action.NONE  # no GPU_MISSING
    assert verdict.unobserved == ("gpu",)


@pytest.mark.integration
def test_check_with_a_profiling_only_dcgm_exporter_does_not_exit_2(exporter, demo):
    exporter.body = (FIXTURES / "dcgm-exporter-3.3-profiling-only.txt").read_bytes()
    done = subprocess.run([sys.executable, "-m", "healthagent", "check", "--host-root", str(demo.root), "--no-nvml",
                           "--dcgm-url", exporter.url, "--expected-gpus", "8", "--json"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    assert done.returncode != 2, report
    assert report["verdict"] == "none" and "gpu" in report["unobserved"]
    assert not [f for f in report["findings"] if f["code"] == "GPU_MISSING"]


def test_every_xid_form_dcgm_exporter_versions_write_is_read(exporter):
    """The last-XID gauge (all versions), its 1.x name, and the exporter's own per-XID counters
    (``DCGM_EXP_XID_ERRORS_TOTAL`` since start, ``DCGM_EXP_XID_ERRORS_COUNT`` in a window): a
    GPU whose only health field is one of them is observed, and its new XIDs counted exactly."""
    labels = 'gpu="0",UUID="GPU-a",pci_bus_id="00000000:53:00.0"'

    def body(total: int, window: int, gauge: int) -> bytes:
        return (f'DCGM_EXP_XID_ERRORS_TOTAL{{{labels},xid="94"}} {total}\n'
                f'DCGM_EXP_XID_ERRORS_COUNT{{{labels},xid="94"}} {window}\n'
                f'DCGM_FI_DEV_XID_ERRORS{{{labels},err_code="94"}} {gauge}\n').encode()

    source = DcgmSource(exporter.url, 2.0)
    exporter.body = body(2, 2, 94)
    assert source.collect(NOW).xids == ()  # the baseline
    exporter.body = body(5, 4, 94)  # three more XID 94s: the gauge cannot show them, the counter can
    events = source.collect(NOW + 10).xids
    assert [(e.xid, e.repeats, e.pci_bus_id) for e in events] == [(94, 3, "0000:53:00.0")]
    exporter.body = b'dcgm_xid_errors{gpu="1",uuid="GPU-b"} 0\n'
    [gpu] = source.collect(NOW + 20).gpus
    assert gpu.uuid == "GPU-b"  # the 1.x name alone observes the GPU


# -- a driver reporting a GPU NVML does not list ----------------------------------------------------

def test_an_xid_for_a_gpu_nvml_does_not_list_is_reported_on_its_pci_id():
    """The driver only reports GPUs it drives: an XID for one NVML does not enumerate is a fault of
    that GPU (it is what a GPU falling off looks like), never dropped, and acted on as its XID
    says; the missing GPU is GPU_MISSING besides."""
    from healthagent.model import GpuSample
    from healthagent.sources.kernel_log.offline import iter_events

    listed = tuple(GpuSample(index=i, uuid=f"GPU-{i}", pci_bus_id=f"0000:{0x53 + 0x11 * i:02x}:00.0", timestamp=NOW)
                   for i in range(7))
    events = tuple(iter_events(["NVRM: Xid (PCI:0000:ca:00): 94, pid=1, name=p, Contained: SM (0x1)"], NOW,
                               host_root="/nonexistent"))
    verdict = classifier().observe(Collection(timestamp=NOW, xids=events, gpus=listed, expected_gpus=8,
                                              health=(SourceHealth(source="nvml", up=True),))).verdict
    xid = next(f for f in verdict.findings if f.code == "GPU_XID")
    assert (xid.pci_bus_id, xid.gpu_index, xid.action) == ("0000:ca:00.0", None, Action.REPLACE_NODE)
