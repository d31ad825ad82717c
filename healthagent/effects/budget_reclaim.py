"""Which held budget slot may be taken back: the reclaim rule, judged by the holder, never by its clock.

Any node's credentials can write a slot in its own name (the admission policy refuses any other
name), so a slot says only who claims it. Whether the claim still stands is judged here, from
what this agent sees, in this order:

1. **One slot a node.** A node takes its disruptive step under one slot; the agent never takes a
   second. A holder named by several slots keeps its lowest index; every other slot in its name
   is a duplicate (a forged claim, or a bug), judged at once with no request.
2. **Young slots are not judged.** A slot this agent has seen unchanged for less than
   ``SLOT_GRACE_SECONDS`` of its own decision clock may be a decision in flight: the slot is
   taken a moment before the holder's taint lands.
3. **The holder's Node decides** (one GET, done before the judgement: ``holder_verdict`` is
   pure): the slot is stale when the Node is gone, is not in the slot's pool (a scoped budget:
   the Node's value of the scope label, as the API server has it, differs from the budget's; a
   slot says nothing trustworthy about its holder's pool, any node can write any pool's slot),
   carries no taint of the agent's, or has carried the taint for longer than the disruptive
   step's grace (``replace_noexecute_grace_seconds``) plus ``SLOT_GRACE_SECONDS`` without
   showing a disruptive step: a holder whose agent stopped after its ``NoSchedule``, or a node
   that tainted itself to squat on a slot.

What counts as a disruptive step is ``Evidence``, the one rule the remediation stage uses too:
the agent's ``NoExecute`` (it evicts the node's pods, whoever wrote it: a node that puts it on
itself is out, one node of the limit), HyperPod's ``UnschedulablePending*`` only where the agent
asks HyperPod (``hyperpod_labels``), and a gated vocabulary's condition ``False`` only in the
vocabulary the agent writes. Elsewhere no engine reads those marks, and a node's own credentials
can write both about itself: a squat dressed up as a repair request is still a squat.

What a stale slot becomes depends on where it lies. Only a slot under the limit lets its holder
take the disruptive step (at most ``limit`` such Leases exist, which is what keeps the budget
exact under a race), so a stale slot under the limit is *taken over* (the judging node holds it
instead) when that keeps the nodes holding slots within the limit: one holder for another, or a
duplicate's place while fewer nodes than the limit hold slots. A stale slot past the limit (a
limit that shrank, a squatter's spare) grants nothing, but its holder still counts against the
limit: it is *cleared* (taken, then given back at once; the admission policy lets a node give
back only a Lease in its own name).

The times a holder wrote (``renewTime``, ``acquireTime``) are never used: they are another node's
clock, or a forged value ("renewTime 2099"). Ages come from when this agent first saw the slot
at its current ``resourceVersion``, which only the API server assigns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

from healthagent.effects.budget import FLEET, SLOT_GRACE_SECONDS, BudgetView, Scope, Slot
from healthagent.effects.conditions import vocabulary
from healthagent.effects.hyperpod import HYPERPOD_HEALTH_LABEL, HYPERPOD_PENDING_REBOOT, HYPERPOD_PENDING_REPLACEMENT
from healthagent.effects.node_desired import annotations_of, carries_no_execute, labels_of, owned_taints

# A device NoExecute of the agent's (healthagent/dra) on one of the node's GPUs: the node shows it
# here, by the devices' names. It is the holder's disruptive step as the node's NoExecute is.
DEVICE_NO_EXECUTE_ANNOTATION = "healthagent.io/device-noexecute"
LIVE_HOLDER_SECONDS = 300.0  # a holder seen taking its disruptive step is not looked at again for this long


class EngineSettings(Protocol):
    """The settings that say which engines the agent hands nodes to."""

    taint_key: str
    hyperpod_labels: bool
    condition_vocabulary: str


@dataclass(frozen=True)
class Evidence:
    """Which marks on a node show a disruptive step, for the engines this agent is configured
    for (the fleet shares one configuration): the agent's ``NoExecute`` under ``taint_key``
    always; HyperPod's pending value only with ``hyperpod``; a condition ``False`` only for the
    ``gated_types`` of the vocabulary the agent writes (none in a vocabulary no engine acts on)."""

    taint_key: str
    hyperpod: bool = False
    gated_types: frozenset[str] = frozenset()

    @classmethod
    def of(cls, settings: "EngineSettings") -> "Evidence":
        """From the agent's ``Settings`` (or a plan's ``PlanSettings``)."""
        vocab = vocabulary(settings.condition_vocabulary)
        return cls(settings.taint_key, settings.hyperpod_labels, frozenset(vocab.types) if vocab.gated else frozenset())

    def hyperpod_requested(self, node: Mapping) -> bool:
        """Does ``node`` ask HyperPod to reboot or replace it, with HyperPod in use?"""
        return self.hyperpod and labels_of(node).get(HYPERPOD_HEALTH_LABEL) in (HYPERPOD_PENDING_REPLACEMENT,
                                                                                HYPERPOD_PENDING_REBOOT)

    def repair_requested(self, node: Mapping) -> bool:
        """Does ``node`` carry a gated condition ``False`` that the configured engine repairs on?"""
        conditions = (node.get("status") or {}).get("conditions") or []
        return any(isinstance(c, Mapping) and c.get("type") in self.gated_types and c.get("status") == "False"
                   for c in conditions)


@dataclass(frozen=True)
class Reclaim:
    """A slot to take back, why (in words, for the log line), and whether the judging node keeps
    it (``grant``: a slot under the limit) or gives it back at once (a slot past the limit)."""

    slot: Slot
    why: str
    grant: bool


def duplicate_slots(view: BudgetView) -> list[Slot]:
    """Every slot whose holder holds a lower-indexed one too (``view.slots`` is in index order)."""
    seen: set[str] = set()
    extra = []
    for slot in view.held:
        if slot.holder in seen:
            extra.append(slot)
        seen.add(slot.holder)
    return extra


def shows_disruptive_step(node: Mapping, evidence: Evidence) -> bool:
    """Does ``node`` show a disruptive step that takes it out (``Evidence``)?"""
    return carries_no_execute(node, evidence.taint_key) or evidence.hyperpod_requested(node) or \
        evidence.repair_requested(node) or evicts_a_device(node)


def evicts_a_device(node: Mapping) -> bool:
    """Does ``node`` show a device NoExecute of the agent's (``DEVICE_NO_EXECUTE_ANNOTATION``)?"""
    return bool(annotations_of(node).get(DEVICE_NO_EXECUTE_ANNOTATION))


