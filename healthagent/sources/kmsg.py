"""Kernel-log XIDs: ``NVRM: Xid`` (and NVSwitch ``SXid``, fallen-off-the-bus) lines as ``XidEvent``s.

The kernel log is where the NVIDIA driver reports a fault first and in most detail (pid, process,
MIG instance, XID 154's recommended recovery action), and it keeps the reports logged while no
agent was running, during driver initialisation included. NVML's event thread sees only what
happens while it listens. So this source reads the log in every form a node produces:

- ``/dev/kmsg`` records ``PRI,SEQ,USEC,FLAGS[,caller=..];MESSAGE`` plus the `` KEY=value``
  dictionary lines the kernel attaches to device messages (ignored). Non-printable bytes are
  escaped as ``\\xNN`` by the kernel (a multi-line printk shows ``\\x0a``) and unescaped here;
- ``dmesg`` (``[  1234.567890]``, ``-T`` ``[Mon Nov 20 10:11:12 2026]``, ``--time-format iso``,
  ``-x`` ``kern  :err   :``, ``-r`` ``<4>``, caller ids ``[    T1234]``), ``journalctl -k`` in its
  short, short-precise, short-iso(-precise), short-full, short-unix and short-monotonic outputs,
  and syslog files (``Nov 20 10:11:12 host kernel: ...``, ISO-8601 RFC 5424 stamps).

What a line says (NVIDIA open-gpu-kernel-modules, ``krcReportXid`` and ``nvswitch`` sources):
``NVRM: Xid (PCI:dddd:bb:dd[ GPU-I:gg][ GPU-CI:cc]): N, pid=P|'<unknown>', name=NAME, text``
(older drivers: no pid/name, or no ``PCI:``), ``nvidia-nvswitchK: SXid (PCI:dddd:bb:dd.f): N,
Fatal|Non-fatal, ...`` followed by ``Severity ...`` and ``Data {...}`` lines of the same error (not
new errors, so they are not counted again), and the three fallen-off-the-bus forms: the XID 79
line, the driver's ``NVRM: GPU dddd:bb:dd.f: GPU has fallen off the bus.`` and the probe-time
``NVRM: The NVIDIA GPU dddd:bb:dd.f ... fallen off the bus and is not responding to commands.``
(one printk of three lines; dmesg prints the last line without the address, so the parser looks
back two lines for it). NVIDIA's catalog gives "fallen off the bus" XID 79, so those events carry
``xid=79`` with ``kind="fallen_off_bus"``.

Following live (``KmsgSource``): a real ``/dev/kmsg`` is a character device where each read()
returns one record, EAGAIN means caught up and EPIPE means records were overwritten before they
were read (counted ``overrun``). It cannot seek to a sequence number, so every open reads the ring
buffer from its start and skips records the cursor has already handed over *in this boot*; after a
reboot (another boot id) or without a cursor nothing is skipped, so XIDs logged during driver
initialisation, before the agent came up, are reported too. A regular file (the demo node's
``dev/kmsg``, a ``--kernel-log`` file) is followed by byte offset, with rotation, truncation,
partial last lines and undecodable bytes handled. Work per ``collect`` is bounded by
``max_records_per_cycle``; the rest waits for the next call, nothing is dropped. A text file keeps
earlier boots too (``/var/log/kern.log``): an event on a line whose wall-clock stamp is before the
host's boot time (``/proc/stat`` btime, less ``BOOT_TIME_SLACK_SECONDS``) is reported with
``previous_boot=True``, which policy counts and never judges: that boot's faults were ended by its
reboot. Records with a sequence number (/dev/kmsg format) and klogctl's ring are always this boot's.

Without privilege (``klog.py``): a container that is not privileged cannot open the host's
/dev/kmsg (its device cgroup refuses the device node, EPERM, whatever its capabilities), and a pod
may not mount it at all. For the default input the source then reads the same ring buffer through
the ``syslog(2)`` system call (glibc ``klogctl``, non-destructive READ_ALL), which needs only
CAP_SYSLOG. Each such read costs the kernel a walk over the whole ring, so it happens at most
every ``klog_poll_seconds`` (1 s), not at /dev/kmsg's polling rate, and only the lines after the
last one handed over are decoded and parsed. That call reads the *running* kernel, so it is used
only when the host root is that kernel's (same boot id, or a boot id that cannot be read): a
copied or demo host root is never mixed with this machine's log. ``SourceHealth.detail`` names
the input in use (``/dev/kmsg``, ``klogctl`` and why, ``file PATH``); when neither can be read it
names the missing privilege.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections import deque
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Iterable, Iterator, Mapping

# The loop's own boot-id reader, so the source and the loop can never disagree about the boot.
from healthagent.model import FALLEN_OFF_BUS_XID, SourceHealth, XidEvent, canonical_pci_bus_id
from healthagent.sources.base import ErrorTally, SourceResult, host_path, read_boot_id
from healthagent.sources.klog import (
    TAIL_LINES,
    KernelLog,
    ResumeAfter,
    RingPosition,
    RingTracker,
    decode_text,
    rewind_lines,
)

log = logging.getLogger(__name__)

SOURCE_NAME = "kmsg"
DEFAULT_KMSG = "/dev/kmsg"
# One /dev/kmsg read returns one formatted record; the kernel refuses (EINVAL) a buffer smaller
# than the record, whose text is at most 8 KiB (CONSOLE_EXT_LOG_MAX) plus its dictionary.
KMSG_READ_BYTES = 16 * 1024
# Regular files are read in chunks of this size: a flood costs bounded memory, never a slurp.
FILE_CHUNK_BYTES = 1 << 20
# A kernel record's text is at most 8 KiB; of a longer candidate line only this much is parsed.
MAX_PARSED_CHARS = 16 * 1024
# The klogctl reader's least interval between ring reads: each read costs the kernel a walk over
# every record in the ring, and a second of delay is nothing next to NVML's event path.
KLOG_POLL_SECONDS = 1.0
# Lines before a resume point whose context the parser needs (look-back, SXid headline).
PARSER_CONTEXT_LINES = 4
# A syslog stamp up to this far ahead of ``now`` is clock skew, not last year's line.
FUTURE_SKEW_SECONDS = 86_400.0
# A file line stamped more than this before the host's boot time is an earlier boot's. The margin
# covers btime's whole seconds and an early-boot clock step; the last line of the boot before is
# further back than that, since a GPU node's reboot (firmware POST included) takes minutes.
BOOT_TIME_SLACK_SECONDS = 60.0

# -- line grammar ---------------------------------------------------------------------------------

# /dev/kmsg record header; extra fields after FLAGS (``caller=T123``) are ignored.
_KMSG_HEAD = re.compile(r"(\d{1,4}),(\d{1,20}),(\d{1,20}),[^;,]*(?:,[^;]*)?;")
# A /dev/kmsg dictionary (continuation) line: " SUBSYSTEM=pci", " DEVICE=+pci:0000:53:00.0".
_KMSG_DICT = re.compile(r" [A-Z0-9_]+=")
_KMSG_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")

# Everything a log tool puts before the kernel's message. All parts optional, so it always matches.
_PREFIX = re.compile(
    r"\s*(?:<\d{1,3}>)?"                                    # dmesg -r / raw syslog priority
    r"(?:[a-z]{2,8}\s*:[a-z]{2,8}\s*:\s)?"                  # dmesg -x "kern  :err   : "
    r"(?:"
    r"\[\s*(?P<mono>\d+\.\d+)\]"                             # dmesg, journalctl -o short-monotonic
    r"|\[(?P<ctime>[A-Z][a-z]{2} +[A-Z][a-z]{2} +\d{1,2} +\d{1,2}:\d\d:\d\d +\d{4})\]"  # dmesg -T
    r"|(?P<iso>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?)"  # RFC 5424
    r"|[A-Z][a-z]{2} (?P<full>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,9})?) (?P<tz>[A-Za-z]{1,5}|[+-]\d{4})"
    r"|(?P<syslog>[A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d(?:\.\d{1,9})?)"  # RFC 3164, short-precise
    r"|(?P<unix>\d{9,11}\.\d{1,9})(?=\s)"                    # journalctl -o short-unix
    r")?"
    r"(?:\s+(?P<host>[^\s:\[]+)\s+(?P<tag>[^\s:\[]+)(?:\[(?P<pid>\d+)\])?:(?=\s))?"  # host tag[pid]:
    r"(?:\s*kernel:(?=\s))?"
    r"\s*(?:\[\s*(?P<mono2>\d+\.\d+)\])?"                   # kernel time after "kernel:"
    r"\s*(?:\[\s*(?P<caller>[TC]\d+)\])?"                   # CONFIG_PRINTK_CALLER
    r"\s*"
)
# The XID/SXid report proper; group 2 is what the parentheses hold (PCI id, MIG ids: at most
# "PCI:0000:c5:00 GPU-I:03 GPU-CI:01"). Bounded repeats keep a garbage line linear, not quadratic.
_XID = re.compile(r"(S?)Xid\s{0,4}\(([^)\n]{0,64})\)\s{0,4}:\s{0,4}(\d{1,9})")
# A damaged report that still names a number ("NVRM: Xid (PCI:...) 94, ..." / "NVRM: Xid 94").
_XID_LOOSE = re.compile(r"(S?)Xid\b\s{0,4}(?:\(([^)\n]{0,64})\))?\s{0,4}[:,]?\s{0,4}(\d{1,9})\b")
_PROCESS = re.compile(r",\s*pid='?(?P<pid><unknown>|\d+)'?(?:,\s*name='?(?P<name>[^,']*)'?)?")
_PCI_IN_TEXT = re.compile(r"(?<![0-9A-Za-z])(?:PCI:)?([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)(?![0-9A-Za-z])")
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_SXID_DETAIL_PREFIXES = ("Severity", "Data")
_MONTHS = {m: i for i, m in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), start=1)}


def _is_candidate(line: str) -> bool:
    """The cheap pre-filter every line passes through before any regex (200k+ lines/s)."""
    return "Xid" in line or "fallen off" in line


def _unescape_kmsg(message: str) -> str:
    """Undo /dev/kmsg's ``\\xNN`` escaping (bytes, so escaped UTF-8 decodes correctly)."""
    raw = _KMSG_ESCAPE.sub(lambda m: bytes((int(m.group(1), 16),)), message.encode("utf-8"))
    return raw.decode("utf-8", errors="replace")


