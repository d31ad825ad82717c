"""``healthagent check`` and ``healthagent run`` decide the same action for the same host root and
kernel log. The case where they could part: a ConnectX adapter's reboot-class event in this boot
that repeats one logged in an earlier boot (in the same file) is a replacement, and knowing "this
boot" takes the host's boot id, which both read from the host root.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from healthagent.cli import main
from healthagent.config import load_settings
from healthagent.policy.adapters import ADAPTER_EVENT
from tests.support.kmsg_host import BOOT_A, xid_text

FATAL = "mlx5_core 0000:41:00.0: poll_health:785:(pid 0): Fatal error 1 detected"


def stamped(at: float, message: str) -> str:
    when = datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="microseconds")
    return f"{when} gpu-node-17 kernel: {message}\n"


def host_root(root: Path, booted: float) -> Path:
    (root / "proc" / "sys" / "kernel" / "random").mkdir(parents=True)
    (root / "proc" / "sys" / "kernel" / "random" / "boot_id").write_text(BOOT_A + "\n")
    (root / "proc" / "stat").write_text(f"cpu  1 2 3 4 5 6 7 0 0 0\nbtime {int(booted)}\nprocesses 9\n")
    return root


def check_action(host: Path, log: Path, capsys) -> tuple[str, list[tuple[str, str]]]:
    main(["check", "--host-root", str(host), "--kernel-log", str(log), "--no-nvml", "--json"])
    report = json.loads(capsys.readouterr().out)
    return report["verdict"], sorted((f["code"], f["action"]) for f in report["findings"])


def run_action(host: Path, log: Path, state: Path) -> tuple[str, list[tuple[str, str]]]:
    from healthagent.wiring import AgentRuntime

    settings = load_settings(env={}, flags={
        "host_root": str(host), "kernel_log": str(log), "kube": "dry-run", "listen": "127.0.0.1:0",
        "nvml": "false", "state_file": str(state), "node_name": "n1", "training_intake": "off"})
    running = AgentRuntime(settings)
    try:
        verdict = running.agent.cycle()
    finally:
        running.server.stop()
    return verdict.action.value, sorted((f.code, f.action.value) for f in verdict.findings)


@pytest.mark.parametrize("earlier", [
    pytest.param([FATAL], id="a fatal adapter again after the reboot"),
    pytest.param([], id="a first fatal adapter"),
    pytest.param([xid_text(94)], id="an earlier boot's XID 94 only"),
])
def test_check_and_run_take_the_same_action_on_the_same_input(tmp_path, capsys, earlier):
    now = time.time()
    booted = now - 3600
    log = tmp_path / "messages"
    log.write_text("".join(stamped(booted - 2 * 86_400 + n, line) for n, line in enumerate(earlier))
                   + stamped(now - 60, FATAL))
    host = host_root(tmp_path / "host", booted)
    checked = check_action(host, log, capsys)
    ran = run_action(host, log, tmp_path / "state.json")
    assert checked == ran
    expected = "replace_node" if earlier == [FATAL] else "reboot_node"
    assert ran == (expected, [(ADAPTER_EVENT, expected)])
