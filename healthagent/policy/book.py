"""The open findings and their life cycle: raise, recur, expire, survive a reboot, get cleared.

Rules report *signals* ("GPU 3's row remap is pending", "rx_drops grew 400 in a minute"); the book
turns them into findings that are stable across cycles, because a verdict that flips every cycle
would taint and untaint a node forty times an hour. Two kinds of signal:

- an *event* (an XID incident, counter growth, a rate over its limit) raises or refreshes a
  finding that lasts ``quiet_seconds`` after its last recurrence;
- a *condition* (a flag or a state: remap pending, GPU lost, a device missing) raises, and clears
  after ``condition_clear_evaluations`` good readings.

When a finding of either kind may open is its code's rule (``debounce.py``: a count within a
window, a sustain, a grace after the boot), judged by one function for every code; the book
keeps each subject's tally and hands it the readings. A rule with nothing to count keeps nothing.

Whatever the kind, persistence is by class: a ``reboot_node`` finding stays until the boot id
changes (then it clears if the checks pass, and a condition that comes straight back is escalated
to ``replace_node``: a reboot did not fix it); a ``replace_node`` finding stays until an operator
clears it or the GPU it names is physically replaced.

An operator's clear closes what was open when the operator cleared, nothing later: every entry
knows the observation that opened it and the last one that refreshed it (``opened``,
``touched``), and the clear names the observation it acted on. A finding opened after it is
kept; an event that recurred after it (an XID joining the incident the operator just cleared)
is reopened as a new finding with a new key, so the node is acted on again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable

from healthagent.model import Action, Finding
from healthagent.policy.debounce import EMPTY, Tally, in_grace, step
from healthagent.policy.settings import Policy

EVENT = "event"
CONDITION = "condition"
MAX_TAIL = 64  # an incident's latest joins kept for an operator's clear (see Incident.tail)


@dataclass(frozen=True)
class Where:
    """The subject a finding names: a GPU, an EFA device or the node."""

    gpu_index: int | None = None
    pci_bus_id: str = ""
    uuid: str = ""
    fabric_device: str = ""

    @property
    def subject(self) -> str:
        return self.pci_bus_id or self.fabric_device or "node"


@dataclass(frozen=True)
class Signal:
    """What one rule says about one subject in one evaluation. An event rule that read its
    subject and found nothing says so too (``bad`` False): that ends a run its rule counts.
    ``occurrences``: how many raw occurrences it stands for (a folded flood of kernel-log lines)."""

    code: str
    where: Where
    bad: bool
    kind: str = EVENT
    action: Action = Action.MONITOR
    summary: str = ""
    evidence: str = ""
    next_steps: str = ""
    quiet_seconds: float = 0.0
    signature: str = ""  # a condition's identity for operator acknowledgement (clear)
    count: int = 1
    occurrences: int = 1

    @property
    def key(self) -> str:
        return f"{self.code}/{self.where.subject}"


@dataclass
class IncidentMember:
    """One XID number within an incident: how often, and the most severe action it asked for."""

    count: int = 0
    action: str = "none"
    why: str = ""


@dataclass
class Incident:
    """An XID incident: its members by XID number, who reported them, and its time span.
    ``changed`` marks an incident whose words must be written again (not saved).

    ``tail`` keeps the latest joins, one item per (observation, XID, reporter, action):
    ``[observation, xid, count, earliest, latest, source, action]``, at most ``MAX_TAIL`` (a flood
    of one XID in one observation is one item; the why of an action is the member's). An
    operator's clear reads it to keep what joined after the clear; ``tail_floor`` is the newest
    observation whose joins were dropped from it (0: nothing dropped), so the clear knows when
    the tail no longer covers its cut-off.
    """

    earliest: float
    latest: float
    members: dict[str, IncidentMember] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    changed: bool = False
    tail: list[list] = field(default_factory=list)
    tail_floor: int = 0

    def note(self, observation: int, xid: str, t: float, source: str, action: str, count: int = 1) -> None:
        """Remember a join (``count`` reports of one XID) in the tail."""
        last = self.tail[-1] if self.tail else None
        if last is not None and (last[0], last[1], last[5], last[6]) == (observation, xid, source, action):
            last[2] += count
            last[3], last[4] = min(last[3], t), max(last[4], t)
            return
        self.tail.append([observation, xid, count, t, t, source, action])
        self._trim()

    def _trim(self) -> None:
        while len(self.tail) > MAX_TAIL:
            self.tail_floor = max(self.tail_floor, self.tail.pop(0)[0])

    def to_dict(self) -> dict[str, Any]:
        return {"members": {x: asdict(m) for x, m in self.members.items()}, "sources": list(self.sources),
                "earliest": self.earliest, "latest": self.latest, "tail": [list(i) for i in self.tail],
                "tail_floor": self.tail_floor}

    @classmethod
    def from_dict(cls, raw: Any) -> "Incident | None":
        """As saved, checked field by field (garbage raises). A state without the tail (an older
        agent's) restores an empty one: a clear then closes the whole incident, as that agent did."""
        if raw is None:
            return None
        members = {str(int(x)): IncidentMember(int(m["count"]), Action.parse(m["action"]).value, str(m.get("why", "")))
                   for x, m in raw["members"].items()}
        tail = [[int(i[0]), str(int(i[1])), int(i[2]), float(i[3]), float(i[4]), str(i[5]),
                 Action.parse(i[6]).value] for i in raw.get("tail", ())]
        incident = cls(earliest=float(raw["earliest"]), latest=float(raw["latest"]), members=members,
                       sources=[str(src) for src in raw["sources"]], tail=tail,
                       tail_floor=int(raw.get("tail_floor", 0)))
        incident._trim()  # a longer tail (another version's) keeps its newest items, floor raised
        return incident


@dataclass
class Entry:
    """One open finding as the book keeps it (mutable inside the classifier only)."""

    code: str
    action: Action
    summary: str
    evidence: str
    next_steps: str
    where: Where
    first_seen: float
    last_seen: float
    kind: str = EVENT
    quiet_seconds: float = 0.0
    count: int = 1
    xids: tuple[int, ...] = ()
    signature: str = ""
    incident: Incident | None = None  # an XID incident (incidents.py)
    opened: int = 0  # the observation that raised it (FindingBook.observation)
    touched: int = 0  # the last observation that raised or refreshed it
    id: int = 0  # the finding's id (FindingBook.new_id): part of ``Finding.key``

    @property
    def sticky(self) -> bool:
        """reboot_node and replace_node findings do not time out."""
        return self.action.severity >= Action.REBOOT_NODE.severity

    def finding(self) -> Finding:
        return Finding(
            code=self.code, action=self.action, summary=self.summary, evidence=self.evidence,
            next_steps=self.next_steps, gpu_index=self.where.gpu_index,
            pci_bus_id=self.where.pci_bus_id, uuid=self.where.uuid, fabric_device=self.where.fabric_device,
            xids=self.xids, count=self.count, first_seen=self.first_seen, last_seen=self.last_seen,
            id=self.id,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["action"] = self.action.value
        d["xids"] = list(self.xids)
        d["incident"] = self.incident.to_dict() if self.incident is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Entry":
        raw = d["where"]
        index = raw.get("gpu_index")
        where = Where(None if index is None else int(index), str(raw.get("pci_bus_id", "")),
                      str(raw.get("uuid", "")), str(raw.get("fabric_device", "")))
        incident = Incident.from_dict(d.get("incident"))
        return cls(
            code=str(d["code"]), action=Action.parse(d["action"]), summary=str(d["summary"]),
            evidence=str(d["evidence"]), next_steps=str(d["next_steps"]), where=where,
            first_seen=float(d["first_seen"]), last_seen=float(d["last_seen"]), kind=str(d["kind"]),
            quiet_seconds=float(d["quiet_seconds"]), count=int(d["count"]),
            xids=tuple(int(x) for x in d.get("xids", ())), signature=str(d.get("signature", "")),
            incident=incident, opened=int(d.get("opened", 0)), touched=int(d.get("touched", 0)),
            id=_finding_id(d["id"]),
        )


@dataclass
class FindingBook:
    policy: Policy
    entries: dict[str, Entry] = field(default_factory=dict)
    streaks: dict[str, list[int]] = field(default_factory=dict)  # condition key -> [bad, good]
    acks: dict[str, str] = field(default_factory=dict)  # condition key -> cleared signature
    survivors: set[str] = field(default_factory=set)  # reboot-class conditions open at the last reboot
    tallies: dict[str, Tally] = field(default_factory=dict)  # signal key -> its rule's tally
    observation: int = 0  # the classifier's current observation (set by it; stamps opened/touched)
    next_id: int = 1  # the id the next finding opened gets (saved: ids are never reused)
    boot_time: float | None = None  # the node's boot on the decision clock (set by the classifier)

    def new_id(self) -> int:
        """A finding id no finding of this state has had: a new finding never takes the key of
        one the effects remember (a cleared one, one already reported)."""
        self.next_id = max(self.next_id, 1 + max((e.id for e in self.entries.values()), default=0))
        given, self.next_id = self.next_id, self.next_id + 1
        return given

    # -- signals ----------------------------------------------------------------------------------

    def apply(self, signal: Signal, now: float) -> None:
        if not self.policy.enabled(signal.code) or (signal.bad and self.in_grace(signal.code, now)):
            return
        if signal.kind == CONDITION:
            self._condition(signal, now)
        elif signal.bad:
            self._event(signal, now)
        else:
            self.opens(signal.code, signal.key, now, present=False)

    def in_grace(self, code: str, t: float) -> bool:
        """The code's signal at ``t`` is ignored: it falls in its rule's grace after the boot."""
        return in_grace(self.policy.rule(code), t, self.boot_time)

    def opens(self, code: str, key: str, t: float, present: bool = True, occurrences: int = 1) -> bool:
        """Note one reading of ``key``'s raw signal under its code's rule (``debounce.step``);
        True when a finding may open now. An open finding is refreshed whatever this says."""
        rule = self.policy.rule(code)
        if rule.at_once:
            return present
        tally, opens = step(rule, self.tallies.get(key, EMPTY), t, present, occurrences)
        if tally == EMPTY:
            self.tallies.pop(key, None)
        else:
            self.tallies[key] = tally
        return opens

    def _event(self, signal: Signal, t: float) -> None:
        opens = self.opens(signal.code, signal.key, t, occurrences=signal.occurrences)
        entry = self.entries.get(signal.key)
        if entry is None:
            if opens:
                self.entries[signal.key] = self._new_entry(signal, t)
            return
        self._refresh(entry, signal, t)

    def _refresh(self, entry: Entry, signal: Signal, t: float) -> None:
        """An open finding's signal came again: the newest words, the worst action, a later time."""
        entry.action = Action.most_severe([entry.action, signal.action])
        entry.summary, entry.evidence, entry.next_steps = signal.summary, signal.evidence, signal.next_steps
        entry.last_seen = max(entry.last_seen, t)
        entry.count += signal.count
        entry.quiet_seconds = signal.quiet_seconds
        entry.touched = self.observation

    def _condition(self, signal: Signal, now: float) -> None:
        key = signal.key
        streak = self.streaks.setdefault(key, [0, 0])
        if not signal.bad:
            self.opens(signal.code, key, now, present=False)
            streak[0], streak[1] = 0, streak[1] + 1
            self.acks.pop(key, None)
            self.survivors.discard(key)
            entry = self.entries.get(key)
            if entry is not None and not entry.sticky and streak[1] >= self.policy.condition_clear_evaluations:
                del self.entries[key]
            return
        if key in self.acks:
            if self.acks[key] == signal.signature:
                return  # an operator cleared exactly this; it has not changed since
            del self.acks[key]
        streak[0], streak[1] = streak[0] + 1, 0
        if key in self.survivors and signal.action is Action.REBOOT_NODE:
            signal = _escalated(signal)
        opens = self.opens(signal.code, key, now)
        entry = self.entries.get(key)
        if entry is not None:
            self._refresh(entry, signal, now)
            entry.count = streak[0]
            entry.signature = signal.signature
            return
        if not opens:
            return
        entry = self._new_entry(signal, now)
        entry.count = streak[0]
        self.entries[key] = entry

    def _new_entry(self, signal: Signal, t: float) -> Entry:
        return Entry(
            code=signal.code, action=signal.action, summary=signal.summary, evidence=signal.evidence,
            next_steps=signal.next_steps, where=signal.where, first_seen=t, last_seen=t,
            kind=signal.kind, quiet_seconds=signal.quiet_seconds, count=signal.count,
            signature=signal.signature, opened=self.observation, touched=self.observation,
            id=self.new_id(),
        )

    # -- life cycle -------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Drop events below reboot_node that have been quiet longer than their window."""
        for key in [k for k, e in self.entries.items()
                    if e.kind == EVENT and not e.sticky and now - e.last_seen > e.quiet_seconds]:
            del self.entries[key]

    def on_reboot(self) -> int:
        """The boot id changed: everything below replace_node is resolved by the reboot.

        Reboot-class conditions are remembered: if the same one is raised again in the new boot,
        the reboot did not fix it and it comes back as replace_node.
        """
        closed = [k for k, e in self.entries.items() if e.action is not Action.REPLACE_NODE]
        self.survivors = {k for k in closed
                          if self.entries[k].kind == CONDITION and self.entries[k].action is Action.REBOOT_NODE}
        for key in closed:
            del self.entries[key]
        self.streaks.clear()
        self.tallies.clear()  # a run or a count does not carry over a reboot
        return len(closed)

    def on_gpu_replaced(self, pci_bus_id: str) -> int:
        """The GPU at this PCI id has a new UUID: every finding about the old one is closed."""
        keys = [k for k, e in self.entries.items() if e.where.pci_bus_id == pci_bus_id]
        for key in keys:
            del self.entries[key]
        suffix = f"/{pci_bus_id}"
        for table in (self.streaks, self.acks, self.tallies):
            for key in [k for k in table if k.endswith(suffix)]:
                del table[key]
        self.survivors = {k for k in self.survivors if not k.endswith(suffix)}
        return len(keys)

    def on_gpu_reset(self, pci_bus_id: str) -> int:
        """NVML showed the GPU at this PCI id reset (``GpuSample.reset``): the events on it that a
        reset answers (``reset_gpu`` and milder: restart_app, monitor) are closed, which lifts
        their device quarantine. Conditions judge their own next reading (a remap pending clears
        by itself once applied); a reboot- or replace-class finding is not a reset's to close."""
        keys = [k for k, e in self.entries.items() if e.where.pci_bus_id == pci_bus_id and e.kind == EVENT
                and e.action.severity <= Action.RESET_GPU.severity]
        for key in keys:
            del self.entries[key]
        return len(keys)

    def clear(self, now: float, as_of: int | None = None,
              reopen_incident: "Callable[[Entry, int], Entry | None] | None" = None) -> int:
        """An operator's clear of what was open at observation ``as_of`` (None: everything open
        now); returns how many findings it closed. Conditions stay quiet until they change.

        A finding opened after ``as_of`` stays. An event refreshed after it is closed and comes
        back as a new finding with a key of its own (an XID incident: ``reopen_incident(entry,
        as_of)``, the XIDs that joined after the clear; any other event: its latest recurrence),
        so the effects, which keep the cleared keys, see a new fault and act on it.
        """
        self.expire(now)
        kept: dict[str, Entry] = {}
        closed = 0
        for key, entry in self.entries.items():
            if as_of is not None and entry.opened > as_of:
                kept[key] = entry
                continue
            closed += 1
            if entry.kind == CONDITION:
                self.acks[key] = entry.signature
            elif as_of is not None and entry.touched > as_of:
                fresh = (reopen_incident(entry, as_of) if entry.incident is not None and reopen_incident
                         else _recurrence(entry))
                if fresh is not None:
                    fresh.id = self.new_id()
                    kept[incident_key(key, fresh.id) if fresh.incident is not None else key] = fresh
        self.entries = kept
        self.streaks = {k: v for k, v in self.streaks.items() if k in kept}
        # The tallies stay: a clear closes findings, not what was seen (a signal that keeps coming
        # opens a new finding at its next occurrence, as one opened at once always did).
        self.survivors.clear()
        return closed

    def fill_uuid(self, pci_bus_id: str, uuid: str) -> None:
        """A finding raised before its GPU's UUID was known learns it (replacement needs it)."""
        for entry in self.entries.values():
            if entry.where.pci_bus_id == pci_bus_id and not entry.where.uuid:
                entry.where = Where(entry.where.gpu_index, pci_bus_id, uuid, entry.where.fabric_device)

    def findings(self, now: float) -> list[Finding]:
        self.expire(now)
        return [e.finding() for e in self.entries.values() if e.action is not Action.NONE]

    def matching(self, code: str, subject: str) -> Iterable[tuple[str, Entry]]:
        return ((k, e) for k, e in self.entries.items() if e.code == code and e.where.subject == subject)

    # -- state ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "entries": {k: e.to_dict() for k, e in self.entries.items()},
            "streaks": {k: list(v) for k, v in self.streaks.items()},
            "acks": dict(self.acks),
            "survivors": sorted(self.survivors),
            "tallies": {k: t.to_dict() for k, t in self.tallies.items()},
            "next_id": self.next_id,
        }

    @classmethod
    def from_dict(cls, policy: Policy, d: dict[str, Any], problems: list[str] | None = None) -> "FindingBook":
        """As ``to_dict`` wrote it, item by item: an item that cannot be read (garbage, a field an
        agent of another version wrote differently) is left out and described in ``problems``;
        the others are kept, so one bad entry cannot take the open findings beside it along."""
        problems = [] if problems is None else problems
        return cls(
            policy=policy,
            entries=_items(d.get("entries", {}), Entry.from_dict, problems),
            streaks=_items(d.get("streaks", {}), lambda v: [int(v[0]), int(v[1])], problems),
            acks=_items(d.get("acks", {}), as_text, problems),
            survivors=set(_items(_listed(d.get("survivors", []), problems), as_text, problems)),
            tallies=_items(d.get("tallies", {}), Tally.from_dict, problems),
            next_id=_next_id(d.get("next_id"), problems),
        )


def _listed(raw: Any, problems: list[str]) -> dict[str, Any]:
    if not isinstance(raw, list):
        problems.append(f"book: {type(raw).__name__} where a list belongs")
        return {}
    return {str(item): item for item in raw}


def _items(raw: Any, read: Callable[[Any], Any], problems: list[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        problems.append(f"book: {type(raw).__name__} where a mapping belongs")
        return {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            out[str(key)] = read(value)
        except Exception as exc:  # this item is dropped; the rest of the book is kept
            problems.append(f"book item {str(key)[:60]}: {exc!r}"[:120])
    return out


def as_text(value: Any) -> str:
    """``value`` when it is text; TypeError otherwise (a saved field is never turned into text)."""
    if not isinstance(value, str):
        raise TypeError(f"{type(value).__name__} is not text")
    return value


def _recurrence(entry: Entry) -> Entry:
    """An event that recurred after an operator's clear, as a new finding: it starts at its latest
    recurrence (the only one known to be after the clear)."""
    return replace(entry, first_seen=entry.last_seen, count=1, opened=entry.touched)


def incident_key(key: str, finding_id: int) -> str:
    """The book key of an XID incident: its code and subject, and the id of its finding (several
    incidents of one code can be open on one GPU)."""
    return f"{key.rsplit('/', 1)[0]}/{finding_id}"


def _finding_id(value: Any) -> int:
    """A saved finding id: a positive integer, nothing else (a float or text is no id)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"finding id {value!r} is not a positive integer")
    return value


def _next_id(value: Any, problems: list[str]) -> int:
    """The saved next id, or 1 (``new_id`` never gives one an open finding holds)."""
    if value is None:
        return 1
    try:
        return _finding_id(value)
    except ValueError as exc:
        problems.append(f"book: {exc}"[:120])
        return 1


def _escalated(signal: Signal) -> Signal:
    return replace(
        signal, action=Action.REPLACE_NODE,
        summary=f"{signal.summary}; it came back after a reboot, so the node must be replaced",
    )
