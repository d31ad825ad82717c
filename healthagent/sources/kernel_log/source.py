"""``KmsgSource``: the kernel log as the loop schedules it; picks the reader and feeds the parser.

Why thin: how each input is read lives in its reader, what a line means in the parser and every
sentence in ``wording``; what is left is the choice of input, the cursor and the error tally.

The input: ``kernel_log`` when given (a file, or a character device), else the host's /dev/kmsg.
When that default is refused (a container that is not privileged: its device cgroup's EPERM, a
file mode's EACCES, a /dev/kmsg not mounted into the pod) the same ring buffer is read through
``syslog(2)`` (``ring_reader``), which needs only CAP_SYSLOG. That call reads the *running*
kernel, so it is used only when the host root is that kernel's (same boot id, or a boot id that
cannot be read): a copied or demo host root is never mixed with this machine's log.
``SourceHealth.detail`` names the input in use; when none can be read it names what is missing.

Work per ``collect`` is bounded by ``max_records_per_cycle``; the rest waits for the next call,
nothing is dropped, and ``backlog`` says so (the loop then reads again at once instead of waiting
for its poll interval). Within one ``collect`` a run of the same XID on the same GPU is folded
(``repeats``): its first reports are events as they are, the rest one event with their count, so
a flood costs the policy a handful of events and the fault after it is judged in the same cycle
it is read. A text file keeps earlier boots too (``/var/log/kern.log``): an event on a line
stamped before the host's boot (less ``BOOT_TIME_SLACK_SECONDS``) is reported with
``previous_boot=True``, which policy counts and never judges. Records with a sequence number
(/dev/kmsg format) and klogctl's ring are always this boot's.
"""

from __future__ import annotations

import errno
import os
import stat

from healthagent.model import AdapterEvent, SourceHealth, XidEvent
from healthagent.common import ErrorTally
from healthagent.sources.base import SourceResult, host_path, read_boot_id
from healthagent.sources.kernel_log.boot import BOOT_TIME_SLACK_SECONDS, read_known_boot_time
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.device_reader import KmsgDeviceReader
from healthagent.sources.kernel_log.file_reader import KernelLogFileReader
from healthagent.sources.kernel_log.klogctl import KernelLog
from healthagent.sources.kernel_log.parser import SOURCE_NAME, KernelEvent, LogChunk, XidLineParser
from healthagent.sources.kernel_log.reader import DEFAULT_KMSG, InputError, KernelLogReader, is_char_device, log
from healthagent.sources.kernel_log.repeats import RepeatFolder
from healthagent.sources.kernel_log.ring_reader import KlogctlReader
from healthagent.sources.kernel_log.wake import DataWaiter
from healthagent.sources.kernel_log.wording import (
    backlog,
    describe_klogctl_not_tried,
    describe_not_a_log,
    describe_unreadable,
)

# The klogctl reader's least interval between ring reads: each read costs the kernel a walk over
# every record in the ring, and a second of delay is nothing next to NVML's event path.
KLOG_POLL_SECONDS = 1.0
# Opening the default input failed in a way klogctl can get round (the device cgroup's EPERM, a
# file mode's EACCES, a /dev/kmsg that is not mounted into the pod).
_FALLBACK_ERRNOS = (errno.EPERM, errno.EACCES, errno.ENOENT)