# -- host facts -----------------------------------------------------------------------------------

def read_boot_time(host_root: str, now: float) -> float:
    """Wall-clock time of the host's boot: ``/proc/stat`` btime, else ``now - uptime``, else ``now``.

    /dev/kmsg and dmesg stamp records with time since boot; this turns them into wall time.
    """
    known = read_known_boot_time(host_root, now)
    return now if known is None else known


def read_known_boot_time(host_root: str, now: float) -> float | None:
    """``read_boot_time`` without the last resort: None when neither /proc/stat nor /proc/uptime
    can be read, so nothing is judged "before this boot" against a guess."""
    try:
        with open(host_path(host_root, "/proc/stat"), "rb") as fh:
            for _, line in zip(range(4096), fh):  # bounded: btime is near the end of a few KB
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(host_path(host_root, "/proc/uptime"), "rb") as fh:
            return now - float(fh.read(256).split()[0])
    except (OSError, ValueError, IndexError):
        return None


# -- the cursor -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class KmsgCursor:
    """Where reading stopped: enough to resume after a restart without a repeat or a skip.

    ``seq``/``boot_id`` identify the last /dev/kmsg record handed over (sequence numbers restart
    at every boot, so they only mean something with the boot id). ``path``/``inode``/``offset``
    locate the next unread byte of a followed regular file. ``usec``/``same`` are the last
    record's timestamp (microseconds since boot) and how many records in a row carried it: the
    klogctl reader has no sequence numbers, and the device reader keeps them too so a restart that
    switches between the two neither repeats nor skips. ``tail`` holds digests of the last lines
    the klogctl reader handed over: the last one, found again among the lines of its stamp after a
    restart, or the last eight, which stand in for a stamp when the kernel log has none
    (``printk.time`` off).
    """

    boot_id: str = ""
    seq: int | None = None
    path: str = ""
    inode: int | None = None
    offset: int = 0
    usec: int | None = None
    same: int = 0
    tail: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"boot_id": self.boot_id, "seq": self.seq, "path": self.path, "inode": self.inode,
                "offset": self.offset, "usec": self.usec, "same": self.same, "tail": list(self.tail)}

    @classmethod
    def from_dict(cls, data: Mapping | None) -> "KmsgCursor":
        """Rebuild a saved cursor; ``{}`` (or anything unusable) is a fresh cursor. Cursors saved
        before a field existed lack it and get its default."""
        if not isinstance(data, Mapping):
            return cls()

        def count(key: str) -> int | None:
            value = data.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

        def text(key: str) -> str:
            value = data.get(key)
            return value if isinstance(value, str) else ""

        tail = data.get("tail")
        digests = (tuple(tail[-TAIL_LINES:]) if isinstance(tail, list) and all(isinstance(d, str) for d in tail)
                   else ())
        usec = count("usec")
        return cls(boot_id=text("boot_id"), seq=count("seq"), path=text("path"), inode=count("inode"),
                   offset=count("offset") or 0, usec=usec,
                   same=(count("same") or 1) if usec is not None else 0, tail=digests)

    def ring_position(self) -> RingPosition:
        return RingPosition(usec=self.usec, same=self.same, tail=self.tail)


