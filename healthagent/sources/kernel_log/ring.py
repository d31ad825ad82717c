"""Which lines of successive ``syslog(2)`` READ_ALL snapshots are new; no I/O.

Why: READ_ALL returns the whole ring each time, without /dev/kmsg's sequence numbers, one
``<pri>[secs.usecs] message`` line per line of a record (``[...]`` is absent when ``printk.time``
is off). ``RingTracker`` tells the new lines apart: cheaply while following (find the last line
handed over from the end of the new snapshot, parse only what follows), exactly across restarts
(timestamp plus how many lines carried it, ``RingPosition``), and it counts records the kernel
overwrote before they were read. ``ResumeAfter`` makes the same decision record by record for the
/dev/kmsg reader resuming from a position the klogctl reader saved.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from healthagent.common import ErrorTally

# Without timestamps a line is recognised by its content, so the anchor is this many lines.
TAIL_LINES = 8
# The prefix READ_ALL puts on each line; the timestamp is absent when printk.time is off.
_LINE_HEAD = re.compile(rb"<\d{1,4}>\[\s*(\d{1,12})\.(\d{6})\]")


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