def in_pool(node: Mapping, scope: Scope) -> bool:
    """Is ``node`` one of the nodes ``scope`` counts, by its own label as the API server has it
    (the fleet's budget counts every node; a scoped one the nodes with its value, "" the nodes
    without the label)?"""
    return scope.of(node) == scope


def holder_verdict(holder: Mapping | None, seen_for: float, evidence: Evidence, grace_seconds: float,
                   scope: Scope = FLEET) -> str:
    """Why the slot of ``holder`` (its Node as just read, None when gone) is stale, or "" while it
    stands: the whole judgement of a holder, from what the API server says of its Node.
    ``seen_for``: how long this agent has seen the slot unchanged."""
    if holder is None:
        return "its node is gone"
    if not in_pool(holder, scope):
        found = labels_of(holder).get(scope.label)
        return (f"its node is not in this budget's pool {scope.label}={scope.value!r} "
                f"(its label says {found!r})")
    if not owned_taints(holder, evidence.taint_key) and not evicts_a_device(holder):
        return "its node carries no taint of the agent's"
    if seen_for >= grace_seconds + SLOT_GRACE_SECONDS and not shows_disruptive_step(holder, evidence):
        return (f"its node has held the slot for {seen_for:.0f} s, past the {grace_seconds:.0f} s grace, "
                "without taking a disruptive step")
    return ""


def stands_until(holder: Mapping | None, seen_for: float, evidence: Evidence, grace_seconds: float,
                 now: float) -> float:
    """Until when a holder judged standing is not read again: a while, but never past the moment
    its grace (and the slot grace) could end without a disruptive step."""
    until = now + LIVE_HOLDER_SECONDS
    if holder is not None and not shows_disruptive_step(holder, evidence):
        until = min(until, max(now, now + grace_seconds + SLOT_GRACE_SECONDS - seen_for))
    return until


@dataclass(frozen=True)
class ReclaimMemory:
    """What this agent saw of the held slots, on its decision clock: when it first saw each at its
    current version, and which holders it found standing (until when). A value, part of the
    budget guard's state (``effects/driver_state.py``): a look returns a new one."""

    first_seen: tuple[tuple[str, str, float], ...] = ()  # (slot, version, since)
    live: tuple[tuple[str, str, float], ...] = ()  # (slot, version, until): its holder stood

    def seen(self, slot: Slot) -> tuple[str, float] | None:
        return next(((v, t) for name, v, t in self.first_seen if name == slot.name), None)

    def stood(self, slot: Slot) -> tuple[str, float]:
        return next(((v, t) for name, v, t in self.live if name == slot.name), ("", 0.0))