# -- the parser -----------------------------------------------------------------------------------

class XidLineParser:
    """Turns kernel-log lines into ``XidEvent``s; never raises, counts what it cannot read.

    Stateful only in two small ways: the last two lines (the probe-time fallen-off-the-bus report
    names its GPU two lines earlier in dmesg's output) and the last SXid headline (its ``Severity``
    and ``Data`` lines belong to it). ``now`` may be moved forward by the caller each cycle.
    """

    def __init__(self, tally: ErrorTally, *, boot_time: float, now: float, boot_id: str = "",
                 earlier_boot_before: float | None = None) -> None:
        self.tally = tally
        self.boot_time = boot_time
        self.now = now
        self.boot_id = boot_id
        # A text line whose wall-clock stamp is before this is an earlier boot's (``previous_boot``);
        # None: not judged (the boot time is unknown, or the input holds only this boot's records).
        self.earlier_boot_before = earlier_boot_before
        self._previous: tuple[str, str] = ("", "")
        self._last_sxid: tuple[str, int] | None = None

    def prime(self, lines: Iterable[str]) -> None:
        """Take the context of lines handed over before this parser existed (a restart): the
        look-back lines and the last SXid headline, yielding no event and counting nothing again."""
        tally, self.tally = self.tally, ErrorTally(SOURCE_NAME)
        try:
            for _ in self.scan(lines):
                pass
        finally:
            self.tally = tally

    def scan(self, lines: Iterable[str]) -> Iterator[XidEvent]:
        """The events in ``lines``, lazily. Non-XID lines cost two substring tests."""
        before, last = self._previous
        try:
            for line in lines:
                if "Xid" in line or "fallen off" in line:  # _is_candidate, inlined: the hot path
                    event = self.parse(line, (before, last))
                    if event is not None:
                        yield event
                before, last = last, line
        finally:
            self._previous = (before, last)

    def parse(self, line: str, previous: tuple[str, str] = ("", "")) -> XidEvent | None:
        """The event one candidate line reports, or None."""
        if len(line) > MAX_PARSED_CHARS:
            self.tally.count("oversized", f"a {len(line)}-character line was cut to {MAX_PARSED_CHARS} "
                                          f"before parsing: {line[:120]!r}")
            line = line[:MAX_PARSED_CHARS]
        try:
            return self._parse(line.rstrip("\r\n"), previous)
        except Exception as exc:  # a parser bug must cost one line, never the agent
            self.tally.count("parse", f"parser error={exc!r} line={line[:300]!r}")
            return None

    def _parse(self, raw: str, previous: tuple[str, str]) -> XidEvent | None:
        head = _KMSG_HEAD.match(raw)
        if head is not None:
            seq: int | None = int(head.group(2))
            timestamp = self.boot_time + int(head.group(3)) / 1e6
            message = raw[head.end():]
            if "\\x" in message:
                message = _unescape_kmsg(message)
        else:
            if raw[:1] == " " and _KMSG_DICT.match(raw):
                return None  # a /dev/kmsg dictionary line, never a report
            prefix = _PREFIX.match(raw)
            if prefix.group("pid") and prefix.group("tag") != "kernel":
                return None  # a user-space program's syslog line quoting an XID, not the driver
            seq = None
            message = raw[prefix.end():]
            if "#012" in message:  # rsyslog's escape of an embedded newline
                message = message.replace("#012", "\n")
            timestamp = self._timestamp(prefix, raw)
        event = None
        if "Xid" in message:
            event = self._xid_event(raw, message, timestamp, seq)
        if event is None and "fallen off" in message and ("NVRM" in message or "GPU" in message):
            event = self._fallen_off_event(raw, message, timestamp, seq, previous)
        if (event is not None and seq is None and self.earlier_boot_before is not None
                and event.timestamp < self.earlier_boot_before):
            event = replace(event, previous_boot=True)  # a kmsg record (seq) is always this boot's
        return event

    # -- reports ------------------------------------------------------------------------------------

    def _xid_event(self, raw: str, message: str, timestamp: float | None,
                   seq: int | None) -> XidEvent | None:
        match = _XID.search(message)
        if match is None:
            if not ("NVRM: Xid" in message or "SXid" in message or "Xid (" in message):
                return None  # "Xid" in some other word or message: not a report
            match = _XID_LOOSE.search(message)
            if match is None:
                self.tally.count("parse", f"XID line without a readable XID number: {raw[:300]!r}")
                return None
            self.tally.count("parse", f"malformed XID line kept: {raw[:300]!r}")
        kind = "sxid" if match.group(1) else "xid"
        number = int(match.group(3))
        parts = (match.group(2) or "").split()
        pci = canonical_pci_bus_id(parts[0]) if parts else None
        if pci is None:
            self.tally.count("parse", f"XID line without a readable PCI id (kept with pci_bus_id \"\"): "
                                      f"{raw[:300]!r}")
        gpu_instance = compute_instance = None
        for part in parts[1:]:
            label, _, value = part.partition(":")
            if label == "GPU-I" and value.isdigit():
                gpu_instance = int(value)
            elif label == "GPU-CI" and value.isdigit():
                compute_instance = int(value)
        rest = message[match.end():]
        if kind == "sxid" and self._is_sxid_detail(pci or "", number, rest):
            return None
        pid = None
        process_name = ""
        process = _PROCESS.match(rest)
        if process is not None:
            if process.group("pid").isdigit():
                pid = int(process.group("pid"))
            name = (process.group("name") or "").strip()
            process_name = "" if name == "<unknown>" else name
        return XidEvent(
            xid=number, pci_bus_id=pci or "", message=message, line=raw,
            timestamp=self.now if timestamp is None else timestamp,
            source=SOURCE_NAME, kind=kind, pid=pid, process_name=process_name,
            gpu_instance=gpu_instance, compute_instance=compute_instance, seq=seq,
            boot_id=self.boot_id if seq is not None else "",
        )

    def _is_sxid_detail(self, pci: str, number: int, rest: str) -> bool:
        """An NVSwitch error is logged as a headline plus ``Severity``/``Data`` lines with the same
        SXid; only the first line that reaches us is the event (a lone detail line still counts)."""
        key = (pci, number)
        detail = rest.lstrip(", ").startswith(_SXID_DETAIL_PREFIXES)
        repeat = detail and self._last_sxid == key
        self._last_sxid = key
        return repeat

    def _fallen_off_event(self, raw: str, message: str, timestamp: float | None, seq: int | None,
                          previous: tuple[str, str]) -> XidEvent:
        found = _PCI_IN_TEXT.search(message)
        if found is None:  # dmesg split the probe-time report: the address is 1-2 lines back
            for earlier in reversed(previous):
                if "NVRM" in earlier and (found := _PCI_IN_TEXT.search(earlier)) is not None:
                    if timestamp is None:  # the report's continuation line carries no stamp
                        timestamp = self._timestamp(_PREFIX.match(earlier), earlier)
                    break
        pci = canonical_pci_bus_id(found.group(1)) if found else None
        if pci is None:
            self.tally.count("parse", f"fallen-off-the-bus line without a PCI id (kept with "
                                      f"pci_bus_id \"\"): {raw[:300]!r}")
        uuid = _GPU_UUID.search(message)
        return XidEvent(
            xid=FALLEN_OFF_BUS_XID, pci_bus_id=pci or "", message=message, line=raw,
            timestamp=self.now if timestamp is None else timestamp, source=SOURCE_NAME,
            kind="fallen_off_bus",
            uuid=uuid.group(0) if uuid else "", seq=seq, boot_id=self.boot_id if seq is not None else "",
        )

    # -- time ---------------------------------------------------------------------------------------

    def _timestamp(self, prefix: re.Match, raw: str) -> float | None:
        """Wall time of a text line: its absolute stamp, else boot time + its kernel stamp; None
        when the line has no stamp (the event is then stamped ``now``)."""
        try:
            if value := prefix.group("iso"):
                return datetime.fromisoformat(value.replace(",", ".")).timestamp()
            if value := prefix.group("syslog"):
                return self._syslog_time(value)
            if value := prefix.group("ctime"):
                return datetime.strptime(" ".join(value.split()), "%a %b %d %H:%M:%S %Y").timestamp()
            if value := prefix.group("full"):
                return _with_zone(datetime.fromisoformat(value), prefix.group("tz")).timestamp()
            if value := prefix.group("unix"):
                return float(value)
            if value := prefix.group("mono") or prefix.group("mono2"):
                return self.boot_time + float(value)
        except (ValueError, OverflowError, OSError):
            self.tally.count("parse", f"unreadable timestamp (event kept, stamped now): {raw[:200]!r}")
        return None

    def _syslog_time(self, value: str) -> float:
        """RFC 3164 has no year: take the latest year that does not put the line in the future."""
        month_name, day, clock = value.split()
        hms, _, fraction = clock.partition(".")
        hour, minute, second = (int(x) for x in hms.split(":"))
        micro = int((fraction + "000000")[:6]) if fraction else 0
        year = datetime.fromtimestamp(self.now).year
        for candidate in (year, year - 1):
            try:
                stamp = datetime(candidate, _MONTHS[month_name], int(day), hour, minute, second,
                                 micro).timestamp()
            except ValueError:  # Feb 29 of a year without one
                continue
            if stamp <= self.now + FUTURE_SKEW_SECONDS:
                return stamp
        raise ValueError(f"no year puts {value!r} before now")


