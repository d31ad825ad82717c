"""The policy through the real command line: classify, explain, a bad policy file, and ``check`` on
the demo node (real stub libnvidia-ml compiled with cc, real sysfs-shaped tree, real kmsg file)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from healthagent.cli import main
from tests.support.nvml_stub import NO_CC

KERNEL_LOG = """\
May 01 09:51:12 node kernel: NVRM: Xid (PCI:0000:86:00): 94, pid=1234, name=python, Contained: CE User Channel (0x9)
May 01 09:51:13 node kernel: NVRM: Xid (PCI:0000:86:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)
May 01 09:51:14 node kernel: nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error
May 01 09:51:15 node kernel: usb 1-1: new high-speed USB device number 2
"""


def test_classify_prints_one_json_object_per_event(tmp_path, capsys):
    log = tmp_path / "kern.log"
    log.write_text(KERNEL_LOG, encoding="utf-8")
    assert main(["classify", str(log)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r.get("xid"), r.get("sxid"), r["action"]) for r in rows] == [
        (94, None, "replace_node"), (154, None, "reboot_node"), (None, 12028, "monitor")]
    assert rows[0]["pci_bus_id"] == "0000:86:00.0" and rows[0]["name"] == "ROBUST_CHANNEL_CONTAINED_ERROR"


def test_classify_with_an_override(tmp_path, capsys):
    log, policy = tmp_path / "kern.log", tmp_path / "policy.yaml"
    log.write_text(KERNEL_LOG, encoding="utf-8")
    policy.write_text("xid: {94: restart_app}\n", encoding="utf-8")
    assert main(["classify", str(log), "--policy-file", str(policy)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["action"] == "restart_app"


def test_explain(capsys):
    assert main(["explain", "13"]) == 0
    out = capsys.readouterr().out
    assert "Our action: restart_app" in out and "application-caused" in out


def test_bad_policy_file_is_one_line_and_exit_3(tmp_path, capsys):
    policy = tmp_path / "policy.yaml"
    policy.write_text("thresholds: {incident_quiet_seconds: -1}\n", encoding="utf-8")
    assert main(["explain", "94", "--policy-file", str(policy)]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "thresholds.incident_quiet_seconds" in err


@pytest.mark.integration
@pytest.mark.parametrize("xid,exit_code,words", [
    (94, 2, ["GPU_XID", "replace_node", "0000:86:00.0"]),
    (13, 1, ["restart_app", "application fault"]),
])
def test_check_on_the_demo_node(tmp_path, xid, exit_code, words):
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import stub_nvml_env

    node = build_demo_root(tmp_path / "host")
    node.inject_xid(3, xid)
    # a child process: check loads the stub NVML library, which must not leak into this one
    done = subprocess.run([sys.executable, "-m", "healthagent", "check", "--host-root", str(node.root),
                           "--expected-gpus", "8"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2], env=stub_nvml_env(node.scenario))
    assert done.returncode == exit_code, done.stdout + done.stderr
    verdict_table = done.stdout.split("Verdict:", 1)[1]
    for word in words:
        assert word in verdict_table
    assert "GPU_XID on GPU 3 (0000:86:00.0)" in verdict_table  # GPU 3, its PCI id


# -- classify: the host root's kernel log, and a count of what was read -----------------------------

def test_classify_reads_the_kernel_log_under_the_host_root(tmp_path, capsys):
    from healthagent.demo.node import build_demo_root

    node = build_demo_root(tmp_path / "host")
    node.inject_xid(3, 94)
    assert main(["classify", "--host-root", str(node.root)]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["xid"], r["pci_bus_id"], r["action"]) for r in rows] == [(94, "0000:86:00.0", "replace_node")]
    assert err.startswith(f"1 XID line in {node.root / 'dev' / 'kmsg'} (")


def test_classify_says_how_many_xid_lines_it_found_on_stderr(tmp_path, capsys):
    log = tmp_path / "kern.log"
    log.write_text("May 01 09:51:15 node kernel: usb 1-1: new high-speed USB device number 2\n" * 3)
    assert main(["classify", str(log)]) == 0
    out, err = capsys.readouterr()
    assert out == ""  # stdout stays JSON lines only
    assert err == f"0 XID lines in {log} (3 lines read)\n"
    log.write_text(KERNEL_LOG, encoding="utf-8")
    assert main(["classify", str(log), "--host-root", str(tmp_path)]) == 0  # a file given wins
    assert capsys.readouterr().err == f"2 XID lines and 1 SXid line in {log} (4 lines read)\n"


def test_classify_names_a_host_root_without_a_kernel_log(tmp_path, capsys):
    assert main(["classify", "--host-root", str(tmp_path)]) == 3
    assert f"cannot read '{tmp_path / 'dev' / 'kmsg'}'" in capsys.readouterr().err


# -- classify and explain: ConnectX (mlx5) adapter events beside the XIDs ----------------------------

IB_LOG = KERNEL_LOG + """\
May 01 09:51:16 node kernel: mlx5_core 0000:4b:00.0: Port module event: module 0, Cable unplugged
May 01 09:51:17 node kernel: mlx5_core 0000:41:00.0: poll_health:785:(pid 0): Fatal error 5 detected
May 01 09:51:18 node kernel: mlx5_core 0000:41:00.0: firmware version: 28.39.1002
"""


def test_classify_prints_the_connectx_events_with_their_adapter_action_and_meaning(tmp_path, capsys):
    log, policy = tmp_path / "kern.log", tmp_path / "policy.yaml"
    log.write_text(IB_LOG, encoding="utf-8")
    assert main(["classify", str(log)]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [sorted(r) for r in rows[:2]] == [["action", "line", "name", "pci_bus_id", "xid"]] * 2  # XIDs as before
    unplugged, fatal = rows[3:]
    assert unplugged == {"mlx5": "module_unplugged", "name": "module_unplugged", "pci_bus_id": "0000:4b:00.0",
                         "action": "none", "detail": "module 0", "line": IB_LOG.splitlines()[4],
                         "meaning": "A cable or module was pulled out (or lost contact): informational, its "
                                    "port loses the link."}
    assert (fatal["mlx5"], fatal["pci_bus_id"], fatal["action"]) == ("fatal_error", "0000:41:00.0", "reboot_node")
    assert err == f"2 XID lines, 1 SXid line and 2 ConnectX (mlx5) event lines in {log} (7 lines read)\n"
    policy.write_text("mlx5: {module_unplugged: monitor}\n", encoding="utf-8")
    assert main(["classify", str(log), "--policy-file", str(policy)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[3])["action"] == "monitor"


def test_explain_a_connectx_event_says_its_meaning_action_and_steps(tmp_path, capsys):
    assert main(["explain", "module_bad_cable"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("ConnectX (mlx5) event module_bad_cable: The firmware found the cable or module bad or "
                        "shorted: the port has no link, or a bad one.")
    assert "Our action: monitor" in lines and "Decided by: mlx5 catalog: module_bad_cable -> monitor" in lines
    assert "set `mlx5: {module_bad_cable: reboot_node}`" in lines[-3]
    assert lines[-2] == "What to do: Replace the cable or module, then check the link (`mlxlink -d <pci> -m -c`)."
    assert lines[-1] == "Runbook: docs/findings.md#rdma_adapter_event"
    policy = tmp_path / "policy.yaml"
    policy.write_text("mlx5: {fatal_error: monitor}\n", encoding="utf-8")
    assert main(["explain", "Fatal_Error", "--policy-file", str(policy)]) == 0
    out = capsys.readouterr().out
    assert "Our action: monitor\n" in out and "operator override in the policy file (the catalog says reboot_node)" in out
    assert "To change it" not in out and "Again after a reboot" not in out and f"Policy file: {policy}" in out
    assert main(["explain", "fatal_error"]) == 0
    assert "opens as replace_node: the reboot did not fix it" in capsys.readouterr().out


# -- explain: this project's departures from NVIDIA's buckets, said plainly -------------------------

@pytest.mark.parametrize("xid,bucket_action", [(63, "monitor"), (64, "reset_gpu"), (94, "restart_app"),
                                               (95, "reset_gpu")])
def test_explain_says_plainly_that_the_default_replaces_the_node(capsys, xid, bucket_action):
    assert main(["explain", str(xid)]) == 0
    out = capsys.readouterr().out
    assert "Mapping rule:" not in out  # no line that contradicts "Our action"
    assert "Our action: replace_node (this project's default, not NVIDIA's" in out
    assert f"would give {bucket_action})" in out
    assert "by default this project replaces the node on XID 63, 64, 94 and 95" in out
    assert "needs service" in out
    assert f"set `xid: {{{xid}: {bucket_action}}}`" in out and "--policy-file FILE" in out


def test_explain_after_an_override_says_the_operators_action(tmp_path, capsys):
    policy = tmp_path / "policy.yaml"
    policy.write_text("xid: {63: monitor}\n", encoding="utf-8")
    assert main(["explain", "63", "--policy-file", str(policy)]) == 0
    out = capsys.readouterr().out
    assert "Our action: monitor\n" in out and "operator override" in out
    assert "To change it" not in out


def test_explain_keeps_the_mapping_rule_where_the_default_follows_it(capsys):
    assert main(["explain", "48"]) == 0
    out = capsys.readouterr().out
    assert "Mapping rule: NVIDIA bucket WORKFLOW_XID_48 -> reset_gpu" in out and "this project's default" not in out


# -- check --json: devices in the order a person reads them -----------------------------------------

def test_check_json_lists_efa_devices_in_natural_order(tmp_path, capsys):
    from healthagent.demo.node import build_demo_root
    from healthagent.model import natural_key

    node = build_demo_root(tmp_path / "host")
    main(["check", "--host-root", str(node.root), "--no-nvml", "--json"])
    devices = json.loads(capsys.readouterr().out)["efa_devices"]
    assert len(devices) == 32 and devices == sorted(devices, key=natural_key)
    assert devices.index("rdmap79s0") < devices.index("rdmap113s0")
