"""The disruption budget as the effects ask it: hold a slot for the disruptive step, give it back after.

``effects/budget.py`` holds the rule and the shape of the slots (pure); ``effects/budget_leases.py``
the calls. This module runs the protocol for one node and keeps its timing:

- ``holds_slot``: whether this node holds a slot, as last read or written (no request).
- ``ask`` (the ``take`` exchange: the node holds no slot and its plan has a disruptive step
  ahead; at most once per reconcile): ALLOWS when a slot is written now (a take is a confirm);
  HOLDS when every slot is held, or the budget could not be read (fail closed): the node is held
  at NoSchedule. A held node looks again after a jittered interval that stretches while it stays
  held (``recheck_interval``), or within ``FREED_SPREAD_SECONDS`` of a slot coming free
  (``effects/budget_watch.py`` wakes it).
- ``confirm`` (the ``confirm`` exchange, right before the disruptive step): a guarded re-write of
  the slot, which starts every judge's clock again; ``confirm_fresh`` (right before the node
  write, which carries a server-side deadline): a slot write grown older than
  ``CONFIRM_MARGIN_SECONDS`` sends nothing, and the next reconcile confirms again.
- ``settle`` (after every reconcile that left the node as planned): give the slot back when the
  plan wants none any more (no agent taint: healed, cleared; or no disruptive step left); re-write
  a slot taken in this reconcile once the node's taint is on, so that a reclaim which judged it
  stale before the taint landed fails (found reclaimed meanwhile: the node goes back to held
  NoSchedule), and finish a re-write that failed. Nothing of this asks the API server in a
  steady state.
- ``startup``: which slot this node holds (a restart forgets it), a slot for a NoExecute already
  on the node without one (its Lease deleted by hand) if one is free.

The limit comes from the count Lease that only the budget counter writes (``budget_counter.py``);
the agent reads it in the same list as the slots and never counts nodes itself, so a decision
costs the same at 100 nodes and at 10,000.

What the guard knows (the slot held, the timing of its looks, what its judge saw of the others'
slots) is one frozen value, ``GuardState``, part of the effects' state (``effects/driver_state.py``):
each call takes the state and returns the next one; the guard keeps only its wiring (the Lease
store, the settings, the watch thread), and reads the driver's current state for the properties.

In dry-run there is no cluster view: every question allows and nothing is written.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from healthagent.common import ErrorTally
from healthagent.effects.backend import (NODE_WRITE_DEADLINE_SECONDS, AlreadyExists, ApiError, ApiRejected,
                                        ApiUnavailable, Conflict)
from healthagent.effects.budget import (
    BudgetView,
    Scope,
    Slot,
    held_lease,
    new_lease,
    read_view,
    recheck_delay,
    recheck_interval,
    released_lease,
    slot_name,
)
from healthagent.effects.budget_leases import LeaseStore
from healthagent.effects.budget_reclaim import Evidence, Reclaimer, ReclaimMemory, evicts_a_device
from healthagent.effects.budget_watch import SlotWatch
from healthagent.effects.node_desired import carries_no_execute, owned_taints
from healthagent.effects.plan import Budget

log = logging.getLogger(__name__)

TAKE_ATTEMPTS = 4  # writes for a slot per question; each 409 means another node took one
FREED_SPREAD_SECONDS = 1.0  # the held nodes that hear of a freed slot look within this, spread out
# A confirm older than this on the monotonic clock when its node write is about to go (the process
# stalled between them) is made again first: confirm + margin + the write's deadline (5 + 10 s)
# stays well inside the 45 s (SLOT_GRACE_SECONDS) a judge waits after the last change it saw.
CONFIRM_MARGIN_SECONDS = 5.0


@dataclass(frozen=True)
class GuardState:
    """What the budget guard knows, as one value (times on the decision clock, but
    ``confirmed_at``: the monotonic clock of ``BudgetGuard.clock``)."""

    scope: Scope = Scope()
    scope_read: bool = False  # the node's value of the scope label is read (startup, else ask)
    slot: Slot | None = None  # the slot this node holds, as last read or written
    memo: Budget | None = None  # this reconcile's answer
    recheck_at: float | None = None  # held (or a NoExecute without a slot): no look before
    holds: int = 0  # looks in a row that found no slot
    renew_due: bool = False  # a slot taken (or its re-write failed): re-write it once the node write lands
    upkeep_at: float | None = None  # a failed release/re-write/count: not before this
    last_view: BudgetView | None = None
    note: str = ""  # the last look in words, for the log and the Event
    confirmed_at: float | None = None  # when the slot was last written (``confirm_fresh``)
    reclaim: ReclaimMemory = ReclaimMemory()


class BudgetGuard:
    """May this node take its disruptive step (does it hold a slot), and the slot's upkeep."""

    def __init__(self, leases: LeaseStore | None, *, node_name: str, evidence: Evidence, selector: str,
                 max_fraction: float, max_nodes: int | None, recheck_seconds: float, tally: ErrorTally,
                 rng: random.Random, grace_seconds: float, scope_label: str = "",
                 wake: Callable[[], None] | None = None, watch: bool = True,
                 state: Callable[[], GuardState] | None = None) -> None:
        """``leases`` None: dry-run (no cluster view). ``scope_label``: count the budget per value
        of this node label (``Scope``; its value is read from the node at ``startup``).
        ``grace_seconds``: the grace before a disruptive step, which a holder may not pass
        without taking it, and ``evidence`` what shows that step (``effects/budget_reclaim.py``).
        ``wake``: called from the budget's watch thread when a slot frees while the node is held
        (``watch=False``: no watch, the timed looks only). ``state``: reads the owner's current
        ``GuardState`` (for the properties); None: ``initial()``."""
        self._store = leases
        self._node = node_name
        self.evidence = evidence
        self._taint_key = evidence.taint_key
        self._selector = selector
        self._fraction = max_fraction
        self._max_nodes = max_nodes
        self._recheck_seconds = recheck_seconds
        self._tally = tally
        self._rng = rng
        self._scope_label = scope_label
        self._reclaim = Reclaimer(node_name, evidence, grace_seconds, rng)
        self._watch = SlotWatch(leases if watch else None, node_name=node_name, tally=tally, rng=random.Random(),
                                on_freed=wake)
        self._state = state if state is not None else self.initial
        self.clock: Callable[[], float] = time.monotonic  # when a confirm was made (``confirm_fresh``)

    def initial(self) -> GuardState:
        """The state before the first look: no slot known."""
        return GuardState(scope=Scope(self._scope_label))

    # -- the current state, for people and the metrics (read-only) ---------------------------------

    @property
    def slot(self) -> Slot | None:
        return self._state().slot

    @property
    def scope(self) -> Scope:
        return self._state().scope

    @property
    def note(self) -> str:
        return self._state().note

    @property
    def recheck_at(self) -> float | None:
        return self._state().recheck_at

    @property
    def holds_slot(self) -> bool:
        """Does this node hold a slot (as last read or written)? Always in dry-run, which has no
        cluster view and decides as if it did."""
        return self.held(self._state())

    def held(self, g: GuardState) -> bool:
        return self._store is None or g.slot is not None

    def figures(self) -> dict[str, Any]:
        """The budget as last read, for the metrics: scope, limit and slots held (None before a
        look, and always in dry-run)."""
        g = self._state()
        view = g.last_view
        return {"budget_scope": g.scope.value if g.scope.label else "",
                "budget_limit": view.limit if view is not None else None,
                "budget_slots_held": len(view.holders) if view is not None else None}

    # -- the calls -----------------------------------------------------------------------------------

    def begin(self, g: GuardState) -> GuardState:
        """A new reconcile: the next question looks again (unless a held node must wait)."""
        return replace(g, memo=None)

    def startup(self, g: GuardState, node: dict, now: float, wall: float) -> GuardState:
        """Which slot this node holds; a free one for a NoExecute of the agent's already on the
        node without one (it counts); then ``settle`` (a slot without a taint goes back). Never
        raises an API error: a failed look is counted and the first question looks again."""
        if self._store is None:
            return g
        g = replace(g, scope=g.scope.of(node), scope_read=True)
        try:
            g, view = self._look(g, now)
            held = view.held_by(self._node)
            # A slot held by a node without the agent's taint: the last run took it and stopped
            # before its node write landed. ``settle`` gives it back, but not before that write's
            # server-side deadline has passed (it may still be queued at the API server, and would
            # land on a node whose slot is free); should the give-back fail, the slot is re-written
            # after the first node write that lands, as for a slot just taken, so a reclaim that
            # judged it stale meanwhile cannot let a second node through.
            slot = held[0] if held else None
            untainted = slot is not None and not owned_taints(node, self._taint_key)
            g = replace(g, slot=slot, renew_due=untainted,
                        upkeep_at=now + NODE_WRITE_DEADLINE_SECONDS + CONFIRM_MARGIN_SECONDS if untainted else None)
            if slot is None and carries_no_execute(node, self._taint_key):
                g = self._adopt(g, view, now, wall)
        except ApiError as exc:
            self._failure(exc, f"cannot read the budget's Leases at start ({exc})")
            return g
        g, _ = self.settle(g, node, now, wall, wants_slot=bool(owned_taints(node, self._taint_key))
                           or evicts_a_device(node))
        return g

    def ask(self, g: GuardState, now: float, wall: float, node: dict | None = None) -> tuple[GuardState, Budget]:
        """ALLOWS or HOLDS for the node's disruptive step; ALLOWS means this node holds a slot it
        has just written (a take is a confirm). ``node``: its pool is read there when ``startup``
        could not read the node."""
        if self._store is None:
            return g, Budget.ALLOWS
        if node is not None and not g.scope_read:
            g = replace(g, scope=g.scope.of(node), scope_read=True)
        if g.memo is not None:
            return g, g.memo
        if g.recheck_at is not None and now < g.recheck_at:
            if self._watch.take_freed():  # a slot came free: look soon
                g = replace(g, recheck_at=min(g.recheck_at, now + self._rng.uniform(0.0, FREED_SPREAD_SECONDS)))
            return g, Budget.HOLDS
        try:
            g, view = self._look(g, now)
            g, slot = self._take(g, view, now, wall)
        except ApiError as exc:
            self._failure(exc, f"cannot read or take a budget slot ({exc}); the node stays at NoSchedule")
            g = replace(g, note=f"the budget's Leases could not be read or written ({exc})", memo=Budget.HOLDS)
            return g, Budget.HOLDS
        except Exception as exc:  # a Lease no parser foresaw: fail closed, never abort the node's write
            log.exception("effects node=%s budget=unreadable", self._node)
            self._tally.count("budget_unreadable", f"node={self._node} {exc!r}; the node stays at NoSchedule")
            g = replace(g, note=f"the budget's Leases could not be understood ({exc!r})", memo=Budget.HOLDS)
            return g, Budget.HOLDS
        g = self._answer(g, slot, now)
        if slot is not None:
            g = replace(g, renew_due=True, confirmed_at=self.clock())
        g = replace(g, memo=Budget.ALLOWS if slot is not None else Budget.HOLDS)
        return g, g.memo

    def confirm(self, g: GuardState, now: float, wall: float) -> tuple[GuardState, Budget]:
        """Right before a disruptive step: re-write this node's slot with the version read (a
        guarded update). A judge measures a slot's age from the last change it saw, so this write
        restarts every judge's clock: no reclaim can judge the slot stale within
        ``SLOT_GRACE_SECONDS`` of it, and the node write that follows lands within
        ``NODE_WRITE_DEADLINE_SECONDS`` or not at all (``effects/backend.py``). ALLOWS when the
        write lands; ROLLBACK when another node holds the slot now or it is gone (a reclaim, a
        peer's forged write: the node goes back to held NoSchedule and asks again); HOLDS when it
        cannot be read or written (the step waits, the slot is kept)."""
        if self._store is None or g.slot is None:
            return g, Budget.ALLOWS
        slot = g.slot
        try:
            written, _ = self._write_own(g, slot, lambda lease: held_lease(lease, self._node, wall, acquired=False))
        except ApiError as exc:
            self._failure(exc, f"cannot confirm budget slot {slot.name} ({exc})")
            return g, Budget.HOLDS
        if written is not None and written.holder == self._node:
            return replace(g, slot=written, confirmed_at=self.clock()), Budget.ALLOWS
        log.warning("effects node=%s budget=slot_lost slot=%s: no disruptive step without a slot of its "
                    "own; back to NoSchedule", self._node, slot.name)
        self._tally.count("budget_slot_lost", f"node={self._node} slot {slot.name} is another node's or gone")
        return replace(g, slot=None, memo=None), Budget.ROLLBACK

    def confirm_fresh(self, g: GuardState) -> bool:
        """Right before the node write: False when the slot's last write (a take or a confirm) is
        older than ``CONFIRM_MARGIN_SECONDS`` (the write is not sent: the next reconcile confirms
        again). The caller uses it up afterwards (``confirm_used``)."""
        return g.confirmed_at is None or self.clock() - g.confirmed_at <= CONFIRM_MARGIN_SECONDS

    @staticmethod
    def confirm_used(g: GuardState) -> GuardState:
        return replace(g, confirmed_at=None)

    def settle(self, g: GuardState, node: dict, now: float, wall: float,
               wants_slot: bool, device_holds: bool = False) -> tuple[GuardState, bool]:
        """After a reconcile that left the node as planned: give the slot back when the plan wants
        none (``NodePlan.wants_slot``: no agent taint, or no disruptive step left), re-write a slot
        taken in this reconcile (a reclaim that read it before the node's taint landed fails now)
        or whose re-write failed. A steady state makes no request. True when that re-write finds
        the slot reclaimed: the node goes back to held NoSchedule."""
        if self._store is None:
            return g, False
        # a taint of the agent's, or a device NoExecute of its own (``effects/device_slot.py``: the
        # device path's word, or the Node's annotation), holds it; the node as cached may not show
        # the annotation written a moment ago, so the device path's word alone keeps the slot
        keep = device_holds or (wants_slot and (bool(owned_taints(node, self._taint_key)) or evicts_a_device(node)))
        if not keep:
            self._watch.stop(0.0)  # no slot to wait for
            if g.recheck_at is not None or g.holds:  # the held episode is over: a new fault looks at once
                g = replace(g, recheck_at=None, holds=0)
        renew = keep and g.renew_due and g.slot is not None
        release = not keep and g.slot is not None
        if not (renew or release) or (g.upkeep_at is not None and now < g.upkeep_at):
            return g, False
        try:
            if renew:
                g, lost = self._renew(g, wall)
                if lost:
                    return self._rolled_back(g, now), True
            elif release:
                assert g.slot is not None
                g = self._release(g, g.slot)
        except ApiError as exc:
            # a re-write that failed leaves it unknown whether the slot is still this node's: the
            # next reconcile asks again; a give-back can wait
            self._failure(exc, f"cannot keep the budget's Leases in step with the node ({exc})")
            return replace(g, upkeep_at=None if renew else now + self._delay(g.holds)), False
        except Exception as exc:  # a Lease or a reply no parser foresaw: try again later, never raise
            log.exception("effects node=%s budget=unreadable", self._node)
            self._tally.count("budget_unreadable", f"node={self._node} {exc!r}")
            return replace(g, upkeep_at=now + self._delay(g.holds)), False
        return replace(g, upkeep_at=None), False

    def close(self) -> None:
        """Stop waiting for a freed slot (the node got one or needs none, or the agent stops)."""
        self._watch.stop()

    def node_gone(self, g: GuardState) -> GuardState:
        """The Node object is gone, and with it any taint: give the slot back (best effort; if
        this fails, another agent reclaims it after a GET of the missing node)."""
        if self._store is None or g.slot is None:
            return g
        try:
            return self._release(g, g.slot)
        except ApiError as exc:
            self._failure(exc, f"cannot give back budget slot {g.slot.name} of a deleted node ({exc})")
            return g

    # -- the protocol --------------------------------------------------------------------------------

    def _look(self, g: GuardState, now: float, consistent: bool = False) -> tuple[GuardState, BudgetView]:
        store = self._require_store()
        view = read_view(store.list(consistent, g.scope.lease_selector), g.scope.node_selector(self._selector),
                         self._fraction, self._max_nodes, g.scope)
        return replace(g, reclaim=self._reclaim.note(g.reclaim, view, now), last_view=view), view

    def _take(self, g: GuardState, view: BudgetView, now: float, wall: float) -> tuple[GuardState, Slot | None]:
        """This node's slot, written now: one it holds already (re-written), a free one, or a
        stale one reclaimed (after one GET of its holder's node at most); None when every slot is
        held by a live node."""
        store = self._require_store()
        judged, reclaim, mine = False, None, []
        for _ in range(TAKE_ATTEMPTS):
            mine = view.held_by(self._node)
            if mine:
                reclaim = None
                body = held_lease(mine[0].lease, self._node, wall, acquired=False)
            elif view.allows:
                reclaim = None
                index = self._rng.choice(view.free_indexes())
                existing = view.slot(index)
                base = existing.lease if existing is not None else new_lease(slot_name(index, g.scope),
                                                                             store.namespace, "slot", g.scope)
                body = held_lease(base, self._node, wall, acquired=True)
            else:
                if not judged:
                    memory, reclaim = self._reclaim.pick(g.reclaim, view, now, store.node, g.scope)
                    g = replace(g, reclaim=memory)
                else:
                    reclaim = None
                judged = True
                if reclaim is None:
                    return replace(g, note=view.describe()), None
                log.warning("effects node=%s budget=%s slot=%s holder=%s: %s", self._node,
                            "reclaim" if reclaim.grant else "clear", reclaim.slot.name, reclaim.slot.holder,
                            reclaim.why)
                body = held_lease(reclaim.slot.lease, self._node, wall, acquired=True)
            try:
                written = store.create(body) if "resourceVersion" not in body["metadata"] else store.replace(body)
            except (Conflict, AlreadyExists):
                g, view = self._look(g, now, consistent=True)  # another node won that slot: look again
                continue
            if reclaim is not None and not reclaim.grant:  # past the limit: it grants nothing, give it back
                g = self._release(g, _slot(written, g.scope))
                g, view = self._look(g, now, consistent=True)
                reclaim = None
                continue
            return replace(g, note=view.describe()), _slot(written, g.scope)
        if mine:  # its own slot, whose every re-write conflicted: not a full budget, an unwritable one
            return replace(g, note=f"the budget's Leases could not be read or written (its own slot "
                                   f"{mine[0].name} conflicted {TAKE_ATTEMPTS} times)"), None
        return replace(g, note=view.describe()), None

    def _rolled_back(self, g: GuardState, now: float) -> GuardState:
        log.warning("effects node=%s budget=rollback: its slot was reclaimed before its taint landed; "
                    "back to NoSchedule", self._node)
        self._watch.follow(g.scope)  # held: hear of a slot coming free
        holds = g.holds + 1
        return replace(g, note="its budget slot was reclaimed before its taint landed (rolled back to NoSchedule)",
                       memo=Budget.HOLDS, renew_due=False, holds=holds, recheck_at=now + self._delay(holds))

    def _answer(self, g: GuardState, slot: Slot | None, now: float) -> GuardState:
        if slot is not None:
            self._watch.stop(0.0)
            return replace(g, slot=slot, holds=0, recheck_at=None)
        self._watch.follow(g.scope)  # held: hear of a slot coming free
        holds = g.holds + 1
        recheck_at = now + self._delay(holds)
        judgement = self._reclaim.next_judgement(g.reclaim, g.last_view, now) if g.last_view else None
        if judgement is not None and judgement < recheck_at:
            recheck_at = judgement + self._rng.uniform(0.0, 2.0)  # a leaked slot back as soon as it may
        return replace(g, holds=holds, recheck_at=recheck_at)

    def _renew(self, g: GuardState, wall: float) -> tuple[GuardState, bool]:
        """Re-write this node's slot. True when another node holds it now. A slot Lease deleted
        by hand is no slot: the next plan asks for another."""
        assert g.slot is not None
        slot, lost = self._write_own(g, g.slot, lambda lease: held_lease(lease, self._node, wall, acquired=False))
        return replace(g, slot=slot, renew_due=False), lost

    def _release(self, g: GuardState, slot: Slot) -> GuardState:
        """Give ``slot`` back (unless it is not this node's anymore)."""
        written, _ = self._write_own(g, slot, released_lease)
        if written is not None:
            log.info("effects node=%s budget=released slot=%s", self._node, slot.name)
        return replace(g, slot=None)

    def _write_own(self, g: GuardState, slot: Slot, change: Callable[[Any], dict]) -> tuple[Slot | None, bool]:
        """Write ``change`` of this node's ``slot`` with the version read; on a 409 read it again
        and, still this node's, write once more. (the slot written or None, whether another node
        holds it now); a Lease that is gone (404) is (None, False)."""
        store = self._require_store()
        for _ in range(2):
            try:
                return _slot(store.replace(change(slot.lease)), g.scope), False
            except Conflict:
                slot = _slot(store.read(slot.name), g.scope)
                if slot.holder != self._node:
                    return None, True
            except ApiRejected as exc:
                if exc.status != 404:
                    raise
                return None, False
        return None, False

    def _adopt(self, g: GuardState, view: BudgetView, now: float, wall: float) -> GuardState:
        """The node carries the agent's NoExecute (its slot's Lease deleted by hand) but holds no
        slot: take one, so it counts. Never removes the taint: with every slot held it stands,
        the plan's questions look again later, and the budget holds other nodes' disruptive steps
        until holders are under the limit."""
        g, slot = self._take(g, view, now, wall)
        if slot is None:
            log.warning("effects node=%s budget=over: the node carries the agent's NoExecute but no slot is "
                        "free (%s); the taint stays", self._node, g.note)
        return self._answer(g, slot, now)

    # -- small parts -----------------------------------------------------------------------------

    def _require_store(self) -> LeaseStore:
        assert self._store is not None, "no budget calls in dry-run"
        return self._store

    def _failure(self, exc: ApiError, message: str) -> None:
        """The API's condition when it did not answer; the setup's fault (``rejected_403``: no
        RBAC for leases, or the admission policy refused) when it refused."""
        if isinstance(exc, ApiRejected) and exc.status == 404 and self._store is not None:
            # a Lease write answered "not found": its namespace does not exist
            self._tally.count("rejected_404", f"node={self._node} {message}; is there a namespace "
                                              f"{self._store.namespace!r}? set budget_namespace to the one "
                                              "the agent runs in")
        elif isinstance(exc, ApiRejected):
            self._tally.count(f"rejected_{exc.status}", f"node={self._node} {message}")
        else:
            self._tally.count("budget_count_failed", message)

    def _delay(self, holds: int) -> float:
        return recheck_delay(recheck_interval(self._recheck_seconds, max(1, holds)), self._rng)


def _slot(lease: Any, scope: Scope) -> Slot:
    """The slot a Lease reply describes."""
    view = read_view([lease] if isinstance(lease, dict) else [], "", 0.0, None, scope)
    if not view.slots:
        raise ApiUnavailable("the Lease reply is not a budget slot")
    return view.slots[0]