def _with_zone(moment: datetime, zone: str | None) -> datetime:
    """journalctl short-full's zone: UTC/GMT or a numeric offset; anything else is local time."""
    if zone in ("UTC", "GMT", "Z"):
        return moment.replace(tzinfo=timezone.utc)
    if zone and zone[0] in "+-" and zone[1:].isdigit():
        minutes = int(zone[1:3]) * 60 + int(zone[3:5])
        return moment.replace(tzinfo=timezone(timedelta(minutes=-minutes if zone[0] == "-" else minutes)))
    return moment


def iter_events(stream: Iterable[str], now: float, *, host_root: str = "/",
                tally: ErrorTally | None = None) -> Iterator[XidEvent]:
    """The XID events in kernel-log text (dmesg, journalctl -k, syslog, /dev/kmsg records).

    ``healthagent classify`` uses this. Reads ``stream`` line by line (any size). Kernel-relative
    stamps are converted with ``host_root``'s boot time, as on the node the text came from.
    """
    parser = XidLineParser(tally or ErrorTally(SOURCE_NAME), boot_time=read_boot_time(host_root, now),
                           now=now)
    yield from parser.scan(stream)


# -- following ------------------------------------------------------------------------------------

class _InputError(OSError):
    """The input cannot be read; ``str()`` is the detail shown in the source's health."""


