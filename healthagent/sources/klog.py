"""The kernel's ring buffer through the ``syslog(2)`` system call, for containers that may not open /dev/kmsg.

Why this exists: in a Kubernetes pod that is not privileged, ``open("/host/dev/kmsg")`` fails with
EPERM even with CAP_SYSLOG, because the container's device cgroup (the eBPF device filter runc
installs on cgroup v2) admits only the runtime's default device nodes and Kubernetes adds none for
a hostPath volume (node-problem-detector runs privileged for this reason, its issue #698). The
system call reads the same ring buffer without opening any device node, so no device cgroup is
involved. What it needs, from the sources:

- **syslog(2)** (man-pages, "syslog, klogctl - read and/or clear kernel message ring buffer"; the
  numbers are ``include/linux/syslog.h``): ``SYSLOG_ACTION_SIZE_BUFFER`` (10) returns the size of
  the kernel's log buffer; ``SYSLOG_ACTION_READ_ALL`` (3) "will read the last len bytes from the
  log buffer (nondestructively), but will not read more than was written into the buffer since
  the last 'clear ring buffer' command". Since Linux 2.6.37 these two need CAP_SYSLOG when
  ``/proc/sys/kernel/dmesg_restrict`` is 1 (Ubuntu's default) and nothing when it is 0. The
  kernel checks it with ``capable()`` (``check_syslog_permissions`` in ``kernel/printk/printk.c``),
  that is in the initial user namespace: a pod with ``hostUsers: false`` is refused; an LSM can
  still refuse through ``security_syslog`` (SELinux's ``syslog_read``).
  ``SYSLOG_ACTION_READ`` (2) consumes what it returns (it is what /proc/kmsg readers such as
  rsyslog's imklog use) and 4/5 clear the buffer: this module has no way to issue them.
- **Seccomp**: moby's ``profiles/seccomp/default.json`` allows ``syslog`` only when CAP_SYSLOG (or
  CAP_SYS_ADMIN) is in the bounding set (``"includes": {"caps": ["CAP_SYSLOG"]}``); containerd's
  ``contrib/seccomp/seccomp_default.go`` (the CRI's RuntimeDefault) adds it under
  ``case "CAP_SYSLOG"`` (releases before that allowed it unconditionally). Kubernetes'
  ``capabilities: {add: [SYSLOG]}`` puts CAP_SYSLOG in the bounding set, so RuntimeDefault lets
  the call through and the kernel's own capability check decides. Without the capability the
  profile answers EPERM before the kernel does; the fix is the same.

The output is text, one ``<pri>[secs.usecs] message`` line per line of a record (a multi-line
record repeats its prefix on every line, ``kernel/printk/printk.c``: "Each line will be preceded
with a prefix"; ``[...]`` is absent when ``printk.time`` is off), without /dev/kmsg's sequence
numbers, dictionary lines or ``\\xNN`` escaping. Each call costs the kernel a walk over every
record in the ring, however small ``len`` is (``syslog_print_all`` -> ``find_first_fitting_seq``
sums every record's length to find where the returned text starts), so the caller reads it at
most about once a second rather than at /dev/kmsg's polling rate. ``RingTracker`` tells which
lines of successive snapshots are new: cheaply while following (find the last line handed over
from the end of the new snapshot, parse only what follows), exactly across restarts (timestamp
plus how many lines carried it), and it counts records the kernel overwrote before they were read.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from healthagent.sources.base import ErrorTally, read_boot_id

SYSLOG_ACTION_READ_ALL = 3
SYSLOG_ACTION_SIZE_BUFFER = 10
# READ_ALL returns formatted text (a ``<4>[ 1234.567890] `` prefix per line), which can be longer
# than the stored records SIZE_BUFFER measures; twice the size always holds the whole ring.
READ_BUFFER_FACTOR = 2
# Without timestamps a line is recognised by its content, so the anchor is this many lines.
TAIL_LINES = 8
# The prefix READ_ALL puts on each line; the timestamp is absent when printk.time is off.
_LINE_HEAD = re.compile(rb"<\d{1,4}>\[\s*(\d{1,12})\.(\d{6})\]")

Klogctl = Callable[[int, Any, int], int]
"""glibc's ``int klogctl(int type, char *bufp, int len)``: -1 with errno set on failure."""


