"""Follows the kernel's ring buffer through ``syslog(2)`` READ_ALL, when /dev/kmsg is refused.

Why: a container that is not privileged cannot open the host's /dev/kmsg (its device cgroup
refuses the device node, EPERM, whatever its capabilities), and a pod may not mount it at all.
The system call reads the same ring and needs only CAP_SYSLOG (``klogctl``). Each call costs the
kernel a walk over the whole ring, so it happens at most every ``poll_seconds``, not at
/dev/kmsg's polling rate, and only the lines after the last one handed over (``ring``) are
decoded and parsed.
"""

from __future__ import annotations

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.formats import decode_text
from healthagent.sources.kernel_log.klogctl import KernelLog
from healthagent.sources.kernel_log.parser import PARSER_CONTEXT_LINES, SOURCE_NAME, LogChunk
from healthagent.sources.kernel_log.reader import InputError, Sink, log
from healthagent.sources.kernel_log.ring import RingPosition, RingTracker, rewind_lines
from healthagent.sources.kernel_log.wake import TickWaiter
from healthagent.sources.kernel_log.wording import (
    describe_both_unreadable,
    describe_device_refusal,
    klogctl_mode,
)


class KlogctlReader:
    """A ``KernelLogReader`` over READ_ALL snapshots of the ring (``kernel``); ``why`` says why
    /dev/kmsg is not read, for the health detail."""

    keeps_earlier_boots = False

    def __init__(self, kernel: KernelLog, tally: ErrorTally, saved: RingPosition | None, why: str,
                 description: str, poll_seconds: float) -> None:
        self.kernel = kernel
        self.tally = tally
        self.why = why
        self.description = description
        self.poll_seconds = poll_seconds
        self.tracker = RingTracker(saved, tally)
        self._primed = False
        self._last_read: float | None = None
        kernel.open()  # SIZE_BUFFER: refused like READ_ALL, so a missing privilege shows at once

    @classmethod
    def open(cls, kernel: KernelLog, saved: KmsgCursor, same_boot: bool, tally: ErrorTally,
             boot_id: str, *, device_path: str, refusal: OSError,
             poll_seconds: float) -> "KlogctlReader":
        """Read the ring instead of ``device_path``, which was refused (``refusal``); resume after
        ``saved`` when it is this boot's. Raises ``InputError`` when klogctl is refused too."""
        position = saved.ring_position() if same_boot else None
        why = describe_device_refusal(device_path, refusal)
        try:
            reader = cls(kernel, tally, position, why, klogctl_mode(why, refusal), poll_seconds)
        except OSError as exc:
            raise InputError(exc.errno, describe_both_unreadable(why, exc)) from exc
        log.info("source=%s event=open mode=klogctl boot_id=%s resume_usec=%s why=%r", SOURCE_NAME,
                 boot_id or "-", position.usec if position else None, why)
        return reader

    def read(self, budget: int, now: float, sink: Sink) -> bool:
        """Hand over up to ``budget`` new lines as one chunk; True when the budget ran out first.

        Every READ_ALL makes the kernel walk its whole ring (it finds where the returned text
        starts by summing every record's length), however little is new. So the ring is read at
        most every ``poll_seconds`` of ``now`` unless a backlog is waiting; a clock that went
        backwards reads at once.
        """
        if self._last_read is not None and self._last_read <= now < self._last_read + self.poll_seconds:
            return False
        self._last_read = now
        data = self.kernel.read_all()
        start, stop, end = self.tracker.new_region(data, budget)
        if stop > start:
            context: list[str] = []
            if not self._primed:
                # Resuming mid-ring: a report's earlier lines (an SXid headline, the first line of
                # the three-line fallen-off-the-bus report) were handed over before the restart.
                before = data[rewind_lines(data, start, PARSER_CONTEXT_LINES):start]
                context = before.decode("utf-8", errors="replace").split("\n")[:-1]
                self._primed = True
            lines = decode_text(data[start:stop], self.tally, "klogctl").split("\n")
            lines.pop()  # after the final newline
            sink(LogChunk(lines, context=context))
        self.tracker.advance(data, start, stop)
        if stop < end:
            self._last_read = None  # a backlog is read on the next call
        return stop < end

    def cursor(self, boot_id: str) -> KmsgCursor:
        position = self.tracker.position
        return KmsgCursor(boot_id=boot_id, usec=position.usec, same=position.same, tail=position.tail)

    def describe_failure(self, exc: OSError) -> str:
        return describe_both_unreadable(self.why, exc)

    def data_waiter(self) -> TickWaiter:
        """Nothing says when the ring has new lines: the loop is woken when a read is due."""
        return TickWaiter(self.poll_seconds)

    def close(self) -> None:
        self.kernel.close()