class KmsgSource:
    """Follows the kernel log (``<host_root>/dev/kmsg`` or ``kernel_log``) and returns new XIDs
    and mlx5 (ConnectX) adapter events.

    ``cursor`` is where a previous run stopped (``KmsgCursor.from_dict`` of the saved state). After
    each ``collect`` the ``cursor`` property covers exactly the records whose events that call
    returned, so the loop can save it next to the verdict. ``klog`` reads the kernel's ring buffer
    when the default input cannot be opened (this machine's kernel through glibc by default), at
    most every ``klog_poll_seconds`` of the ``now`` given to ``collect``.
    """

    name = SOURCE_NAME

    def __init__(self, host_root: str, kernel_log: str | None = None, cursor: KmsgCursor | None = None,
                 max_records_per_cycle: int = 50_000, klog: KernelLog | None = None,
                 klog_poll_seconds: float = KLOG_POLL_SECONDS, epoch: float | None = None) -> None:
        """``epoch``: the agent's decision clock's (``healthagent/clock.py``): a record's kernel
        stamp (``/dev/kmsg``'s monotonic microseconds, a line's ``[seconds]``) is read as
        ``epoch + stamp``, on the clock NVML's events are stamped with, so the two pair up
        whatever the wall clock did. None: the host's boot time (``/proc/stat`` btime), as
        ``classify`` reads a log on its own."""
        self.epoch = epoch
        self.host_root = host_root
        self.kernel_log = kernel_log
        self.path = kernel_log or host_path(host_root, DEFAULT_KMSG)
        self.max_records_per_cycle = max(1, int(max_records_per_cycle))
        self.klog = klog or KernelLog()
        self.klog_poll_seconds = max(0.0, float(klog_poll_seconds))
        self.tally = ErrorTally(SOURCE_NAME)
        self._cursor = cursor or KmsgCursor()
        self._reader: KernelLogReader | None = None
        self._parser: XidLineParser | None = None
        self._boot_id = ""
        self._failure = ""  # the detail while the input is unreadable; "" while it is fine
        self._backlog = False
        self._waiter: DataWaiter | None = None

    @property
    def cursor(self) -> KmsgCursor:
        return self._cursor

    @property
    def backlog(self) -> bool:
        """The last ``collect`` stopped at ``max_records_per_cycle`` with more to read."""
        return self._backlog

    def collect(self, now: float) -> SourceResult:
        events: list[KernelEvent] = []
        self._backlog = False
        try:
            if self._reader is None:
                self._reader = self._open(now)
                self._waiter = self._reader.data_waiter()  # before the first read: no write unseen
            parser = self._parser
            assert parser is not None  # opened with the reader
            parser.now = now
            detail = self._reader.description

            def take(chunk: LogChunk) -> None:
                events.extend(parser.feed(chunk))

            self._backlog = self._reader.read(self.max_records_per_cycle, now, take)
            if self._backlog:
                detail += backlog(self.max_records_per_cycle)
        except OSError as exc:
            self._keep_cursor()  # what was read before the error is handed over with its events
            self._end_read(events)
            return self._failed(exc, events)
        self._keep_cursor()
        self._end_read(events)
        if self._failure:
            log.info("source=%s event=readable input=%r", SOURCE_NAME, self._reader.description)
            self._failure = ""
        return _result(SourceHealth(source=SOURCE_NAME, up=True, detail=detail, errors=self.tally.snapshot()),
                       events)

    def _end_read(self, events: list[KernelEvent]) -> None:
        """Hand over the reports folded in this read (their count in ``repeats``)."""
        if self._parser is not None:
            events.extend(self._parser.take_repeats())

    def _keep_cursor(self) -> None:
        if self._reader is not None:
            self._cursor = self._reader.cursor(self._boot_id)

    def _failed(self, exc: OSError, events: list[KernelEvent]) -> SourceResult:
        """Unreadable input: report it (counted once per outage, not per 0.1 s retry), retry later."""
        if isinstance(exc, InputError):
            detail = exc.strerror or str(exc)
        elif self._reader is not None:
            detail = self._reader.describe_failure(exc)
        else:
            detail = describe_unreadable(self.path, exc, is_char_device(self.path))
        self.close()
        if not self._failure:
            self.tally.count("unreadable", detail)
        self._failure = detail
        return _result(SourceHealth(source=SOURCE_NAME, up=False, detail=detail, errors=self.tally.snapshot()),
                       events)

    def _open(self, now: float) -> KernelLogReader:
        """Pick and open the input, with a parser for it, resuming after this boot's cursor."""
        self._boot_id = read_boot_id(self.host_root)
        boot_time = read_known_boot_time(self.host_root, now)
        saved = self._cursor
        same_boot = bool(self._boot_id) and saved.boot_id == self._boot_id
        try:
            reader = self._open_path(saved, same_boot)
        except OSError as exc:
            if isinstance(exc, InputError) or self.kernel_log or exc.errno not in _FALLBACK_ERRNOS:
                raise
            reader = self._open_ring(saved, same_boot, exc)
        stamps_from = self.epoch if self.epoch is not None else (now if boot_time is None else boot_time)
        self._parser = XidLineParser(self.tally, boot_time=stamps_from,
                                     now=now, boot_id=self._boot_id, repeats=RepeatFolder())
        if reader.keeps_earlier_boots and boot_time is not None:
            # A text file (kern.log, a saved dmesg -T) keeps earlier boots' lines: their XIDs are
            # history. /dev/kmsg and klogctl hold only the running kernel's records.
            self._parser.earlier_boot_before = boot_time - BOOT_TIME_SLACK_SECONDS
        return reader

    def _open_path(self, saved: KmsgCursor, same_boot: bool) -> KernelLogReader:
        """``self.path``: a character device is read as /dev/kmsg, a regular file is followed."""
        info = os.stat(self.path)
        if stat.S_ISCHR(info.st_mode):
            return KmsgDeviceReader.open(self.path, saved, same_boot, self.tally, self._boot_id)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(errno.EINVAL, describe_not_a_log(self.path))
        return KernelLogFileReader.open(self.path, saved, same_boot, self.tally, self._boot_id)

    def _open_ring(self, saved: KmsgCursor, same_boot: bool, refusal: OSError) -> KernelLogReader:
        """The default input could not be opened: read the same ring buffer through klogctl."""
        kernel_boot_id = self.klog.boot_id()
        if self._boot_id and kernel_boot_id and kernel_boot_id != self._boot_id:
            # klogctl reads the running kernel; this host root is another boot (a copy, a demo root).
            detail = describe_unreadable(self.path, refusal, is_char_device(self.path))
            raise InputError(refusal.errno, describe_klogctl_not_tried(detail, kernel_boot_id,
                                                                       self.host_root, self._boot_id))
        return KlogctlReader.open(self.klog, saved, same_boot, self.tally, self._boot_id,
                                  device_path=self.path, refusal=refusal, poll_seconds=self.klog_poll_seconds)

    def data_waiter(self) -> DataWaiter | None:
        """What wakes the loop when the kernel log has new data; None while no input is open or
        the input can only be polled (the loop then reads every ``kmsg_poll_seconds``)."""
        return self._waiter

    def close(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.close()
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                reader.close()
            except OSError:
                pass


def _result(health: SourceHealth, events: list[KernelEvent]) -> SourceResult:
    """The read's events, each kind in its field, in log order."""
    return SourceResult(health=health, xids=tuple(e for e in events if isinstance(e, XidEvent)),
                        adapter_events=tuple(e for e in events if isinstance(e, AdapterEvent)))