def _libc_klogctl() -> Klogctl:
    """The C library's ``klogctl``; loading it is deferred to first use (no import side effect)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).klogctl
    except (OSError, AttributeError):
        raise OSError(errno.ENOSYS, "klogctl is not available in this C library") from None
    function.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char), ctypes.c_int)
    function.restype = ctypes.c_int
    return function


class KernelLog:
    """Non-destructive snapshots of the running kernel's ring buffer (READ_ALL), nothing else.

    ``klogctl`` is the function called (glibc's by default; tests pass a fake kernel with the same
    calling convention). ``boot_id`` is the boot of the kernel it reads (default: this machine's),
    so the caller can tell whether that kernel is the host root's.
    """

    def __init__(self, klogctl: Klogctl | None = None, boot_id: str | None = None) -> None:
        self._klogctl = klogctl
        self._boot_id = boot_id
        self._buffer: ctypes.Array | None = None

    def boot_id(self) -> str:
        return read_boot_id("/") if self._boot_id is None else self._boot_id

    def open(self) -> int:
        """Size the read buffer from SIZE_BUFFER (fixed for the boot); raises OSError when refused."""
        size = self._call(SYSLOG_ACTION_SIZE_BUFFER, None, 0)
        if size <= 0:
            raise OSError(errno.EIO, f"klogctl SIZE_BUFFER returned {size}")
        self._buffer = ctypes.create_string_buffer(size * READ_BUFFER_FACTOR)
        return size

    def read_all(self) -> bytes:
        """The whole ring as READ_ALL formats it, oldest line first; raises OSError when refused."""
        if self._buffer is None:
            self.open()
        assert self._buffer is not None
        count = self._call(SYSLOG_ACTION_READ_ALL, self._buffer, len(self._buffer))
        return ctypes.string_at(self._buffer, min(count, len(self._buffer)))

    def close(self) -> None:
        self._buffer = None

    def _call(self, action: int, buffer: ctypes.Array | None, length: int) -> int:
        if self._klogctl is None:
            self._klogctl = _libc_klogctl()
        result = self._klogctl(action, buffer, length)
        if result < 0:
            code = ctypes.get_errno() or errno.EIO
            raise OSError(code, os.strerror(code))
        return result


# -- telling new lines from old ones ------------------------------------------------------------

def line_usec(data: bytes, start: int) -> int | None:
    """The timestamp (microseconds since boot) of the READ_ALL line at ``start``; None without one."""
    head = _LINE_HEAD.match(data, start)
    return int(head.group(1)) * 1_000_000 + int(head.group(2)) if head else None


class ResumeAfter:
    """Whether a record was handed over before, from the last one's timestamp and how many shared it.

    Fed the records in ring order. Records older than ``usec`` were handed over, and so were the
    first ``same`` stamped ``usec``. From the first record past that point on, every record is new,
    even one stamped a little earlier (CPUs stamp with their own clocks): a doubtful record is
    handed over twice rather than never.
    """

    def __init__(self, usec: int, same: int) -> None:
        self.usec = usec
        self.same = same
        self.done = False
        self._at_usec = 0

    def handed_over(self, usec: int | None) -> bool:
        if self.done:
            return False
        if usec is None or usec > self.usec:
            self.done = True
        elif usec == self.usec:
            self._at_usec += 1
            self.done = self._at_usec > self.same
        else:
            self.done = self._at_usec >= self.same > 0
        return not self.done


@dataclass(frozen=True)
class RingPosition:
    """The last line handed over: its timestamp and how many lines in a row carried it, or, for a
    log without timestamps, digests of the last lines (oldest first)."""

    usec: int | None = None
    same: int = 0
    tail: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        return self.usec is not None or bool(self.tail)


def _digest(line: bytes) -> str:
    return hashlib.blake2b(line, digest_size=8).hexdigest()


def _line_start(data: bytes, line_end: int) -> int:
    """Start of the line that ends (after its newline) at ``line_end``."""
    return data.rfind(b"\n", 0, line_end - 1) + 1


def rewind_lines(data: bytes, offset: int, count: int) -> int:
    """The start of the ``count`` lines before ``offset`` (fewer at the start of ``data``)."""
    for _ in range(count):
        if offset <= 0:
            break
        offset = _line_start(data, offset)
    return offset


class RingTracker:
    """Which bytes of each READ_ALL snapshot are lines not handed over yet.

    While following, ``anchor`` holds the bytes of the last line handed over (the last
    ``TAIL_LINES`` without timestamps); it is found from the end of the next snapshot with
    ``rfind`` and only what follows is new, so a poll costs one search, not a parse of the ring.
    When it is gone, the ring wrapped past it or was cleared: the kernel drops its oldest records
    first, so everything left is new, and lines in between may be lost (counted ``overrun``).
    After a restart only ``position`` is known: the last line is looked for among the lines of
    its timestamp (by digest), or, without timestamps, the last lines by their content.
    """

    def __init__(self, start: RingPosition | None, tally: ErrorTally) -> None:
        self.position = start or RingPosition()
        self.tally = tally
        self.anchor = b""
        self._resuming = self.position.known  # until the first anchor is set
        self._noted_untimestamped = False

    def new_region(self, data: bytes, budget: int) -> tuple[int, int, int]:
        """``(start, stop, end)``: ``data[start:stop]`` holds up to ``budget`` new complete lines;
        ``stop < end`` means more are waiting for the next call."""
        end = data.rfind(b"\n") + 1
        start = self._start(data, end)
        return start, _after_lines(data, start, end, budget), end

    def advance(self, data: bytes, start: int, stop: int) -> None:
        """Everything up to ``stop`` has been handed over: move the anchor and the position there."""
        if stop <= 0:
            return
        last = _line_start(data, stop)
        usec = line_usec(data, last)
        if usec is not None:
            self.anchor = data[last:stop]
            if stop > start:
                self.position = RingPosition(usec=usec, same=_lines_stamped(data, last, usec),
                                             tail=(_digest(data[last:stop - 1]),))
            return
        self.anchor = data[rewind_lines(data, stop, TAIL_LINES):stop]
        if stop > start:
            self.position = RingPosition(tail=tuple(_digest(line) for line in self.anchor.split(b"\n")[:-1]))
            self._note_untimestamped()

    # -- where the new lines start -----------------------------------------------------------------

    def _start(self, data: bytes, end: int) -> int:
        if self.anchor:
            found = data.rfind(self.anchor, 0, end)
            if found >= 0:
                return found + len(self.anchor)
            self.anchor = b""
            self._resuming = False
            if self.position.usec is None:  # the newest of the anchor's lines may still be there
                return self._resync_by_content(data, end, self.position.tail)
            # The last line handed over was overwritten (or the ring cleared): the kernel drops its
            # oldest records first, so every line left is newer, whatever its stamp says; lines
            # logged in between may be lost (with equal stamps there is no telling).
            self._count_overrun()
            return 0
        if self._resuming and self.position.usec is not None:  # a restart: only the position is known
            return self._resync_by_time(data, end, self.position)
        if self._resuming and self.position.tail:
            return self._resync_by_content(data, end, self.position.tail)
        return 0  # nothing handed over in this boot, or since the ring wrapped: all of it is new

    def _resync_by_time(self, data: bytes, end: int, position: RingPosition) -> int:
        """Walk back from the newest line to the group stamped ``usec``: the last line handed over
        is found there by its digest; a cursor without one (the device reader's) decides forwards
        by the count of lines that carried the stamp."""
        usec = position.usec
        assert usec is not None
        last = position.tail[-1] if position.tail else None
        lines: list[tuple[int, int | None]] = []  # (start, usec), newest first
        line_end = end
        seen_group = False
        while line_end > 0:
            start = _line_start(data, line_end)
            stamp = line_usec(data, start)
            if stamp is not None and stamp < usec and seen_group:
                break
            if stamp == usec:
                seen_group = True
                if last is not None and _digest(data[start:line_end - 1]) == last:
                    return line_end
            lines.append((start, stamp))
            line_end = start
        lines.reverse()
        if line_end == 0 and last is not None:
            self._count_overrun()  # the last line handed over is gone: every line left is newer
            return 0
        if line_end == 0 and lines and lines[0][1] is not None and lines[0][1] > usec:
            self._count_overrun()
        resume = ResumeAfter(usec, position.same)
        for start, stamp in lines:
            if not resume.handed_over(stamp):
                return start
        return end

    def _resync_by_content(self, data: bytes, end: int, tail: tuple[str, ...]) -> int:
        """Without timestamps: the newest place where the last lines handed over appear, in order."""
        if not tail:
            return 0
        line_end = end
        while line_end > 0:
            start = _line_start(data, line_end)
            if _digest(data[start:line_end - 1]) == tail[-1] and self._tail_precedes(data, start, tail):
                return line_end
            line_end = start
        self._count_overrun()
        return 0

    @staticmethod
    def _tail_precedes(data: bytes, start: int, tail: tuple[str, ...]) -> bool:
        """Whether the lines before ``start`` are ``tail[:-1]`` (as far as the ring still holds)."""
        for digest in reversed(tail[:-1]):
            if start == 0:
                return True  # the older lines were overwritten
            previous = _line_start(data, start)
            if _digest(data[previous:start - 1]) != digest:
                return False
            start = previous
        return True

    def _count_overrun(self) -> None:
        self.tally.count("overrun", "the last kernel-log line read is no longer in the ring buffer (it "
                                    "wrapped between reads, or was cleared): lines logged after it may "
                                    "have been lost")

    def _note_untimestamped(self) -> None:
        if not self._noted_untimestamped:
            self._noted_untimestamped = True
            self.tally.count("untimestamped", "kernel-log lines carry no timestamp (printk.time is off): "
                                              "new lines are told from old ones by their content, so a line "
                                              "identical to the last ones handed over may be taken for them")


def _lines_stamped(data: bytes, last: int, usec: int) -> int:
    """How many lines in a row, ending with the one at ``last``, carry ``usec``."""
    count = 1
    start = last
    while start > 0:
        start = _line_start(data, start)
        if line_usec(data, start) != usec:
            break
        count += 1
    return count


def _after_lines(data: bytes, start: int, end: int, budget: int) -> int:
    """The offset after at most ``budget`` complete lines from ``start``."""
    if data.count(b"\n", start, end) <= budget:
        return end
    stop = start
    for _ in range(budget):
        stop = data.index(b"\n", stop) + 1
    return stop


def decode_text(data: bytes, tally: ErrorTally, where: str) -> str:
    """``data`` as UTF-8; undecodable bytes are replaced and counted ``decode`` (one per line)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        bad = sum(1 for line in text.split("\n") if "\ufffd" in line)
        tally.count("decode", f"{where}: {bad} line(s) with bytes that are not UTF-8 (replaced)", n=max(bad, 1))
        return text
