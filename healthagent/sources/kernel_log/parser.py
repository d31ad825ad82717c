"""Kernel-log lines to ``XidEvent``s: XID, NVSwitch SXid and fallen-off-the-bus reports; no I/O.

Why pure: the same matcher serves every input (``/dev/kmsg``, a followed file, the ring through
``syslog(2)``) and ``healthagent classify`` over saved text, so one table of lines and expected
events pins its behaviour for all of them. The kernel log is where the NVIDIA driver reports a
fault first and in most detail (pid, process, MIG instance, XID 154's recommended recovery).

What a line says (NVIDIA open-gpu-kernel-modules, ``krcReportXid`` and ``nvswitch`` sources):
``NVRM: Xid (PCI:dddd:bb:dd[ GPU-I:gg][ GPU-CI:cc]): N, pid=P|'<unknown>', name=NAME, text``
(older drivers: no pid/name, or no ``PCI:``), ``nvidia-nvswitchK: SXid (PCI:dddd:bb:dd.f): N,
Fatal|Non-fatal, ...`` followed by ``Severity ...`` and ``Data {...}`` lines of the same error (not
new errors, so they are not counted again), and the three fallen-off-the-bus forms: the XID 79
line, the driver's ``NVRM: GPU dddd:bb:dd.f: GPU has fallen off the bus.`` and the probe-time
``NVRM: The NVIDIA GPU dddd:bb:dd.f ... fallen off the bus and is not responding to commands.``
(one printk of three lines; dmesg prints the last line without the address, so the parser looks
back two lines for the report's first line, and only for it: an address is never borrowed from
another GPU's line). NVIDIA's catalog gives "fallen off the bus" XID 79, so those events carry
``xid=79`` with ``kind="fallen_off_bus"``. A GPU that failed to initialise
(``NVRM: GPU dddd:bb:dd.f: RmInitAdapter failed! (0x62:0xffff:1863)``; older drivers leave out
the address) is ``kind="init_failed"`` (``xid`` 0: it is not an XID).

Only the kernel's records are reports. A record of another facility (``formats.not_kernel``:
``12,...;`` or ``<12>`` is LOG_USER, what any process that may write /dev/kmsg gets), or a syslog
file's line whose tag is not ``kernel`` (``host myapp: ...``, what ``logger -t myapp`` writes), that
quotes an XID is ignored and counted ``not_kernel_facility``: anyone who can write the kernel log
or the syslog file could otherwise make the agent replace a node. An indented line without a
header of its own continues the line above it (journalctl's and dmesg's multi-line messages) and
is that line's writer's. Only records the pre-filter lets through are counted (the
ones that look like a report), not every message systemd and friends write there.

An XID number is at most nine digits (the driver prints a 32-bit code; NVIDIA's catalog stops at
three digits): a longer one is malformed, counted ``parse`` and reported as nothing, never cut.

A run of the same report (kind, XID, GPU) within one read is folded when a ``RepeatFolder`` is
given (the source gives one; ``healthagent classify`` does not): its first ``kept`` reports are
events, the rest one more event that carries their count (``XidEvent.repeats``). A flood of a
million XID 13s then costs the policy a handful of events, and the XID after it is acted on as
soon as it is read.

mlx5_core (ConnectX) lines are read by the same parser, through the same header, facility and
earlier-boot handling, and folded the same way: ``kernel_log/mlx5.py`` says what a message means,
and such a line becomes an ``AdapterEvent`` (a malformed one is counted ``parse``). A record of
another facility is counted for them only when it quotes one of their events, not for naming the
driver.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Sequence

from healthagent.model import FALLEN_OFF_BUS_XID, INIT_FAILED, AdapterEvent, XidEvent, canonical_pci_bus_id
from healthagent.common import ErrorTally
from healthagent.sources.kernel_log import mlx5
from healthagent.sources.kernel_log.formats import (
    KERNEL_FACILITY,
    is_kmsg_dictionary_line,
    journal_json_kernel,
    kmsg_header,
    not_kernel,
    prefix_time,
    text_prefix,
    unescape_kmsg,
)
from healthagent.sources.kernel_log.repeats import RepeatFolder

SOURCE_NAME = "kmsg"
# What the parser reports: a GPU's XID (and its kin) or a ConnectX adapter's event.
KernelEvent = XidEvent | AdapterEvent
# A kernel record's text is at most 8 KiB; of a longer candidate line only this much is parsed.
MAX_PARSED_CHARS = 16 * 1024
# Lines before a resume point whose context the parser needs (look-back, SXid headline).
PARSER_CONTEXT_LINES = 4

# The XID/SXid report proper; group 2 is what the parentheses hold (PCI id, MIG ids: at most
# "PCI:0000:c5:00 GPU-I:03 GPU-CI:01"). Bounded repeats keep a garbage line linear, not quadratic.
# The number is taken whole and judged by its length (``MAX_XID_DIGITS``), never cut.
_XID = re.compile(r"(S?)Xid\s{0,4}\(([^)\n]{0,64})\)\s{0,4}:\s{0,4}(\d+)")
# A damaged report that still names a number ("NVRM: Xid (PCI:...) 94, ..." / "NVRM: Xid 94").
_XID_LOOSE = re.compile(r"(S?)Xid\b\s{0,4}(?:\(([^)\n]{0,64})\))?\s{0,4}[:,]?\s{0,4}(\d+)\b")
MAX_XID_DIGITS = 9
_PROCESS = re.compile(r",\s*pid='?(?P<pid><unknown>|\d+)'?(?:,\s*name='?(?P<name>[^,']*)'?)?")
_PCI_IN_TEXT = re.compile(r"(?<![0-9A-Za-z])(?:PCI:)?([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)(?![0-9A-Za-z])")
# The driver's per-GPU prefix (``NV_DEV_PRINTF``): "NVRM: GPU 0000:18:00.0: ..." (some builds
# leave out the domain: "NVRM: GPU 18:00.0: ..."), or the older "NVRM: GPU at PCI:0000:18:00: ...".
_GPU_PREFIX = re.compile(r"NVRM: GPU (?:at )?(?:PCI:)?((?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"
                         r"(?:\.[0-7])?)(?![0-9A-Za-z.])")
# The first line of the probe-time report, the only line a later "fallen off" line may borrow from.
_PROBE_HEAD = "The NVIDIA GPU"
_INIT_FAILED = "RmInitAdapter failed"
_MLX5 = mlx5.MARK  # "mlx5_core": the ConnectX driver's lines
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_SXID_DETAIL_PREFIXES = ("Severity", "Data")
# What starts a continuation line (or an empty one: neither is a header line).
_INDENT = " \t"


@dataclass(frozen=True)
class LogChunk:
    """What a reader hands the parser: new ``lines`` in log order, the ``context`` lines handed
    over before them (a resume point: read for their context, never reported again), and whether
    each line is a ``whole_record`` (one /dev/kmsg read: the kernel already joined a multi-line
    printk, so no line borrows from the lines before it)."""

    lines: Sequence[str]
    context: Sequence[str] = ()
    whole_records: bool = False


class XidLineParser:
    """Turns kernel-log lines into ``XidEvent``s and ``AdapterEvent``s; never raises, counts what it
    cannot read.

    Stateful only in small ways: the last two lines (the probe-time fallen-off-the-bus report
    names its GPU two lines earlier in dmesg's output), the last SXid headline (its ``Severity``
    and ``Data`` lines belong to it) and, with ``repeats``, the folding of the read in progress
    (``take_repeats`` ends it). ``now`` may be moved forward by the caller each cycle.
    """

    def __init__(self, tally: ErrorTally, *, boot_time: float, now: float, boot_id: str = "",
                 earlier_boot_before: float | None = None, repeats: RepeatFolder | None = None) -> None:
        self.tally = tally
        self.boot_time = boot_time
        self.now = now
        self.boot_id = boot_id
        # A text line whose wall-clock stamp is before this is an earlier boot's (``previous_boot``);
        # None: not judged (the boot time is unknown, or the input holds only this boot's records).
        self.earlier_boot_before = earlier_boot_before
        self._previous: tuple[str, str] = ("", "")
        self._head = ""  # the last line that is no indented continuation: a continuation's writer
        self._last_sxid: tuple[str, int] | None = None
        self.repeats = repeats

    def feed(self, chunk: LogChunk) -> Iterator[KernelEvent]:
        """The events of a reader's chunk: its context is taken first (at once), then its lines
        are scanned (lazily)."""
        if chunk.context:
            self.prime(chunk.context)
        return self._records(chunk.lines) if chunk.whole_records else self.scan(chunk.lines)

    def prime(self, lines: Iterable[str]) -> None:
        """Take the context of lines handed over before this parser existed (a restart): the
        look-back lines and the last SXid headline, yielding no event and counting nothing again."""
        tally, self.tally = self.tally, ErrorTally(SOURCE_NAME)
        repeats, self.repeats = self.repeats, None
        try:
            for _ in self.scan(lines):
                pass
        finally:
            self.tally, self.repeats = tally, repeats

    def take_repeats(self) -> list[KernelEvent]:
        """End the read in progress: the events that stand for the reports folded in it (each the
        last of its run, with ``repeats``); [] without a folder or when nothing was folded."""
        if self.repeats is None:
            return []
        return self.repeats.take(self.parse)

    def scan(self, lines: Iterable[str]) -> Iterator[KernelEvent]:
        """The events in ``lines``, lazily. Other lines cost four substring tests."""
        before, last = self._previous
        folded = self.repeats.fold_record if self.repeats is not None else None
        try:
            for line in lines:
                if line[:1] not in _INDENT:
                    self._head = line
                # the cheap pre-filter, then a storm's repeats folded from their text: the hot path
                if ("Xid" in line or "fallen off" in line or _INIT_FAILED in line or _MLX5 in line) and not (
                        folded is not None and folded(line, MAX_PARSED_CHARS)):
                    event = self._candidate(line, (before, last))
                    if event is not None:
                        yield event
                before, last = last, line
        finally:
            self._previous = (before, last)

    def _records(self, lines: Iterable[str]) -> Iterator[KernelEvent]:
        """The events of whole records: each is parsed alone, without look-back."""
        folded = self.repeats.fold_record if self.repeats is not None else None
        for line in lines:
            if ("Xid" in line or "fallen off" in line or _INIT_FAILED in line or _MLX5 in line) and not (
                    folded is not None and folded(line, MAX_PARSED_CHARS)):
                event = self._candidate(line, ("", ""))
                if event is not None:
                    yield event

    def _candidate(self, line: str, previous: tuple[str, str]) -> KernelEvent | None:
        """A line the pre-filter let through and no folded run took: its event, or None (nothing,
        or folded after parsing)."""
        repeats = self.repeats
        event = self.parse(line, previous)
        if event is None or (repeats is not None and repeats.fold(event, line, MAX_PARSED_CHARS)):
            return None
        return event

    def parse(self, line: str, previous: tuple[str, str] = ("", "")) -> KernelEvent | None:
        """The event one candidate line reports, or None. A parser bug costs one line (counted),
        never the agent."""
        if len(line) > MAX_PARSED_CHARS:
            self.tally.count("oversized", f"a {len(line)}-character line was cut to {MAX_PARSED_CHARS} "
                                          f"before parsing: {line[:120]!r}")
            line = line[:MAX_PARSED_CHARS]
        raw = line.rstrip("\r\n")
        try:
            head = kmsg_header(raw)
            if head is not None:
                if head.facility != KERNEL_FACILITY:
                    return self._not_kernel(raw, raw[head.end:], f"facility {head.facility}")
                seq: int | None = head.seq
                timestamp: float | None = self.boot_time + head.usec / 1e6
                message = raw[head.end:]
                if "\\x" in message:
                    message = unescape_kmsg(message)
            else:
                if is_kmsg_dictionary_line(raw):
                    return None  # a /dev/kmsg dictionary line, never a report
                seq = None
                if raw[:1] == "{":  # journalctl -o json
                    found = journal_json_kernel(raw)
                    if isinstance(found, str):
                        return self._not_kernel(raw, raw, found)
                    message, timestamp = found
                else:
                    prefix = text_prefix(raw)
                    why = not_kernel(prefix)
                    if not why and prefix.end() == len(raw) - len(raw.lstrip()) and raw[:1] in _INDENT:
                        # a continuation line: its writer is the header line's above it
                        why = not_kernel(text_prefix(self._head)) if self._head else ""
                    if why:
                        return self._not_kernel(raw, raw[prefix.end():], why)
                    message = raw[prefix.end():]
                    if "#012" in message:  # rsyslog's escape of an embedded newline
                        message = message.replace("#012", "\n")
                    timestamp = self._timestamp(prefix, raw)
            event: KernelEvent | None = None
            if "Xid" in message:
                event = self._xid_event(raw, message, timestamp, seq)
            if event is None and "fallen off" in message and ("NVRM" in message or "GPU" in message):
                event = self._fallen_off_event(raw, message, timestamp, seq, previous)
            if event is None and _INIT_FAILED in message and "NVRM" in message:
                event = self._init_failed_event(raw, message, timestamp, seq)
            if event is None and _MLX5 in message:
                event = self._adapter_event(raw, message, timestamp, seq)
        except Exception as exc:
            self.tally.count("parse", f"parser error={exc!r} line={line[:300]!r}")
            return None
        if (event is not None and seq is None and self.earlier_boot_before is not None
                and event.timestamp < self.earlier_boot_before):
            event = replace(event, previous_boot=True)  # a kmsg record (seq) is always this boot's
        return event

    def _not_kernel(self, raw: str, message: str, which: str) -> None:
        """A record user space wrote (not facility 0, not the ``kernel`` tag): never a report;
        counted when it reads like one
        (any line the XID words let through; of the mlx5_core lines, only an event's)."""
        if not ("NVRM: Xid" in message or "SXid" in message or "Xid (" in message or ("fallen off" in message and ("NVRM" in message or "GPU" in message))
                or (_INIT_FAILED in message and "NVRM" in message)):
            if _MLX5 not in message:
                return None  # the pre-filter's words in a line no report would be read from
            try:
                if mlx5.read_report(message) is None:
                    return None  # the driver's name in someone's text, not an adapter event
            except mlx5.Malformed:
                pass
        self.tally.count("not_kernel_facility", f"a line of {which}, not the kernel's, ignored: {raw[:300]!r}")
        return None

    # -- reports ------------------------------------------------------------------------------------

    def _xid_event(self, raw: str, message: str, timestamp: float | None,
                   seq: int | None) -> XidEvent | None:
        match = _XID.search(message)
        loose = match is None
        if loose:
            if not ("NVRM: Xid" in message or "SXid" in message or "Xid (" in message):
                return None  # "Xid" in some other word or message: not a report
            match = _XID_LOOSE.search(message)
            if match is None:
                self.tally.count("parse", f"XID line without a readable XID number: {raw[:300]!r}")
                return None
        if len(match.group(3)) > MAX_XID_DIGITS:
            self.tally.count("parse", f"XID number of {len(match.group(3))} digits (at most {MAX_XID_DIGITS}): "
                                      f"malformed, nothing kept: {raw[:300]!r}")
            return None
        if loose:
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
        """The GPU is named on the line itself (the driver's ``NVRM: GPU <id>:`` prefix, a
        ``PCI:`` id, a full ``dddd:bb:dd.f``), or, for the last line of the probe-time report that
        dmesg split, on that report's first line (``The NVIDIA GPU <id>``) one or two lines back.
        A line of the driver's per-GPU form names its own GPU or none: the line before it may be
        another GPU's report, and borrowing its address would blame the wrong GPU."""
        found = _GPU_PREFIX.search(message) or _PCI_IN_TEXT.search(message)
        if found is None and "NVRM: GPU " not in message:
            for earlier in reversed(previous):
                if _PROBE_HEAD in earlier and (found := _PCI_IN_TEXT.search(earlier)) is not None:
                    if timestamp is None:  # the report's continuation line carries no stamp
                        timestamp = self._timestamp(text_prefix(earlier), earlier)
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

    def _init_failed_event(self, raw: str, message: str, timestamp: float | None,
                           seq: int | None) -> XidEvent:
        """``NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x62:0xffff:1863)``: the driver could
        not initialise that GPU. Older drivers print ``NVRM: RmInitAdapter failed! (...)`` with no
        address (kept with pci_bus_id "", counted). The ``rm_init_adapter failed`` line the driver
        adds is the same failure and is not reported again."""
        found = _GPU_PREFIX.search(message)
        pci = canonical_pci_bus_id(found.group(1)) if found else None
        if pci is None:
            self.tally.count("parse", f"RmInitAdapter line without a PCI id (kept with pci_bus_id \"\"): "
                                      f"{raw[:300]!r}")
        return XidEvent(
            xid=0, pci_bus_id=pci or "", message=message, line=raw,
            timestamp=self.now if timestamp is None else timestamp, source=SOURCE_NAME, kind=INIT_FAILED,
            seq=seq, boot_id=self.boot_id if seq is not None else "",
        )

    def _adapter_event(self, raw: str, message: str, timestamp: float | None,
                       seq: int | None) -> AdapterEvent | None:
        """An mlx5_core line (``kernel_log/mlx5.py``): its event, or None for the driver's other
        lines. A report that lost a part it needs is counted and not reported; one that does not
        name its adapter is kept with pci_bus_id "" (counted), as an XID without a GPU is."""
        try:
            report = mlx5.read_report(message)
        except mlx5.Malformed as exc:
            self.tally.count("parse", f"malformed mlx5_core line ({exc}), nothing kept: {raw[:300]!r}")
            return None
        if report is None:
            return None
        pci = canonical_pci_bus_id(report.pci) if report.pci else None
        if pci is None:
            self.tally.count("parse", f"mlx5_core {report.event} line without a readable PCI id (kept with "
                                      f"pci_bus_id \"\"): {raw[:300]!r}")
        return AdapterEvent(
            event=report.event, pci_bus_id=pci or "", message=message, line=raw, detail=report.detail,
            timestamp=self.now if timestamp is None else timestamp, source=SOURCE_NAME, seq=seq,
            boot_id=self.boot_id if seq is not None else "",
        )

    def _timestamp(self, prefix: re.Match[str], raw: str) -> float | None:
        """Wall time of a text line (``prefix_time``); None when the line has no stamp or an
        unreadable one (counted): the event is then stamped ``now``."""
        try:
            return prefix_time(prefix, self.boot_time, self.now)
        except (ValueError, OverflowError, OSError):
            self.tally.count("parse", f"unreadable timestamp (event kept, stamped now): {raw[:200]!r}")
        return None
