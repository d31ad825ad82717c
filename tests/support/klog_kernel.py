"""The kernel's ring buffer behind ``klogctl`` (syslog(2)), faked for the kernel-log source's tests.

``FakeKernel`` stands behind glibc's calling convention and hands back buffers in READ_ALL's real
format (the fixtures ``tests/fixtures/kmsg/klogctl-*.txt``); with it come kernel-log lines to put
into its ring, a source over it and restarts of that source, and the ``host`` fixture: a host root
whose dev/kmsg is not there, so klogctl is the input.
"""

from __future__ import annotations

import ctypes
import errno
import json
from pathlib import Path

import pytest

from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.klogctl import SYSLOG_ACTION_READ_ALL, SYSLOG_ACTION_SIZE_BUFFER, KernelLog
from healthagent.sources.kernel_log.source import KmsgSource
from tests.support.kmsg_host import BOOT_A, BTIME, NOW, make_host


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kmsg"
EXPECTED = json.loads((FIXTURES / "expected-events.json").read_text())
READ_ALL_FIXTURE = "klogctl-read-all.txt"
NO_TIME_FIXTURE = "klogctl-notime.txt"
ONLY_READ_ACTIONS = {SYSLOG_ACTION_SIZE_BUFFER, SYSLOG_ACTION_READ_ALL}
FIXTURE_LINES = (FIXTURES / READ_ALL_FIXTURE).read_text().splitlines(keepends=True)


class FakeKernel:
    """A kernel's printk ring buffer behind glibc's ``klogctl(type, bufp, len)``.

    A fake, because this machine's real ring cannot be made to hold chosen lines, wrap or refuse on
    demand (the real one is exercised at the end of this file). It honours what the source relies
    on: action 10 returns the buffer size; action 3 copies the newest whole lines that fit ``len``
    into ``bufp``, consumes nothing and returns their length; a refusal returns -1 with errno set,
    as the C library does. Every other action fails with EINVAL and every action is recorded, so a
    test can show that nothing destructive is ever asked for. Left out: the kernel's formatting
    (lines are given as READ_ALL prints them), its space accounting (counted here in formatted
    bytes; the oldest whole lines are dropped when full, as the kernel drops its oldest records),
    and the CAP_SYSLOG check itself (a test sets ``refuse``).
    """

    def __init__(self, text: str | bytes = b"", capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self.lines: list[bytes] = []
        self.actions: list[int] = []
        self.lengths: list[int] = []  # the len argument of each call
        self.refuse: int | None = None
        self.log(text)

    def log(self, text: str | bytes) -> None:
        data = text.encode() if isinstance(text, str) else text
        self.lines.extend(data.splitlines(keepends=True))
        while sum(map(len, self.lines)) > self.capacity:
            self.lines.pop(0)

    def clear(self) -> None:
        """What ``dmesg -C`` (SYSLOG_ACTION_CLEAR by someone else) does to READ_ALL's view."""
        self.lines.clear()

    def __call__(self, action: int, buffer, length: int) -> int:
        self.actions.append(action)
        self.lengths.append(length)
        if self.refuse:
            ctypes.set_errno(self.refuse)
            return -1
        if action == SYSLOG_ACTION_SIZE_BUFFER:
            return self.capacity
        if action != SYSLOG_ACTION_READ_ALL:
            ctypes.set_errno(errno.EINVAL)
            return -1
        newest: list[bytes] = []
        size = 0
        for line in reversed(self.lines):
            if size + len(line) > length:
                break
            newest.append(line)
            size += len(line)
        data = b"".join(reversed(newest))
        ctypes.memmove(buffer, data, len(data))
        return len(data)


def line(usec: int, text: str, priority: int = 4) -> str:
    """One line as READ_ALL prints it with printk.time on."""
    return f"<{priority}>[{usec // 1_000_000:5d}.{usec % 1_000_000:06d}] {text}\n"


def xid_line(usec: int, xid: int, pid: int = 4242, bus: str = "a8") -> str:
    return line(usec, f"NVRM: Xid (PCI:0000:{bus}:00): {xid}, pid={pid}, name=python, Contained: SM (0x1).")


def noise(usec: int) -> str:
    return line(usec, f"pci 0000:{usec % 256:02x}:00.0: enabling device (0000 -> 0002)", priority=6)


def source_for(host: Path, kernel: FakeKernel, boot_id: str = BOOT_A, **kw) -> KmsgSource:
    """A source on ``kernel``; it reads the ring on every collect (tests pass one ``now``)."""
    kw.setdefault("klog_poll_seconds", 0)
    return KmsgSource(str(host), klog=KernelLog(klogctl=kernel, boot_id=boot_id), **kw)


def restart(source: KmsgSource, host: Path, kernel: FakeKernel, **kw) -> KmsgSource:
    """What the agent does across a restart: the cursor goes through JSON into a new source."""
    saved = json.loads(json.dumps(source.cursor.to_dict()))
    source.close()
    return source_for(host, kernel, cursor=KmsgCursor.from_dict(saved), **kw)


def drain(source: KmsgSource, bound: int = 100) -> list:
    """Collect until no backlog is left; every result's events, in order."""
    events = []
    for _ in range(bound):
        result = source.collect(NOW)
        assert result.health.up, result.health.detail
        events += result.xids
        if "; backlog: " not in result.health.detail:
            return events
    raise AssertionError(f"still backlogged after {bound} collects")


def keys(events) -> list[tuple]:
    return [(e.kind, e.xid, e.pci_bus_id, e.pid, round(e.timestamp, 6)) for e in events]


def expected_keys(name: str) -> list[tuple]:
    def stamp(want: dict) -> float:
        return round(BTIME + want["since_boot"], 6) if "since_boot" in want else NOW
    return [(w["kind"], w["xid"], w["pci_bus_id"], w.get("pid"), stamp(w)) for w in EXPECTED[name]["events"]]


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host root whose dev/kmsg is not there (not mounted into the pod): klogctl is the input."""
    return make_host(tmp_path / "host", kmsg_text=None)