class _DeviceFollower:
    """Reads a /dev/kmsg character device: one record per read(), non-blocking."""

    def __init__(self, path: str, fd: int, parser: XidLineParser, tally: ErrorTally,
                 resume_after: int | None, saved: RingPosition = RingPosition()) -> None:
        self.path = path
        self.fd = fd
        self.parser = parser
        self.tally = tally
        self.last_seq = resume_after  # records up to here were handed over in this boot
        # ``saved`` is this boot's position (a sequence number, when there is one, decides instead):
        # the klogctl reader hands records over without sequence numbers.
        self.resume_by_time = (ResumeAfter(saved.usec, saved.same)
                               if resume_after is None and saved.usec is not None else None)
        self.last_usec = saved.usec
        self.same = saved.same
        self._context: deque[str] = deque(maxlen=PARSER_CONTEXT_LINES)
        self._overrun = False

    def read(self, budget: int, events: list[XidEvent]) -> bool:
        """Append the events of up to ``budget`` records; True when the budget ran out first."""
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
            head = _KMSG_HEAD.match(line)
            if head is None:
                self.tally.count("parse", f"/dev/kmsg record without a header: {line[:200]!r}")
                continue
            seq, usec = int(head.group(2)), int(head.group(3))
            if (self.last_seq is not None and seq <= self.last_seq) or (
                    self.resume_by_time is not None and self.resume_by_time.handed_over(usec)):
                self._context.append(line)  # handed over before this (re)open
                continue
            if self._context:  # the parser takes the context of what was handed over before
                self.parser.prime(self._context)
                self._context.clear()
            self._count_loss(seq)
            if _is_candidate(line):
                event = self.parser.parse(line)
                if event is not None:
                    events.append(event)
            self.last_seq = seq
            self.same = self.same + 1 if usec == self.last_usec else 1
            self.last_usec = usec
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

    def close(self) -> None:
        os.close(self.fd)


