"""``healthagent demo``, the README's first command: the real agent on the demo node through a
scripted fault, checked from what it prints (read back from the running agent and its /metrics)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from healthagent.demo.stub_setup import stub_nvml_env
from tests.support.nvml_stub import NO_CC

REPO = Path(__file__).parents[2]

pytestmark = pytest.mark.integration


def run_demo(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    return subprocess.run([sys.executable, "-m", "healthagent", "demo", *args], capture_output=True,
                          text=True, timeout=180, cwd=REPO)


def test_xid_95_takes_the_node_out_after_the_grace():
    done = run_demo("--xid", "95", "--gpu", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "read 8 GPUs and 32 EFA devices; verdict = none" in out
    assert "add --keep-running to keep them up" in out  # the URLs die with the demo: it says so
    assert "verdict = replace_node" in out
    assert "[GPU_XID] GPU 2 0000:75:00.0: replace_node" in out
    assert "taint NoSchedule now" in out and "taint NoExecute now" in out
    # The grace is the time from the NoSchedule taint; the log names that time as such.
    assert "NoExecute follows once the grace has passed: 3 s after the NoSchedule taint" in out
    assert "since_taint_seconds=" in done.stderr and "after_grace" not in done.stderr
    assert 'xid="95"} 1.0' in out
    assert 'healthagent_node_action{action="replace_node"} 1.0' in out


def test_an_application_xid_leaves_the_node_in_the_job():
    done = run_demo("--xid", "13")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "verdict = restart_app" in out and "faulted" in out
    assert "taint effect now: none" in out and "NoSchedule now" not in out


def test_an_infiniband_port_going_down_takes_the_node_out_of_the_job():
    done = run_demo("--fabric", "ib")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "read 8 GPUs and 10 InfiniBand/RoCE ports, every port up; verdict = none" in out
    assert "mlx5_3/1  ibp75s0        InfiniBand  400 Gb/sec (4X NDR)  ACTIVE, LinkUp  GPU 3 (0000:4c:00.0)" in out
    assert "EFA" not in out.split("2. Fault", 1)[0].replace("no EFA", "")  # an InfiniBand node has none
    # The port goes down after the agent has seen it up; the finding says what and what to do.
    assert "verdict = reboot_node" in out
    assert "[RDMA_PORT_DOWN] mlx5_3/1: reboot_node" in out
    assert "seen: state 1: DOWN, phys_state 2: Polling; it was up at " in out
    assert "next: Port mlx5_3/1 was up (or the policy file's rdma_ports: says it must be) and is not" in out and "`ibstat`" in out
    # The networking condition, then the node leaves the job: NoSchedule, NoExecute after the grace.
    assert "condition NetworkHealthy=False, reason RDMA_PORT_DOWN: the node's networking condition" in out
    assert "taint NoSchedule now" in out and "taint NoExecute now" in out
    assert "taint effect now: NoExecute" in out
    assert 'healthagent_infiniband_port_up{device="mlx5_3",port="1"} 0.0' in out
    assert 'healthagent_infiniband_state_id{device="mlx5_3",port="1"} 1.0' in out
    # The driver's line for the pulled cable is counted, and is informational: no finding of its own.
    assert "the driver logs: mlx5_core 0000:4b:00.0: Port module event: module 0, Cable unplugged" in out
    assert ('healthagent_mlx5_events_total{device="mlx5_3",event="module_unplugged",'
            'pci_bus_id="0000:4b:00.0"} 1.0') in out
    assert "RDMA_ADAPTER_EVENT" not in out
    assert 'healthagent_findings{action="reboot_node",code="RDMA_PORT_DOWN"} 1.0' in out
    assert 'healthagent_node_action{action="reboot_node"} 1.0' in out


def test_fabric_takes_efa_or_ib_and_the_xid_only_with_efa(capsys):
    from healthagent.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["demo", "--fabric", "roce"])
    assert exited.value.code == 3
    assert "argument --fabric: invalid choice: 'roce' (choose from 'efa', 'ib')" in capsys.readouterr().err
    assert main(["demo", "--fabric", "ib", "--xid", "79"]) == 3
    assert "--xid is the efa demo's fault; the ib demo's fault is an InfiniBand port going down" in capsys.readouterr().err


def test_prepare_writes_a_root_that_check_reads(tmp_path):
    done = run_demo("--prepare", str(tmp_path / "root"))
    assert done.returncode == 0, done.stderr
    env = stub_nvml_env(tmp_path / "root" / "nvml-scenario.json")  # what --prepare says to set
    check = subprocess.run([sys.executable, "-m", "healthagent", "check", "--host-root", str(tmp_path / "root")],
                           capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "GPUs: 8 read" in check.stdout and "EFA devices: 32 read" in check.stdout
    assert "Verdict: none (healthy)" in check.stdout


def test_keep_running_serves_both_ports_and_its_job_token_opens_the_intake():
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    # Started as a shell starts a background job (SIGINT ignored): Ctrl-C must still end it.
    demo = subprocess.Popen([sys.executable, "-m", "healthagent", "demo", "--keep-running"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        curl = None
        for line in demo.stdout:  # ends when the demo exits; it prints the command, then serves
            if line.strip().startswith("curl "):
                curl = line
                break
        assert curl is not None, "the demo printed no curl command"
        token = re.search(r"Bearer ([^']+)'", curl).group(1)
        url = re.search(r"(http://127\.0\.0\.1:\d+/v1/training)", curl).group(1)
        body = re.search(r"-d '(\{.*\})'", curl).group(1).encode()
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert (reply.status, json.loads(reply.read())) == (202, {"accepted": 1})
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(60)
        finally:
            demo.kill()  # a no-op once it has exited
    assert demo.returncode == 0
