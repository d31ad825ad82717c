"""The kernel log wakes the loop when it is written (``kernel_log/wake.py``), and an idle loop sleeps.

Real parts: pipes and the machine's own ``/dev/kmsg`` (where this user may write it) for
``poll(2)``, real files and inotify for a followed log, the agent (``AgentRuntime``) on the demo
node. No test measures how long anything took: a wait that should be woken by data is given a
timeout far longer than any run needs, and returns False only if it was not woken; an idle loop is
checked by counting its cycles.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from healthagent.config import load_settings
from healthagent.sources.kernel_log import wake as wake_module
from healthagent.sources.kernel_log.wake import (
    Doorbell,
    InotifyWaiter,
    ReadableWaiter,
    TickWaiter,
    file_waiter,
)
from healthagent.sources.kernel_log.source import KmsgSource
from tests.support.wait import wait_for

LONG = 60.0  # a wait that must be woken well before this


def later(action, delay: float = 0.05) -> threading.Thread:
    """Run ``action`` on a thread after ``delay``, while the caller is already waiting."""
    thread = threading.Thread(target=lambda: (time.sleep(delay), action()), daemon=True)
    thread.start()
    return thread


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


# -- the doorbell ----------------------------------------------------------------------------------

def test_the_doorbell_is_an_event_that_poll_can_wait_on():
    bell = Doorbell()
    reader, writer = os.pipe()
    try:
        waiter = ReadableWaiter(reader)
        assert waiter.wait(0.01, bell) is False
        later(bell.set)
        assert waiter.wait(LONG, bell) is True and bell.is_set()
        bell.clear()
        assert not bell.is_set() and waiter.wait(0.01, bell) is False  # cleared: not readable
        bell.set()
        bell.set()  # twice before a clear: still one clear empties it
        bell.clear()
        assert waiter.wait(0.01, bell) is False
    finally:
        os.close(reader)
        os.close(writer)


# -- a character device: poll ----------------------------------------------------------------------

def test_a_descriptor_wakes_the_waiter_when_data_arrives():
    reader, writer = os.pipe()
    try:
        waiter = ReadableWaiter(reader)
        assert waiter.wait(0.01) is False
        later(lambda: os.write(writer, b"record\n"))
        assert waiter.wait(LONG) is True
    finally:
        os.close(reader)
        os.close(writer)


def writable_kmsg() -> int:
    try:
        return os.open("/dev/kmsg", os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        pytest.skip(f"/dev/kmsg cannot be written here ({exc.strerror})")


def test_the_real_dev_kmsg_wakes_the_waiter_on_a_new_record():
    writer = writable_kmsg()
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.lseek(fd, 0, os.SEEK_END)  # past every record logged so far
        later(lambda: os.write(writer, b"healthagent test: wake on a new record\n"))
        assert ReadableWaiter(fd).wait(LONG) is True
        assert b"healthagent test: wake on a new record" in os.read(fd, 16384)
    finally:
        os.close(fd)
        os.close(writer)


# -- a regular file: inotify -----------------------------------------------------------------------

@pytest.fixture
def log_file(tmp_path: Path):
    path = tmp_path / "log" / "kern.log"
    path.parent.mkdir()
    path.write_text("first line\n")
    waiter = InotifyWaiter(str(path))
    yield path, waiter
    waiter.close()


def test_an_append_wakes_the_file_waiter_and_nothing_else_does(log_file):
    path, waiter = log_file
    assert waiter.wait(0.01) is False
    later(lambda: append(path, "an XID\n"))
    assert waiter.wait(LONG) is True
    assert waiter.wait(0.01) is False  # the write was seen once
    append(path.parent / "other.log", "another log in the same directory\n")
    assert waiter.wait(0.05) is False
    path.write_text("")  # truncated
    assert waiter.wait(LONG) is True


def test_the_file_waiter_follows_a_rotation(log_file):
    path, waiter = log_file
    rotated = path.with_name("kern.log.1")
    os.rename(path, rotated)
    path.write_text("")  # the new log at the path
    assert waiter.wait(LONG) is True
    later(lambda: append(path, "in the new file\n"))
    assert waiter.wait(LONG) is True
    later(lambda: append(rotated, "a writer that has not reopened yet\n"))
    assert waiter.wait(LONG) is True  # the renamed-away file is drained too


def test_a_log_created_after_the_waiter_is_watched(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text("")
    waiter = InotifyWaiter(str(path))
    try:
        path.unlink()
        assert waiter.wait(LONG) is True  # its name was deleted
        path.write_text("")
        assert waiter.wait(LONG) is True  # and created again
        later(lambda: append(path, "x\n"))
        assert waiter.wait(LONG) is True
    finally:
        waiter.close()


def test_the_bell_wakes_the_file_waiter(log_file):
    _, waiter = log_file
    bell = Doorbell()
    later(bell.set)
    assert waiter.wait(LONG, bell) is True


def test_without_inotify_the_file_is_polled(tmp_path, monkeypatch, caplog):
    """The per-user limit of inotify instances reached (EMFILE; a C library without inotify is
    the same): no waiter, a log line, and the loop polls as before. The failure is the one fake
    here."""

    class NoInotify:
        def __init__(self) -> None:
            raise OSError(errno.EMFILE, "inotify_init1: Too many open files")

    monkeypatch.setattr(wake_module, "_Inotify", NoInotify)
    path = tmp_path / "kern.log"
    path.write_text("")
    with caplog.at_level(logging.INFO, logger="healthagent.sources.kmsg"):
        assert file_waiter(str(path)) is None
    assert "no_inotify" in caplog.text
    source = KmsgSource(str(tmp_path), kernel_log=str(path))
    source.collect(time.time())
    assert source.data_waiter() is None


def test_the_tick_waiter_wakes_on_its_interval_or_the_bell():
    waiter = TickWaiter(0.05)
    assert waiter.wait(LONG) is True  # its interval passed
    assert waiter.wait(0.0) is False
    bell = Doorbell()
    bell.set()
    assert TickWaiter(3600).wait(LONG, bell) is True


# -- each input's waiter ---------------------------------------------------------------------------

def test_each_input_has_its_waiter_and_closing_the_source_closes_it(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text("")
    source = KmsgSource(str(tmp_path), kernel_log=str(path))
    assert source.data_waiter() is None  # nothing open yet
    source.collect(time.time())
    waiter = source.data_waiter()
    assert isinstance(waiter, InotifyWaiter)
    source.close()
    assert source.data_waiter() is None and waiter.fd == -1


def test_the_real_dev_kmsg_is_waited_on_with_poll(tmp_path):
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg cannot be read here")
    (tmp_path / "dev").mkdir()
    os.symlink("/dev/kmsg", tmp_path / "dev" / "kmsg")
    source = KmsgSource(str(tmp_path))
    try:
        result = source.collect(time.time())
        assert result.health.up, result.health.detail
        assert isinstance(source.data_waiter(), ReadableWaiter)
    finally:
        source.close()


def test_the_ring_through_klogctl_is_woken_on_its_read_interval(tmp_path):
    """A host root of this boot without dev/kmsg: the source reads the machine's ring through
    klogctl, which nothing can wait on, so the loop is woken when the next read is allowed."""
    from healthagent.sources.kernel_log.klogctl import KernelLog

    try:
        KernelLog().read_all()
    except OSError as exc:
        pytest.skip(f"klogctl READ_ALL refused here ({exc.strerror})")
    random_dir = tmp_path / "proc" / "sys" / "kernel" / "random"
    random_dir.mkdir(parents=True)
    (random_dir / "boot_id").write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    source = KmsgSource(str(tmp_path), klog_poll_seconds=0.05)
    try:
        assert source.collect(time.time()).health.detail.startswith("klogctl")
        waiter = source.data_waiter()
        assert isinstance(waiter, TickWaiter) and waiter.interval == 0.05
        assert waiter.wait(LONG) is True
    finally:
        source.close()


# -- the loop --------------------------------------------------------------------------------------

def runtime_on_demo(tmp_path: Path, **flags):
    from healthagent.demo.node import build_demo_root
    from healthagent.wiring import AgentRuntime

    demo = build_demo_root(tmp_path / "host")
    values = dict(host_root=str(demo.root), kube="off", nvml="false", listen="127.0.0.1:0",
                  state_file=str(tmp_path / "state" / "state.json"), efa_interval_seconds="3600")
    values.update(flags)
    return demo, AgentRuntime(load_settings(env={}, flags=values))


def test_an_idle_loop_does_not_cycle(tmp_path):
    """Nothing written, nothing due: at the default poll interval (0.1 s) the loop used to cycle
    ten times a second; now it sleeps until the next collection (or its idle limit)."""
    _, runtime = runtime_on_demo(tmp_path)
    runtime.start()
    try:
        agent = runtime.agent
        wait_for(lambda: agent.cycles >= 1, what="a first cycle")
        before = agent.cycles
        time.sleep(1.5)
        assert agent.cycles == before
    finally:
        runtime.stop()


def test_a_kernel_log_write_wakes_the_loop_before_its_poll_interval(tmp_path):
    """The poll interval is 60 s and nothing periodic is due for an hour: the XID is read because
    the write woke the loop (the wait below would time out long before 60 s otherwise)."""
    demo, runtime = runtime_on_demo(tmp_path, kmsg_poll_seconds="60")
    runtime.start()
    try:
        agent = runtime.agent
        wait_for(lambda: agent.cycles >= 1, what="a first cycle")
        demo.inject_xid(3, 79, via="kmsg")
        wait_for(lambda: any(c.xid == 79 for c in agent.xids.snapshot()), timeout=30, what="the XID read")
    finally:
        runtime.stop()


def test_a_waiter_that_fails_is_counted_and_the_loop_goes_on_polling(tmp_path):
    demo, runtime = runtime_on_demo(tmp_path, efa_interval_seconds="1")
    runtime.start()
    try:
        agent = runtime.agent
        wait_for(lambda: agent.cycles >= 1, what="a first cycle")
        agent.data_waiter().close()  # closed behind the source's back: poll() refuses it
        wait_for(lambda: agent.loop_errors["cycle"] >= 1, timeout=30, what="the failed wait counted")
        demo.inject_xid(3, 79, via="kmsg")
        wait_for(lambda: any(c.xid == 79 for c in agent.xids.snapshot()), timeout=30, what="the XID read")
        assert runtime._thread.is_alive()
    finally:
        runtime.stop()


def test_the_wake_and_a_stop_end_the_sleep(tmp_path):
    _, runtime = runtime_on_demo(tmp_path, kmsg_poll_seconds="60")
    agent = runtime.agent
    stop = threading.Event()
    loop = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    loop.start()
    try:
        wait_for(lambda: agent.cycles >= 1, what="a first cycle")
        before = agent.cycles
        agent.wake.set()  # what NVML's event thread does
        wait_for(lambda: agent.cycles > before, timeout=30, what="a cycle after the wake rang")
        stop.set()  # without ringing the wake: seen within one idle slice (1 s), not an idle wait (10 s)
        loop.join(5)
        assert not loop.is_alive()
    finally:
        stop.set()
        runtime.server.stop()
