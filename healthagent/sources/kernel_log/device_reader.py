"""Reads ``/dev/kmsg``, the kernel's own record interface: one record per read(), non-blocking.

Why this reader is the default: every record carries a sequence number, so a resume is exact and
a record the kernel overwrote before it was read is counted, not guessed. A real ``/dev/kmsg``
cannot seek to a sequence number, so every open reads the ring from its start and skips the
records the cursor handed over *in this boot*; after a reboot (another boot id) or without a
cursor nothing is skipped, so XIDs logged during driver initialisation, before the agent came
up, are reported too. EAGAIN means caught up; EPIPE means records were overwritten (``overrun``).
"""

from __future__ import annotations

import os
from collections import deque

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.formats import kmsg_header
from healthagent.sources.kernel_log.parser import PARSER_CONTEXT_LINES, SOURCE_NAME, LogChunk
from healthagent.sources.kernel_log.reader import Sink, log
from healthagent.sources.kernel_log.ring import ResumeAfter, RingPosition
from healthagent.sources.kernel_log.wake import ReadableWaiter
from healthagent.sources.kernel_log.wording import describe_unreadable, device_mode

# One /dev/kmsg read returns one formatted record; the kernel refuses (EINVAL) a buffer smaller
# than the record, whose text is at most 8 KiB (CONSOLE_EXT_LOG_MAX) plus its dictionary.
KMSG_READ_BYTES = 16 * 1024


class KmsgDeviceReader:
    """A ``KernelLogReader`` over a character device that reads like /dev/kmsg (``fd``)."""

    keeps_earlier_boots = False

    def __init__(self, path: str, fd: int, tally: ErrorTally, resume_after: int | None,
                 saved: RingPosition = RingPosition()) -> None:
        self.path = path
        self.fd = fd
        self.tally = tally
        self.description = device_mode(path)
        self.last_seq = resume_after  # records up to here were handed over in this boot
        # ``saved`` is this boot's position (a sequence number, when there is one, decides instead):
        # the klogctl reader hands records over without sequence numbers.
        self.resume_by_time = (ResumeAfter(saved.usec, saved.same)
                               if resume_after is None and saved.usec is not None else None)
        self.last_usec = saved.usec
        self.same = saved.same
        self._context: deque[str] = deque(maxlen=PARSER_CONTEXT_LINES)
        self._overrun = False

    @classmethod
    def open(cls, path: str, saved: KmsgCursor, same_boot: bool, tally: ErrorTally,
             boot_id: str) -> "KmsgDeviceReader":
        """Open the device non-blocking, to resume after ``saved`` when it is this boot's."""
        handed_over = saved.seq if same_boot else None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        log.info("source=%s event=open path=%s mode=device boot_id=%s resume_after_seq=%s "
                 "resume_usec=%s", SOURCE_NAME, path, boot_id or "-", handed_over,
                 saved.usec if same_boot else None)
        return cls(path, fd, tally, handed_over, saved.ring_position() if same_boot else RingPosition())

    def read(self, budget: int, now: float, sink: Sink) -> bool:
        """Hand over up to ``budget`` records, one chunk each; True when the budget ran out first."""
        records = 0
        while records < budget:
            try:
                data = os.read(self.fd, KMSG_READ_BYTES)
            except BlockingIOError:
                return False  # caught up
            except BrokenPipeError:
                self._overrun = True  # the kernel overwrote records before we read them
                continue
            if not data:
                return False
            records += 1
            line = data.decode("utf-8", errors="replace").partition("\n")[0]
            head = kmsg_header(line)
            if head is None:
                self.tally.count("parse", f"/dev/kmsg record without a header: {line[:200]!r}")
                continue
            if (self.last_seq is not None and head.seq <= self.last_seq) or (
                    self.resume_by_time is not None and self.resume_by_time.handed_over(head.usec)):
                self._context.append(line)  # handed over before this (re)open
                continue
            self._count_loss(head.seq)
            sink(LogChunk((line,), context=tuple(self._context), whole_records=True))
            self._context.clear()  # the parser has taken the context of what was handed over
            self.last_seq = head.seq
            self.same = self.same + 1 if head.usec == self.last_usec else 1
            self.last_usec = head.usec
        return True

    def _count_loss(self, seq: int) -> None:
        lost = seq - self.last_seq - 1 if self.last_seq is not None else 0
        if lost > 0 or self._overrun:
            self.tally.count("overrun", f"{max(lost, 1)} kernel-log records were overwritten before "
                                        f"they were read (ring buffer too small or reader too slow)",
                             n=max(lost, 1))
        self._overrun = False

    def cursor(self, boot_id: str) -> KmsgCursor:
        return KmsgCursor(boot_id=boot_id, seq=self.last_seq, path=self.path, usec=self.last_usec,
                          same=self.same)

    def describe_failure(self, exc: OSError) -> str:
        return describe_unreadable(self.path, exc, device=True)

    def data_waiter(self) -> ReadableWaiter:
        """The kernel marks the descriptor readable while records past its position exist."""
        return ReadableWaiter(self.fd)

    def close(self) -> None:
        os.close(self.fd)