class Reclaimer:
    """The reclaim rule for one node: its wiring only (what it judges lives in ``ReclaimMemory``)."""

    def __init__(self, node_name: str, evidence: Evidence, grace_seconds: float, rng: random.Random) -> None:
        self._node = node_name
        self._evidence = evidence
        self._grace = grace_seconds
        self._rng = rng

    def note(self, memory: ReclaimMemory, view: BudgetView, now: float) -> ReclaimMemory:
        """Remember when each held slot was first seen at its current version."""
        seen = []
        for slot in view.held:
            version, since = memory.seen(slot) or ("", now)
            seen.append((slot.name, slot.version, since if version == slot.version else now))
        return ReclaimMemory(tuple(seen), memory.live)

    def age(self, memory: ReclaimMemory, slot: Slot, now: float) -> float:
        """How long this agent has seen ``slot`` unchanged (0 when it has not seen it before)."""
        version, since = memory.seen(slot) or ("", now)
        return max(0.0, now - since) if version == slot.version else 0.0

    def pick(self, memory: ReclaimMemory, view: BudgetView, now: float,
             read_node: Callable[[str], Mapping | None],
             scope: Scope = FLEET) -> tuple[ReclaimMemory, Reclaim | None]:
        """One slot of ``scope``'s budget to take back, most useful first: a duplicate under the
        limit (no request), one old-enough slot whose holder's Node (one ``read_node``) says it is
        stale, a duplicate past the limit; None when every holder stands, or taking a slot would
        put more nodes than the limit past NoSchedule."""
        holders = len(view.holders)
        duplicates = [s for s in self._shuffled(duplicate_slots(view)) if s.holder != self._node]
        why_duplicate = "its holder holds a lower slot too (one slot a node)"
        for slot in duplicates:
            if slot.index < view.limit and holders < view.limit:
                return memory, Reclaim(slot, why_duplicate, grant=True)
        memory, judged = self._judge(memory, view, now, read_node, holders, scope)
        if judged is not None:
            return memory, judged
        spare = [s for s in duplicates if s.index >= view.limit]
        return memory, (Reclaim(spare[0], why_duplicate, grant=False) if spare else None)

    def _judge(self, memory: ReclaimMemory, view: BudgetView, now: float,
               read_node: Callable[[str], Mapping | None], holders: int,
               scope: Scope) -> tuple[ReclaimMemory, Reclaim | None]:
        """One old-enough slot: its holder's Node read first (one GET), then ``holder_verdict``
        judges from that read."""
        candidates = [s for s in view.held if s.holder != self._node and not self._stood(memory, s, now)
                      and self.age(memory, s, now) >= SLOT_GRACE_SECONDS
                      and (s.index >= view.limit or holders <= view.limit)]
        if not candidates:
            return memory, None
        under = [s for s in candidates if s.index < view.limit]  # a slot to hold, before one to clear
        slot = self._rng.choice(under or candidates)
        seen_for = self.age(memory, slot, now)
        holder = read_node(slot.holder)
        why = holder_verdict(holder, seen_for, self._evidence, self._grace, scope)
        if why:
            return memory, Reclaim(slot, why, grant=slot.index < view.limit)
        until = stands_until(holder, seen_for, self._evidence, self._grace, now)
        live = tuple(item for item in memory.live if item[0] != slot.name) + ((slot.name, slot.version, until),)
        return ReclaimMemory(memory.first_seen, live), None

    def _shuffled(self, slots: list[Slot]) -> list[Slot]:
        return self._rng.sample(slots, len(slots))

    def next_judgement(self, memory: ReclaimMemory, view: BudgetView, now: float) -> float | None:
        """When a slot of ``view`` held by another node can next be judged (it comes of age, or
        its holder's standing runs out), if later than ``now``: a held node looks again then,
        so a leaked or forged slot is taken back as soon as the rule allows, not at the end of
        a stretched re-check interval."""
        times = []
        for slot in view.held:
            if slot.holder == self._node or slot.index >= view.limit:
                continue
            version, until = memory.stood(slot)
            times.append(until if version == slot.version and now < until
                         else now - self.age(memory, slot, now) + SLOT_GRACE_SECONDS)
        later = [t for t in times if t > now]
        return min(later) if later else None

    def _stood(self, memory: ReclaimMemory, slot: Slot, now: float) -> bool:
        version, until = memory.stood(slot)
        return version == slot.version and now < until
