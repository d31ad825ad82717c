"""The agent's state file turned hostile: garbage, huge, from another version, or on a dying disk
(full, a failing or hanging fsync, EIO on read).

Real parts wherever they can show the fault: the agent (``AgentRuntime``) on the demo node, the
fake API server, real files, a real filesystem that is full (a small tmpfs, where this machine lets
the test mount one). Faults that a real disk cannot be made to show on demand (EIO on read, a
failing fsync) are injected at the state store's disk boundary, and each such test says so.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from tests.reliability.helpers import REPLACE, alive, gpu_xid_events, our_taints, scrape, wait_metric, wait_warm
from tests.support.live_agent import wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.integration]


# -- a state file that is not what the agent wrote ---------------------------------------------------

def state_errors(runtime, kind: str) -> float | None:
    return scrape(runtime).value("healthagent_internal_errors_total", component="state", kind=kind)


def state_errors_at_least(runtime, kind: str, n: int) -> None:
    wait_metric(runtime, lambda s: (s.value("healthagent_internal_errors_total", component="state",
                                            kind=kind) or 0) >= n, f"{n} state errors of kind {kind}")


def detects_and_saves(runtime, fake, demo, state_path: Path) -> None:
    """The agent acts on a new fault and its state file holds it afterwards."""
    wait_warm(runtime)
    demo.inject_xid(3, 94)
    wait_until(lambda: our_taints(fake) == REPLACE, what="the replace_node taint")

    def saved_finding():
        try:
            state = json.loads(state_path.read_bytes())
        except (OSError, ValueError):
            return False
        return any(e["code"] == "GPU_XID" for e in state["classifier"]["book"]["entries"].values())

    wait_until(saved_finding, what="the finding in the state file")
    assert alive(runtime)


def test_a_state_file_of_200k_nested_brackets_is_set_aside_and_the_agent_starts_clean(
        tmp_path, fake, demo, start_agent):
    state = tmp_path / "state" / "state.json"
    state.parent.mkdir()
    state.write_bytes(b"[" * 200_000)  # the parser recurses once per bracket
    runtime = start_agent(state_file=str(state))
    detects_and_saves(runtime, fake, demo, state)
    assert state_errors(runtime, "corrupt") == 1
    assert (state.parent / "state.json.corrupt").read_bytes() == b"[" * 200_000


def test_a_60_mb_state_file_is_refused_at_load_and_every_later_save_works(tmp_path, fake, demo, start_agent):
    state = tmp_path / "state" / "state.json"
    state.parent.mkdir()
    with open(state, "w", encoding="utf-8") as fh:  # valid JSON: a parser would take it all
        fh.write('{"effects": {"outbox": [], "junk": "')
        fh.write("x" * (60 * 1024 * 1024))
        fh.write('"}}')
    runtime = start_agent(state_file=str(state))
    detects_and_saves(runtime, fake, demo, state)
    assert state.stat().st_size < 1024 * 1024
    assert state_errors(runtime, "too_large") == 1  # the load; no save was refused
    assert (state.parent / "state.json.corrupt").stat().st_size > 60 * 1024 * 1024


def test_a_state_file_from_another_version_keeps_what_it_can_read(tmp_path, fake, demo, start_agent):
    """An older or newer agent's file: unknown keys and parts of the wrong type are dropped one by
    one; the open finding beside them is kept (the taint stays), and nothing crashes."""
    first = start_agent()
    wait_warm(first)
    demo.inject_xid(3, 79)  # reboot_node
    wait_until(lambda: our_taints(fake) == [("reboot_node", "NoSchedule")], what="the reboot_node taint")
    first.stop()
    path = Path(first.settings.state_file)
    state = json.loads(path.read_bytes())
    state["classifier"].update(version=7, gpus="a list in version 7", known_gpus=42, boot_id=None,
                               added_in_version_7={"x": 1})
    state["classifier"]["book"]["streaks"] = {"GPU_LOST/x": "broken"}
    state["effects"]["reported"] = [1, 2]
    state["from_the_future"] = [1, 2, 3]
    path.write_text(json.dumps(state))
    second = start_agent()
    wait_warm(second)
    assert second.agent.classifier.restore_errors == 5  # version, gpus, known_gpus, boot_id, one streak
    assert [f.code for f in second.agent.verdict.findings] == ["GPU_XID"]
    wait_until(lambda: second.agent.effects_worker.reconciles >= 2, what="reconciles after the restart")
    assert our_taints(fake) == [("reboot_node", "NoSchedule")]
    assert alive(second)


# -- a disk that fails under the state file -----------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem (tmpfs), so the disk can really fill up; skipped where this machine
    does not let the test mount one (it needs CAP_SYS_ADMIN)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (mount, as root with CAP_SYS_ADMIN): "
                    f"{done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(disk: Path) -> Path:
    """Write a file until the filesystem says ENOSPC; returns it (delete it to free the space)."""
    filler = disk / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def saved_state(path: Path) -> dict:
    return json.loads(path.read_bytes())


def xid_findings(state: dict) -> int:
    return sum(e["code"] == "GPU_XID" for e in state["classifier"]["book"]["entries"].values())


def test_a_full_disk_under_the_state_file_never_stops_detection_or_action(small_disk, fake, demo, start_agent):
    state = small_disk / "state" / "state.json"
    runtime = start_agent(state_file=str(state), efa_interval_seconds=1)
    wait_warm(runtime)
    wait_until(lambda: state.exists(), what="the first save")
    filler = fill(small_disk)
    demo.inject_xid(3, 94)
    wait_until(lambda: our_taints(fake) == REPLACE, what="the taint, with the disk full")
    state_errors_at_least(runtime, "unwritable", 2)
    assert xid_findings(saved_state(state)) == 0  # the old file, whole: never a part of a new one
    assert [p.name for p in state.parent.iterdir()] == ["state.json"]  # no temp file left behind
    filler.unlink()
    wait_until(lambda: xid_findings(saved_state(state)) == 1, what="the finding saved once there is room")
    assert alive(runtime)


class FailingFsync:
    """A fake ``os`` module for ``healthagent.common`` (the state file's writer): the real one,
    except that fsync fails with EIO while ``failing`` is set. No real disk can be made to fail an
    fsync on demand; this is the call a dying NVMe fails."""

    def __init__(self) -> None:
        self.failing = False
        self.failures = 0

    def __getattr__(self, name: str):
        return getattr(os, name)

    def fsync(self, fd: int) -> None:
        if self.failing:
            self.failures += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        os.fsync(fd)


def fault_under_a_warm_agent(fault: FailingFsync, demo, fake, start_agent, monkeypatch):
    """A warm agent that saved once; then its disk starts to fail and XID 94 comes: the agent
    acts on it regardless. Returns (runtime, state file)."""
    monkeypatch.setattr("healthagent.common.os", fault)
    runtime = start_agent(efa_interval_seconds=1)
    wait_warm(runtime)
    state = Path(runtime.settings.state_file)
    wait_until(lambda: state.exists(), what="the first save")
    fault.failing = True
    demo.inject_xid(3, 94)
    wait_until(lambda: our_taints(fake) == REPLACE, what="the taint, with the state disk failing")
    wait_until(lambda: len(gpu_xid_events(fake)) == 1, what="the Event, with the state disk failing")
    return runtime, state


def test_a_failing_fsync_is_counted_logged_once_and_the_agent_keeps_acting(
        fake, demo, start_agent, monkeypatch, caplog):
    flaky = FailingFsync()
    runtime, state = fault_under_a_warm_agent(flaky, demo, fake, start_agent, monkeypatch)
    state_errors_at_least(runtime, "unwritable", 3)
    # never renamed over the old file: a file whose fsync failed may not be on the disk
    assert xid_findings(saved_state(state)) == 0
    # each failed save removes its temporary file (a save may be in flight at any one look)
    wait_until(lambda: [p.name for p in state.parent.iterdir()] == ["state.json"],
               what="no temporary file left beside the state file")
    logged = [r for r in caplog.records if "error=unwritable" in r.getMessage()]
    assert len(logged) == 1 and "Input/output error" in logged[0].getMessage()  # once a minute, not per save
    flaky.failing = False
    wait_until(lambda: xid_findings(saved_state(state)) == 1, what="the finding saved once fsync works")
    assert alive(runtime)


class HangingFsync(FailingFsync):
    """As ``FailingFsync``, but fsync hangs while ``failing`` is set (a dying NVMe can take minutes
    to fail one) until ``released`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def fsync(self, fd: int) -> None:
        if self.failing:
            self.failures += 1
            self.released.wait(120)
        os.fsync(fd)


def test_an_fsync_that_hangs_never_holds_detection_or_action(fake, demo, start_agent, monkeypatch):
    hanging = HangingFsync()
    try:
        runtime, state = fault_under_a_warm_agent(hanging, demo, fake, start_agent, monkeypatch)
        state_errors_at_least(runtime, "slow", 1)
        assert xid_findings(saved_state(state)) == 0 and alive(runtime)
    finally:
        hanging.failing = False
        hanging.released.set()
    wait_until(lambda: xid_findings(saved_state(state)) == 1, what="the finding saved once the disk answers")


def test_eio_reading_the_state_file_at_start_is_counted_and_the_agent_starts_clean(
        tmp_path, fake, demo, start_agent, monkeypatch):
    """The read is failed at the state store's disk boundary (a fake: a real EIO needs a broken
    disk); everything else is real."""
    from healthagent.effects.state import StateStore

    state = tmp_path / "state" / "state.json"
    state.parent.mkdir()
    state.write_text('{"boot_id": "b0"}')

    def eio(self):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(StateStore, "_read", eio)
    runtime = start_agent(state_file=str(state))
    detects_and_saves(runtime, fake, demo, state)
    assert state_errors(runtime, "unreadable") == 1
