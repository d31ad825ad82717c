"""XID incidents: one fault, one finding, however many XIDs the driver logs for it.

A failing GPU makes the driver log a burst (XID 94, 45, 45, 45 ... 154); a node must get one
Event per incident, not forty. So XIDs on one GPU join the same incident until
``incident_quiet_seconds`` of silence (NVIDIA's fleet tooling uses three minutes). The incident's
finding keeps its id (so ``Finding.key`` is stable for the whole incident), lists its
distinct XIDs with counts, and takes the most severe action of its members.

The same XID often arrives twice: from the kernel log and from NVML's event queue, seconds apart
(and XID 79 a third time, as the kernel's separate "GPU has fallen off the bus" line). Within
``xid_dedupe_seconds`` a report from one reporter joins an earlier counted report of the same
(GPU, XID) that this reporter has not joined yet, and is not counted again; repeats from one
reporter are real repeats. A report that stands for several (``XidEvent.repeats``: a kernel-log
flood folded into one event, a dcgm counter that rose by three) pairs as that many: a folded
flood of 50 from the kernel log and NVML's 50 single events of it count 50, not 99.
An XID whose GPU is unknown is a node-level incident: never dropped. When a new incident may
open is its code's rule (``debounce.py``: at once by default; a count within a window, a grace
after the boot); XIDs that do not open one are still counted in the metrics.

An XID's PCI id (or GPU UUID) that matches no GPU, and an SXid's NVSwitch PCI id, come from the
log's text: they go through the shared bound on untrusted names (``healthagent/bounded_names.py``)
before they name an incident or a count; past the bound they fold into one ``~other`` subject
whose incident takes the most severe action of its members, like any other. So do XID and SXid
numbers the catalog does not know and the policy does not map (their action does not depend on
the number): past the bound they are ``FOLDED_NUMBER``, exported as ``~other``.

An operator's clear closes the incident as it was when the operator cleared; XIDs that joined it
after that (the loop learns of a clear only once the effects finish applying it) are reopened as
a new incident (``reopen``), acted on again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from healthagent.bounded_names import (FOLDED_NUMBER, OVERFLOW, SXID_SWITCHES, UNMAPPED_NUMBERS,
                                       XID_UNMATCHED_PCI, NameBound)

from healthagent.model import FALLEN_OFF_BUS_XID, Action, GpuSample, XidEvent, canonical_pci_bus_id
from healthagent.policy.book import EVENT, Entry, FindingBook, Incident, IncidentMember, Where
from healthagent.policy.catalog import Catalog
from healthagent.policy.counters import finite
from healthagent.policy.findings import (ACTION_STEPS, ACTION_WORDS, FINDINGS, fill, gpu_words,
                                         span_words, steps_for)
from healthagent.policy.settings import Policy

GPU_XID = "GPU_XID"
NVSWITCH_SXID = "NVSWITCH_SXID"
# The finding codes this module's rules produce (each has its row in findings.csv; a test checks both ways).
PRODUCES = (GPU_XID, NVSWITCH_SXID)
MAX_RECENT = 256  # remembered events per (GPU, XID) for cross-source pairing
# Open incidents on the whole node: a log that names hundreds of PCI ids (a driver printing XIDs
# for devices NVML does not list, or garbage) must not grow the verdict and the state file
# without end. The mildest, oldest go first, so the node's action is the last thing to go.
MAX_INCIDENTS = 512


def event_time(event: XidEvent, now: float) -> float:
    """The event's own time when it is sane, else the collection's; never in the future."""
    t = event.timestamp
    if not finite(t) or t <= 0:
        return now
    return min(float(t), now)


def locate(event: XidEvent, gpus: Iterable[GpuSample]) -> Where:
    """Which GPU an event names: by PCI id, else UUID, else NVML index."""
    pci = canonical_pci_bus_id(event.pci_bus_id) if event.pci_bus_id else None
    if event.kind == "sxid":
        return Where(pci_bus_id=pci or "")
    for gpu in gpus:
        if (pci and gpu.pci_bus_id == pci) or (not pci and event.uuid and gpu.uuid == event.uuid) or (
                not pci and not event.uuid and event.gpu_index is not None and gpu.index == event.gpu_index):
            return Where(gpu.index, gpu.pci_bus_id, gpu.uuid or event.uuid)
    return Where(event.gpu_index, pci or "", event.uuid)


@dataclass
class XidIncidents:
    policy: Policy
    catalog: Catalog
    # "subject/kind/number" -> {"items": [[t, owner, n, {reporter: joined}], ...],
    #                           "next": {reporter: item index}}: each item is n counted reports
    # from ``owner`` at time t, of which ``joined`` were matched by another reporter's.
    recent: dict[str, dict[str, Any]] = field(default_factory=dict)
    paired: int = 0  # events not counted because another source already reported them
    unmatched: NameBound = field(default_factory=lambda: NameBound("xid_pci", XID_UNMATCHED_PCI))
    switches: NameBound = field(default_factory=lambda: NameBound("sxid_pci", SXID_SWITCHES))
    numbers: NameBound = field(default_factory=lambda: NameBound("xid_number", UNMAPPED_NUMBERS))

    def arrange(self, events: Iterable[XidEvent], gpus: tuple[GpuSample, ...],
                now: float) -> list[tuple[XidEvent, float, Where]]:
        """The events with their time and GPU, oldest first (the order incidents must see them);
        a PCI id no GPU has goes through its bound, in the event (its count) and the subject."""
        self._forget(now)
        arranged = []
        for event in events:
            where = locate(event, gpus)
            if where.gpu_index is None and where.pci_bus_id:
                bound = self.switches if event.kind == "sxid" else self.unmatched
                pci = bound.admit(where.pci_bus_id)
                if pci != where.pci_bus_id:
                    where, event = Where(None, pci, where.uuid), replace(event, pci_bus_id=pci)
            if where.gpu_index is None and event.uuid and self.unmatched.admit(f"uuid/{event.uuid}") == OVERFLOW:
                where, event = Where(None, where.pci_bus_id, OVERFLOW), replace(event, uuid=OVERFLOW)
            arranged.append((self._bounded_number(event), event_time(event, now), where))
        return sorted(arranged, key=lambda p: p[1])

    def take(self, event: XidEvent, t: float, where: Where, book: FindingBook) -> int:
        """Join one event to its incident; returns how many of the reports it stands for were
        counted (0 when all repeat another reporter's). The incident's words are written by
        ``describe`` once the batch is in."""
        counted = self._not_yet_reported(event, t, where)
        if counted:
            self._join(event, t, where, book, counted)
        return counted

    def describe(self, book: FindingBook) -> None:
        """Write summary, evidence and next steps of the incidents that changed."""
        for entry in book.entries.values():
            if entry.incident is not None and entry.incident.changed:
                entry.incident.changed = False
                self._describe(entry)

    def _bounded_number(self, event: XidEvent) -> XidEvent:
        """The event with its number bounded when no catalog row or policy entry names it."""
        if event.kind not in ("xid", "sxid"):
            return event
        entry = self.catalog.lookup_sxid(event.xid) if event.kind == "sxid" else self.catalog.lookup(event.xid)
        if entry.known or entry.overridden:
            return event
        number = self.numbers.admit(f"{event.kind}/{event.xid}")
        return event if number != OVERFLOW else replace(event, xid=FOLDED_NUMBER)

    # -- cross-source pairing ---------------------------------------------------------------------

    def _not_yet_reported(self, event: XidEvent, t: float, where: Where) -> int:
        """How many of the event's reports no other reporter (source, or the kernel's separate
        fallen-off-the-bus line) already made for this XID on this GPU within the window: those
        are one fault seen twice, counted once.

        Each reporter joins the counted reports in time order (a pointer per reporter), so pairing
        costs the same for one XID as for a flood of fifty thousand, folded or not.
        """
        window = self.policy.xid_dedupe_seconds
        number = FALLEN_OFF_BUS_XID if event.kind == "fallen_off_bus" else event.xid
        kind = "sxid" if event.kind == "sxid" else "xid"
        reporter = f"{event.source}/{event.kind}"
        recent = self.recent.setdefault(f"{where.subject}/{kind}/{number}", {"items": [], "next": {}})
        items, following = recent["items"], recent["next"]
        left = max(1, event.repeats)
        i = following.get(reporter, 0)
        while left and i < len(items):
            when, owner, n, joined = items[i]
            if when > t + window:
                break
            free = 0 if (when < t - window or owner == reporter) else n - joined.get(reporter, 0)
            if free <= 0:
                i += 1
                continue
            pairs = min(free, left)
            joined[reporter] = joined.get(reporter, 0) + pairs
            self.paired += pairs
            left -= pairs
            if pairs == free:
                i += 1  # this reporter has matched the whole item
        following[reporter] = i
        if left:
            items.append([t, reporter, left, {}])
            if len(items) > MAX_RECENT:
                _drop_front(recent, len(items) - MAX_RECENT)
        return left

    def _forget(self, now: float) -> None:
        horizon = now - 2 * self.policy.xid_dedupe_seconds
        for key in list(self.recent):
            recent = self.recent[key]
            old = 0
            while old < len(recent["items"]) and recent["items"][old][0] < horizon:
                old += 1
            if old == len(recent["items"]):
                del self.recent[key]
            elif old:
                _drop_front(recent, old)

    # -- incidents --------------------------------------------------------------------------------

    def _join(self, event: XidEvent, t: float, where: Where, book: FindingBook, repeats: int) -> None:
        entry_info, action, why = self.catalog.decide(event)
        if action is Action.NONE:
            return  # the operator silenced this XID; it is still counted in the metrics
        code = NVSWITCH_SXID if event.kind == "sxid" else GPU_XID
        if not self.policy.enabled(code) or book.in_grace(code, t):
            return
        opens = book.opens(code, f"{code}/{where.subject}", t, occurrences=repeats)
        quiet = self.policy.incident_quiet_seconds
        joinable = [e for _, e in book.matching(code, where.subject) if e.incident is not None
                    and e.incident.earliest - quiet <= t <= e.incident.latest + quiet]
        if joinable:
            entry = max(joinable, key=lambda e: e.incident.latest)
        elif opens:
            entry = self._open(code, where, t, book)
        else:
            return
        incident = entry.incident
        assert incident is not None  # every entry matched or opened here is an incident
        incident.note(book.observation, str(entry_info.xid), t, event.source, action.value, repeats)
        entry.touched = book.observation
        member = incident.members.setdefault(str(entry_info.xid), IncidentMember())
        member.count += repeats
        if action.severity > Action.parse(member.action).severity:
            member.action, member.why = action.value, why
        if event.source and event.source not in incident.sources:
            incident.sources.append(event.source)
        incident.earliest = min(incident.earliest, t)
        incident.latest = max(incident.latest, t)
        entry.where = Where(
            entry.where.gpu_index if entry.where.gpu_index is not None else where.gpu_index,
            entry.where.pci_bus_id or where.pci_bus_id, entry.where.uuid or where.uuid)
        entry.count += repeats
        entry.last_seen = max(entry.last_seen, t)
        entry.quiet_seconds = self.policy.xid_window_seconds
        entry.action = Action.most_severe([entry.action, action])
        incident.changed = True

    def _open(self, code: str, where: Where, t: float, book: FindingBook) -> Entry:
        finding_id = book.new_id()
        key = f"{code}/{where.subject}/{finding_id}"
        entry = Entry(code=code, action=Action.NONE, summary="", evidence="", next_steps="", where=where,
                      first_seen=t, last_seen=t, kind=EVENT,
                      quiet_seconds=self.policy.xid_window_seconds, count=0,
                      incident=Incident(earliest=t, latest=t), opened=book.observation,
                      touched=book.observation, id=finding_id)
        book.entries[key] = entry
        self._bound(code, where.subject, key, book)
        return entry

    def _bound(self, code: str, subject: str, keep: str, book: FindingBook) -> None:
        """At most ``max_incidents_per_gpu`` incidents per GPU and ``MAX_INCIDENTS`` on the node:
        the mildest, oldest go first."""
        mine = [(k, e) for k, e in book.matching(code, subject) if k != keep]
        _drop_mildest(book, mine, len(mine) + 1 - int(self.policy.max_incidents_per_gpu))
        every = [(k, e) for k, e in book.entries.items() if e.incident is not None and k != keep]
        _drop_mildest(book, every, len(every) + 1 - MAX_INCIDENTS)

    def reopen(self, entry: Entry, as_of: int) -> Entry | None:
        """The part of an incident that joined after observation ``as_of`` (an operator's clear),
        as a new incident; None when nothing did. When the tail no longer reaches back to the
        clear, the whole incident is kept as the new one: counting a cleared XID again is
        better than losing a new one."""
        old = entry.incident
        if old is None:
            return None
        after = [item for item in old.tail if item[0] > as_of]
        if old.tail_floor > as_of:  # joins after the clear were dropped from the tail: keep it all
            incident = Incident(earliest=old.earliest, latest=old.latest, members=dict(old.members),
                                sources=list(old.sources), tail=[list(i) for i in old.tail],
                                tail_floor=old.tail_floor)
            count, opened = entry.count, as_of + 1
            first = min((item[3] for item in after), default=old.latest)
        elif after:
            first = min(item[3] for item in after)
            incident = Incident(earliest=first, latest=max(item[4] for item in after),
                                tail=[list(i) for i in after])
            for _, xid, n, _, _, source, action in after:
                member = incident.members.setdefault(xid, IncidentMember())
                member.count += n
                if Action.parse(action).severity > Action.parse(member.action).severity:
                    before = old.members.get(xid)
                    member.action = action
                    member.why = before.why if before is not None and before.action == action else ""
                if source and source not in incident.sources:
                    incident.sources.append(source)
            count, opened = sum(item[2] for item in after), min(item[0] for item in after)
        else:
            return None
        incident.changed = True
        return Entry(code=entry.code, action=Action.NONE, summary="", evidence="", next_steps="",
                     where=entry.where, first_seen=first, last_seen=incident.latest, kind=EVENT,
                     quiet_seconds=entry.quiet_seconds, count=count, incident=incident,
                     opened=opened, touched=entry.touched)

    def _describe(self, entry: Entry) -> None:
        incident = entry.incident
        members = incident.members
        for_action = {x: Action.parse(m.action) for x, m in members.items()}
        entry.action = Action.most_severe(list(for_action.values()))
        entry.xids = tuple(sorted(int(x) for x in members))
        worst = max(members, key=lambda x: (for_action[x].severity, members[x].count, -int(x)))
        sxid = entry.code == NVSWITCH_SXID
        label = "SXid" if sxid else "XID"
        info = self.catalog.lookup_sxid(int(worst)) if sxid else self.catalog.lookup(int(worst))
        w = entry.where
        place = f"NVSwitch {w.pci_bus_id or '(PCI id unknown)'}" if sxid else (
            gpu_words(w.gpu_index, w.pci_bus_id) if (w.pci_bus_id or w.gpu_index is not None)
            else "a GPU the log did not name (node-level)")
        counts = ", ".join(f"{x} x{members[str(x)].count}" for x in entry.xids)
        sources = ", ".join(incident.sources) or "unknown"
        entry.evidence = (f"{label} {counts} on {place} {span_words(incident.earliest, incident.latest)} "
                          f"(source: {sources}); {members[worst].action}"
                          + (f": {members[worst].why}" if members[worst].why else ""))
        what = f"{info.description or info.name} ({label} {worst}, {info.name})"
        if int(worst) == FOLDED_NUMBER:
            what = f"{label}s of numbers no catalog row or policy entry names, past the first {UNMAPPED_NUMBERS}"
        if entry.action is Action.RESTART_APP:
            entry.summary = f"the application on {place} faulted: {what}; the GPU is expected to be healthy"
        else:
            entry.summary = f"{place}: {what}; {ACTION_WORDS[entry.action]}"
        if len(entry.xids) > 1:
            entry.summary += f" ({len(entry.xids)} XIDs in this incident)"
        if sxid:
            entry.next_steps = steps_for(NVSWITCH_SXID)
        else:
            steps = fill(ACTION_STEPS[entry.action], index=w.gpu_index, pci_bus_id=w.pci_bus_id, xid=int(worst))
            entry.next_steps = f"{steps} Runbook: {FINDINGS[GPU_XID].runbook}"

    # -- state ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"recent": {k: {"items": [[i[0], i[1], i[2], dict(i[3])] for i in v["items"]],
                               "next": dict(v["next"])} for k, v in self.recent.items()},
                "paired": self.paired}

    def load(self, d: dict[str, Any]) -> None:
        recent = {}
        for key, value in d.get("recent", {}).items():
            items = [_load_item(i) for i in value["items"]][-MAX_RECENT:]
            following = {str(r): min(max(0, int(n)), len(items)) for r, n in value["next"].items()}
            recent[str(key)] = {"items": items, "next": following}
        self.recent = recent
        self.paired = int(d.get("paired", 0))


def _drop_mildest(book: FindingBook, entries: list[tuple[str, Entry]], extra: int) -> None:
    if extra > 0:
        entries.sort(key=lambda ke: (ke[1].action.severity, ke[1].last_seen))
        for key, _ in entries[:extra]:
            del book.entries[key]


def _drop_front(recent: dict[str, Any], count: int) -> None:
    del recent["items"][:count]
    recent["next"] = {r: max(0, n - count) for r, n in recent["next"].items()}


def _load_item(item: list[Any]) -> list[Any]:
    """One remembered report from a state file: ``[t, owner, n, {reporter: joined}]``; anything
    else raises, and the item is left out and counted by the caller."""
    return [float(item[0]), str(item[1]), max(1, int(item[2])), {str(r): int(n) for r, n in item[3].items()}]