class _FileFollower:
    """Follows a regular file by byte offset (kmsg records or dmesg/journal/syslog text)."""

    def __init__(self, path: str, fd: int, inode: int, offset: int, parser: XidLineParser,
                 tally: ErrorTally, last_seq: int | None, skip_upto: int | None) -> None:
        self.path = path
        self.fd = fd
        self.inode = inode
        self.offset = offset
        self.parser = parser
        self.tally = tally
        self.last_seq = last_seq
        # Records with seq <= skip_upto were handed over before: set while re-reading from 0.
        self.skip_upto = skip_upto
        self._discarding = False  # inside an over-long line, skipping to its end

    def read(self, budget: int, events: list[XidEvent]) -> bool:
        """Append the events of up to ``budget`` complete lines; True when the budget ran out."""
        done = 0
        while done < budget:
            chunk = os.pread(self.fd, FILE_CHUNK_BYTES, self.offset)
            if self._discarding:
                if self._skip_long_line(chunk):
                    continue
                return False
            end = chunk.rfind(b"\n")
            if end < 0:
                if len(chunk) >= FILE_CHUNK_BYTES:
                    self.tally.count("oversized", f"{self.path}: a line longer than {FILE_CHUNK_BYTES} "
                                                  f"bytes at offset {self.offset} was skipped")
                    self._discarding = True
                    continue
                if self._reopen_if_rotated():
                    continue
                return False  # caught up (a partial last line waits for its newline)
            data = chunk[:end + 1]
            count = data.count(b"\n")
            if count > budget - done:
                count = budget - done
                rest = data.split(b"\n", count)[-1]
                data = data[:len(data) - len(rest)]
            lines = self._decode(data).split("\n")
            lines.pop()  # after the final newline
            if self.skip_upto is not None:
                lines = self._drop_seen(lines)
            events.extend(self.parser.scan(lines))
            self._note_last_seq(lines)
            self.offset += len(data)
            done += count
        return True

    def _skip_long_line(self, chunk: bytes) -> bool:
        """Advance through an over-long line; True when there is more to read now."""
        newline = chunk.find(b"\n")
        if newline < 0:
            self.offset += len(chunk)
            return bool(chunk)
        self.offset += newline + 1
        self._discarding = False
        return True

    def _decode(self, data: bytes) -> str:
        return decode_text(data, self.tally, f"{self.path} near offset {self.offset}")

    def _drop_seen(self, lines: list[str]) -> list[str]:
        """Drop kmsg records already handed over (seq <= skip_upto) from the front of ``lines``."""
        for index, line in enumerate(lines):
            head = _KMSG_HEAD.match(line)
            if head is None and line[:1] == " ":
                continue  # a dictionary line of a record being skipped
            if head is None or int(head.group(2)) > self.skip_upto:
                self.skip_upto = None
                return lines[index:]
        return []

    def _note_last_seq(self, lines: list[str]) -> None:
        for line in reversed(lines[-16:]):  # a record has at most a few dictionary lines
            head = _KMSG_HEAD.match(line)
            if head is not None:
                self.last_seq = int(head.group(2))
                return

    def _reopen_if_rotated(self) -> bool:
        """At the end of the file: switch to a replacement file or restart a truncated one."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return False  # moved away and not yet replaced: keep the old one open
        if current.st_ino != self.inode:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            os.close(self.fd)
            self.fd, self.inode = fd, os.fstat(fd).st_ino
            self._restart(f"{self.path} was replaced (rotated); reading the new file from its start")
            return True
        if os.fstat(self.fd).st_size < self.offset:
            self._restart(f"{self.path} shrank below the read offset {self.offset} (truncated); "
                          f"reading it again from its start")
            return True
        return False

    def _restart(self, why: str) -> None:
        self.tally.count("rotated", why)
        log.info("source=%s event=rotated path=%s inode=%d", SOURCE_NAME, self.path, self.inode)
        self.offset = 0
        self._discarding = False
        self.skip_upto = self.last_seq  # a copy of records already read is not read twice

    def cursor(self, boot_id: str) -> KmsgCursor:
        return KmsgCursor(boot_id=boot_id, seq=self.last_seq, path=self.path, inode=self.inode,
                          offset=self.offset)

    def close(self) -> None:
        os.close(self.fd)


class _RingFollower:
    """Follows the kernel's ring buffer through klogctl: one READ_ALL snapshot per read, and only the
    lines after the last one handed over are decoded and parsed (``RingTracker``)."""

    def __init__(self, kernel: KernelLog, parser: XidLineParser, tally: ErrorTally,
                 saved: RingPosition | None, why: str, poll_seconds: float) -> None:
        self.kernel = kernel
        self.parser = parser
        self.tally = tally
        self.why = why  # why /dev/kmsg is not read, for the health detail
        self.poll_seconds = poll_seconds
        self.tracker = RingTracker(saved, tally)
        self._primed = False
        self._last_read: float | None = None
        kernel.open()  # SIZE_BUFFER: refused like READ_ALL, so a missing privilege shows at once

    def read(self, budget: int, events: list[XidEvent]) -> bool:
        """Append the events of up to ``budget`` new lines; True when the budget ran out first.

        Every READ_ALL makes the kernel walk its whole ring (it finds where the returned text
        starts by summing every record's length), however little is new. So the ring is read at
        most every ``poll_seconds`` (``now`` is the loop's, through the parser) unless a backlog
        is waiting; a clock that went backwards reads at once.
        """
        now = self.parser.now
        if self._last_read is not None and self._last_read <= now < self._last_read + self.poll_seconds:
            return False
        self._last_read = now
        data = self.kernel.read_all()
        start, stop, end = self.tracker.new_region(data, budget)
        if not self._primed and stop > start:
            # Resuming mid-ring: a report's earlier lines (an SXid headline, the first line of the
            # three-line fallen-off-the-bus report) were handed over before the restart.
            context = data[rewind_lines(data, start, PARSER_CONTEXT_LINES):start]
            self.parser.prime(context.decode("utf-8", errors="replace").split("\n")[:-1])
        self._primed = self._primed or stop > start
        if stop > start:
            lines = decode_text(data[start:stop], self.tally, "klogctl").split("\n")
            lines.pop()  # after the final newline
            events.extend(self.parser.scan(lines))
        self.tracker.advance(data, start, stop)
        if stop < end:
            self._last_read = None  # a backlog is read on the next call
        return stop < end

    def cursor(self, boot_id: str) -> KmsgCursor:
        position = self.tracker.position
        return KmsgCursor(boot_id=boot_id, usec=position.usec, same=position.same, tail=position.tail)

    def close(self) -> None:
        self.kernel.close()


_Follower = _DeviceFollower | _FileFollower | _RingFollower
# Opening the default input failed in a way klogctl can get round (the device cgroup's EPERM, a
# file mode's EACCES, a /dev/kmsg that is not mounted into the pod).
_FALLBACK_ERRNOS = (errno.EPERM, errno.EACCES, errno.ENOENT)


def describe_unreadable(path: str, exc: OSError, device: bool) -> str:
    """One line an operator can act on, for a kernel log that cannot be opened or read."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, FileNotFoundError):
        hint = (" (mount the host's /dev/kmsg into the pod, or pass --kernel-log FILE)"
                if path.endswith(DEFAULT_KMSG) else "")
        return f"{path} not found{hint}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        if device or path.endswith(DEFAULT_KMSG):
            return (f"permission denied reading {path} ({reason}): reading the kernel log needs "
                    f"CAP_SYSLOG (kernel.dmesg_restrict) and device access; run the agent's container "
                    f"privileged or add CAP_SYSLOG, with the host's /dev/kmsg mounted")
        return f"permission denied reading {path} ({reason})"
    return f"cannot read {path}: {reason}"


def describe_device_refusal(path: str, exc: OSError) -> str:
    """Why the default input was not opened, in a few words (the start of the fallback's detail)."""
    if isinstance(exc, FileNotFoundError):
        return f"{path} not found"
    return f"permission denied reading {path} ({exc.strerror or exc})"


def describe_both_unreadable(device_detail: str, exc: OSError) -> str:
    """Neither /dev/kmsg nor klogctl: name the privilege that is missing."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EPERM, errno.EACCES):
        return (f"{device_detail}, and klogctl (syslog(2) READ_ALL) was refused too ({reason}): reading "
                f"the kernel log needs CAP_SYSLOG (kernel.dmesg_restrict=1); add it to the container "
                f"(capabilities add SYSLOG, as uid 0, with a seccomp profile that allows syslog, as "
                f"RuntimeDefault does then), which is enough for klogctl, or run the container "
                f"privileged to open /dev/kmsg")
    return (f"{device_detail}, and klogctl (syslog(2) READ_ALL) failed too ({reason}); run the container "
            f"privileged to open /dev/kmsg, or pass --kernel-log FILE")


class KmsgSource:
    """Follows the kernel log (``<host_root>/dev/kmsg`` or ``kernel_log``) and returns new XIDs.

    ``cursor`` is where a previous run stopped (``KmsgCursor.from_dict`` of the saved state). After
    each ``collect`` the ``cursor`` property covers exactly the records whose events that call
    returned, so the loop can save it next to the verdict. ``klog`` reads the kernel's ring buffer
    when the default input cannot be opened (this machine's kernel through glibc by default), at
    most every ``klog_poll_seconds`` of the ``now`` given to ``collect``.
    """

    name = SOURCE_NAME

    def __init__(self, host_root: str, kernel_log: str | None = None, cursor: KmsgCursor | None = None,
                 max_records_per_cycle: int = 50_000, klog: KernelLog | None = None,
                 klog_poll_seconds: float = KLOG_POLL_SECONDS) -> None:
        self.host_root = host_root
        self.kernel_log = kernel_log
        self.path = kernel_log or host_path(host_root, DEFAULT_KMSG)
        self.max_records_per_cycle = max(1, int(max_records_per_cycle))
        self.klog = klog or KernelLog()
        self.klog_poll_seconds = max(0.0, float(klog_poll_seconds))
        self.tally = ErrorTally(SOURCE_NAME)
        self._cursor = cursor or KmsgCursor()
        self._follower: _Follower | None = None
        self._mode = ""  # the input in use, for the health detail
        self._boot_id = ""
        self._boot_time: float | None = None  # the host's boot (wall clock), None = unknown
        self._failure = ""  # the detail while the input is unreadable; "" while it is fine

    @property
    def cursor(self) -> KmsgCursor:
        return self._cursor

    def collect(self, now: float) -> SourceResult:
        events: list[XidEvent] = []
        try:
            if self._follower is None:
                self._follower = self._open(now)
            self._follower.parser.now = now
            detail = self._mode
            if self._follower.read(self.max_records_per_cycle, events):
                detail += (f"; backlog: {self.max_records_per_cycle} records read this cycle (the cap); "
                           f"the rest follow next cycle")
        except OSError as exc:
            self._keep_cursor()  # what was read before the error is handed over with its events
            return self._failed(exc, events)
        self._keep_cursor()
        if self._failure:
            log.info("source=%s event=readable input=%r", SOURCE_NAME, self._mode)
            self._failure = ""
        return SourceResult(health=SourceHealth(source=SOURCE_NAME, up=True, detail=detail,
                                                errors=self.tally.snapshot()),
                            xids=tuple(events))

    def _keep_cursor(self) -> None:
        if self._follower is not None:
            self._cursor = self._follower.cursor(self._boot_id)

    def _failed(self, exc: OSError, events: list[XidEvent]) -> SourceResult:
        """Unreadable input: report it (counted once per outage, not per 0.1 s retry), retry later."""
        if isinstance(exc, _InputError):
            detail = exc.strerror
        elif isinstance(self._follower, _RingFollower):
            detail = describe_both_unreadable(self._follower.why, exc)
        else:
            device = isinstance(self._follower, _DeviceFollower) or _is_char_device(self.path)
            detail = describe_unreadable(self.path, exc, device)
        self.close()
        if not self._failure:
            self.tally.count("unreadable", detail)
        self._failure = detail
        return SourceResult(health=SourceHealth(source=SOURCE_NAME, up=False, detail=detail,
                                                errors=self.tally.snapshot()),
                            xids=tuple(events))

    def _open(self, now: float) -> _Follower:
        self._boot_id = read_boot_id(self.host_root)
        self._boot_time = read_known_boot_time(self.host_root, now)
        parser = XidLineParser(self.tally, boot_time=now if self._boot_time is None else self._boot_time,
                               now=now, boot_id=self._boot_id)
        saved = self._cursor
        same_boot = bool(self._boot_id) and saved.boot_id == self._boot_id
        try:
            return self._open_path(parser, saved, same_boot)
        except OSError as exc:
            if isinstance(exc, _InputError) or self.kernel_log or exc.errno not in _FALLBACK_ERRNOS:
                raise
            return self._open_ring(parser, saved.ring_position() if same_boot else None, exc)

    def _open_ring(self, parser: XidLineParser, saved: RingPosition | None,
                   refusal: OSError) -> _RingFollower:
        """The default input could not be opened: read the same ring buffer through klogctl."""
        kernel_boot_id = self.klog.boot_id()
        if self._boot_id and kernel_boot_id and kernel_boot_id != self._boot_id:
            # klogctl reads the running kernel; this host root is another boot (a copy, a demo root).
            detail = describe_unreadable(self.path, refusal, _is_char_device(self.path))
            raise _InputError(refusal.errno, f"{detail} (klogctl not tried: it reads this machine's kernel, "
                                             f"boot id {kernel_boot_id}, and {self.host_root} is boot "
                                             f"{self._boot_id})")
        why = describe_device_refusal(self.path, refusal)
        try:
            follower = _RingFollower(self.klog, parser, self.tally, saved, why, self.klog_poll_seconds)
        except OSError as exc:
            raise _InputError(exc.errno, describe_both_unreadable(why, exc)) from exc
        self._mode = f"klogctl (syslog(2) READ_ALL), because {why}"
        if refusal.errno in (errno.EPERM, errno.EACCES):
            self._mode += (": a container that is not privileged may not open the device; klogctl needs "
                           "CAP_SYSLOG only")
        log.info("source=%s event=open mode=klogctl boot_id=%s resume_usec=%s why=%r", SOURCE_NAME,
                 self._boot_id or "-", saved.usec if saved else None, why)
        return follower

    def _open_path(self, parser: XidLineParser, saved: KmsgCursor,
                   same_boot: bool) -> _DeviceFollower | _FileFollower:
        info = os.stat(self.path)
        handed_over = saved.seq if same_boot else None
        if stat.S_ISCHR(info.st_mode):
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            log.info("source=%s event=open path=%s mode=device boot_id=%s resume_after_seq=%s "
                     "resume_usec=%s", SOURCE_NAME, self.path, self._boot_id or "-", handed_over,
                     saved.usec if same_boot else None)
            self._mode = f"/dev/kmsg ({self.path})"
            return _DeviceFollower(self.path, fd, parser, self.tally, handed_over,
                                   saved.ring_position() if same_boot else RingPosition())
        if not stat.S_ISREG(info.st_mode):
            raise _InputError(errno.EINVAL, f"{self.path} is neither a regular file nor a character "
                                            f"device; pass a kernel-log file or /dev/kmsg")
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        inode = os.fstat(fd).st_ino
        size = os.fstat(fd).st_size
        # A byte offset is only trusted for the same file; for kmsg records (the cursor has a seq)
        # also only in the same boot, since a rebuilt file may reuse the inode number.
        same_file = saved.path == self.path and saved.inode == inode and (saved.seq is None or same_boot)
        resume = same_file and saved.offset <= size
        if same_file and not resume:
            self.tally.count("rotated", f"{self.path} is shorter than the saved offset {saved.offset} "
                                        f"(truncated while the agent was down); reading it from its start")
        offset = saved.offset if resume else 0
        if self._boot_time is not None:
            # A text file (kern.log, a saved dmesg -T) keeps earlier boots' lines: their XIDs are
            # history. /dev/kmsg and klogctl hold only the running kernel's records.
            parser.earlier_boot_before = self._boot_time - BOOT_TIME_SLACK_SECONDS
        log.info("source=%s event=open path=%s mode=file boot_id=%s offset=%d resume_after_seq=%s",
                 SOURCE_NAME, self.path, self._boot_id or "-", offset, None if resume else handed_over)
        self._mode = f"file {self.path}"
        return _FileFollower(self.path, fd, inode, offset, parser, self.tally, last_seq=handed_over,
                             skip_upto=None if resume else handed_over)

    def close(self) -> None:
        follower, self._follower = self._follower, None
        if follower is not None:
            try:
                follower.close()
            except OSError:
                pass


def _is_char_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False
