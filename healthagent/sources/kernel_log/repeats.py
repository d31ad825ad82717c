"""Folding a flood of one XID into a few events that carry its count; no I/O.

Why: a GPU in a fault loop (or a broken application) can make the driver log the same XID a
million times. Handed to the policy one event per line, that costs seconds per read, holds every
line in memory until the read ends, and delays the XID after the flood (the one that matters,
say XID 94) by as long as the flood takes to judge. So within one read the first ``kept`` reports
of the same (kind, XID, GPU) are events as they are, and the rest become one more event, the last
of them, with ``repeats`` set to how many it stands for. Nothing is lost: counts stay exact, and
the first reports (the ones that name the root cause, the pid and process) are kept whole.

For a /dev/kmsg record whose report was already seen ``kept`` times in this read, the folder
decides from the record's XID text alone, without taking the record apart: that is what makes a
flood cheap to read, not only cheap to judge. Only a record that cannot differ from the ones
already parsed is folded that way (same header form, same parenthesised GPU text, same number,
no escapes); anything else is parsed in full first.

A ConnectX adapter's event (``AdapterEvent``: a module flapping, a firmware command timing out
again and again) folds the same way, by (event, adapter, detail); its lines are always parsed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

from healthagent.model import AdapterEvent, XidEvent

# First reports of one (kind, XID, GPU) per read that are handed over as they are.
REPEATS_KEPT = 8

# An XID report's text as the parser's pattern reads it (without its SXid group), whole.
_REPORT_TEXT = re.compile(r"Xid\s{0,4}\([^)\n]{0,64}\)\s{0,4}:\s{0,4}\d{1,9}")

EventKey = tuple  # (kind, xid, pci_bus_id, gpu_instance, compute_instance, previous_boot)
Report = XidEvent | AdapterEvent


def event_key(event: Report) -> EventKey:
    """What makes two reports the same report: an adapter event's (event, adapter, detail) in
    the places of an XID's (XID, GPU, MIG instances)."""
    if isinstance(event, AdapterEvent):
        return ("mlx5", event.event, event.pci_bus_id, event.detail, None, event.previous_boot)
    return (event.kind, event.xid, event.pci_bus_id, event.gpu_instance, event.compute_instance,
            event.previous_boot)


def record_key(line: str, max_chars: int) -> str | None:
    """The XID text of a /dev/kmsg record line (``Xid (PCI:0000:53:00): 13``, up to the comma
    after it), or None when the line must be parsed in full (no record header, a record of another
    facility than the kernel's, escaped text, an SXid, an XID text before the message, an overlong
    line). String searches only: this runs once per line of a storm. A key only folds a line once
    a line with the same key was parsed in full (``RepeatFolder.fold``), so two lines with the same
    key are the same report to the parser."""
    semi = line.find(";")
    if semi <= 0 or len(line) > max_chars or not line[0].isdigit() or line.find(" ", 0, semi) >= 0:
        return None
    if line[1] != "," or line[0] > "7":
        # Not one digit 0-7, the kernel's facility (0) as the kernel prints it: user space's record
        # (or an odd one) is parsed in full, where it is ignored, never folded into the driver's.
        return None
    at = line.find("Xid", semi)
    if at < 0 or line[at - 1] == "S" or "\\x" in line:
        return None
    end = line.find(",", at)
    return line[at:end] if end > 0 else None


@dataclass
class _Folded:
    count: int
    last: Report | None  # the last folded report, parsed; or
    line: str  # its record line, parsed when the read ends


class RepeatFolder:
    """The folding state of one read: offer it every candidate line (``fold_record``, before
    parsing) and every event (``fold``, after), then ``take`` the summaries, which starts the next
    read afresh."""

    def __init__(self, kept: int = REPEATS_KEPT) -> None:
        self.kept = max(1, kept)
        self._seen: dict[EventKey, int] = {}
        self._by_record: dict[str, EventKey] = {}
        self._folded: dict[EventKey, _Folded] = {}
        self._template: dict[EventKey, Report] = {}

    def fold_record(self, line: str, max_chars: int) -> bool:
        """True when this record line is a repeat folded without parsing it."""
        if not self._by_record:
            return False
        key = record_key(line, max_chars)
        event = self._by_record.get(key) if key is not None else None
        if event is None or self._seen.get(event, 0) < self.kept:
            return False
        folded = self._folded.get(event)
        if folded is None:
            self._folded[event] = _Folded(1, None, line)
        else:
            folded.count += 1
            folded.last, folded.line = None, line
        return True

    def fold(self, event: Report, line: str, max_chars: int) -> bool:
        """True when ``event`` is a repeat folded into the summary; False: hand it over."""
        key = event_key(event)
        seen = self._seen.get(key, 0)
        if seen < self.kept:
            self._seen[key] = seen + 1
            if isinstance(event, XidEvent) and event.kind == "xid" and event.seq is not None and event.pci_bus_id:
                record = record_key(line, max_chars)
                if record is not None and _REPORT_TEXT.fullmatch(record):
                    self._by_record.setdefault(record, key)
            self._template[key] = event
            return False
        folded = self._folded.get(key)
        if folded is None:
            self._folded[key] = _Folded(1, event, "")
        else:
            folded.count += 1
            folded.last, folded.line = event, ""
        return True

    def take(self, parse: Callable[[str], Report | None]) -> list[Report]:
        """The summaries of this read (one per folded report, the last one with ``repeats``), and
        a fresh start for the next read. ``parse`` takes a record line apart."""
        summaries = []
        for key, folded in self._folded.items():
            last = folded.last if folded.last is not None else parse(folded.line)
            if last is None or event_key(last) != key:
                last = self._template[key]  # cannot happen for a record that matched; never lose the count
            summaries.append(replace(last, repeats=folded.count))
        self._seen.clear()
        self._by_record.clear()
        self._folded.clear()
        self._template.clear()
        return summaries
