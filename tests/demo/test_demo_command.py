"""``healthagent demo``, the README's first command: the real agent on the demo node through a
scripted fault, checked from what it prints (read back from the running agent and its /metrics)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from healthagent.demo.stub_setup import stub_nvml_env

REPO = Path(__file__).parents[2]

pytestmark = pytest.mark.integration


def run_demo(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("cc") is None:
        pytest.skip("cc not installed: the demo's stub libnvidia-ml.so.1 cannot be built")
    return subprocess.run([sys.executable, "-m", "healthagent", "demo", *args], capture_output=True,
                          text=True, timeout=180, cwd=REPO)


def test_xid_95_takes_the_node_out_after_the_grace():
    done = run_demo("--xid", "95", "--gpu", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "read 8 GPUs and 32 EFA devices; verdict = none" in out
    assert "verdict = replace_node" in out
    assert "[GPU_XID] GPU 2 0000:75:00.0: replace_node" in out
    assert "taint NoSchedule now" in out and "taint NoExecute now" in out
    assert 'xid="95"} 1.0' in out
    assert 'healthagent_node_action{action="replace_node"} 1.0' in out


def test_an_application_xid_leaves_the_node_in_the_job():
    done = run_demo("--xid", "13")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "verdict = restart_app" in out and "faulted" in out
    assert "taint effect now: none" in out and "NoSchedule now" not in out


def test_prepare_writes_a_root_that_check_reads(tmp_path):
    done = run_demo("--prepare", str(tmp_path / "root"))
    assert done.returncode == 0, done.stderr
    env = stub_nvml_env(tmp_path / "root" / "nvml-scenario.json")  # what --prepare says to set
    check = subprocess.run([sys.executable, "-m", "healthagent", "check", "--host-root", str(tmp_path / "root")],
                           capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "GPUs: 8 read" in check.stdout and "EFA devices: 32 read" in check.stdout
    assert "Verdict: none (healthy)" in check.stdout
