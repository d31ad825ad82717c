"""The disruption budget as the effects ask it: hold a slot for the disruptive step, give it back after.

``effects/budget.py`` holds the rule and the shape of the slots (pure); ``effects/budget_leases.py``
the calls. This module runs the protocol for one node and keeps its timing:

- ``holds_slot``: whether this node holds a slot, as last read or written (no request).
- ``ask`` (while the node holds no slot and its plan has a disruptive step ahead, at most once per
  reconcile): ALLOWS when a slot is taken now; HOLDS when every slot is held, or the budget could
  not be read (fail closed): the node is held at NoSchedule. A held node looks again after a
  jittered interval that stretches while it stays held (``recheck_interval``), or within
  ``FREED_SPREAD_SECONDS`` of a slot coming free (``effects/budget_watch.py`` wakes it).
- ``confirm`` (right before the disruptive step): a guarded re-write of the slot, which starts
  every judge's clock again; ``confirm_fresh`` (right before its node write, which carries a
  server-side deadline): a confirm grown older than ``CONFIRM_MARGIN_SECONDS`` is made again.
- ``slot_lost`` (right after the first node write that lands with a new slot): re-write the slot,
  so that a reclaim which judged it stale before the node's taint landed fails; True when the slot
  was reclaimed meanwhile, and the node goes back to held NoSchedule.
- ``settle`` (after every reconcile that left the node as planned): give the slot back when the
  plan wants none any more (no agent taint: healed, cleared; or no disruptive step left), finish
  a re-write that failed. Nothing of this asks the API server in a steady state.
- ``startup``: which slot this node holds (a restart forgets it), a slot for a NoExecute already
  on the node without one (its Lease deleted by hand) if one is free.

The limit comes from the count Lease that only the budget counter writes (``budget_counter.py``);
the agent reads it in the same list as the slots and never counts nodes itself, so a decision
costs the same at 100 nodes and at 10,000.

In dry-run there is no cluster view: every question allows and nothing is written.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Callable

from healthagent.common import ErrorTally
from healthagent.effects.backend import AlreadyExists, ApiError, ApiRejected, ApiUnavailable, Conflict
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
from healthagent.effects.budget_reclaim import Evidence, Reclaimer
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


class BudgetGuard:
    """May this node take its disruptive step (does it hold a slot), and the slot's upkeep."""

    def __init__(self, leases: LeaseStore | None, *, node_name: str, evidence: Evidence, selector: str,
                 max_fraction: float, max_nodes: int | None, recheck_seconds: float, tally: ErrorTally,
                 rng: random.Random, grace_seconds: float, scope_label: str = "",
                 wake: Callable[[], None] | None = None, watch: bool = True) -> None:
        """``leases`` None: dry-run (no cluster view). ``scope_label``: count the budget per value
        of this node label (``Scope``; its value is read from the node at ``startup``).
        ``grace_seconds``: the grace before a disruptive step, which a holder may not pass
        without taking it, and ``evidence`` what shows that step (``effects/budget_reclaim.py``).
        ``wake``: called from the budget's watch thread when a slot frees while the node is held
        (``watch=False``: no watch, the timed looks only)."""
        self._store = leases
        self.scope = Scope(scope_label)
        self._scope_read = False  # the node's value of the scope label is read (startup, else ask)
        self._node = node_name
        self.evidence = evidence
        self._taint_key = evidence.taint_key
        self._selector = selector
        self._fraction = max_fraction
        self._max_nodes = max_nodes
        self._recheck_seconds = recheck_seconds
        self._tally = tally
        self._rng = rng
        self.slot: Slot | None = None  # the slot this node holds, as last read or written
        self._memo: Budget | None = None  # this reconcile's answer
        self.recheck_at: float | None = None  # held (or a NoExecute without a slot): no look before
        self._holds = 0  # looks in a row that found no slot
        self._renew_due = False  # a slot taken (or its re-write failed): re-write it once the node write lands
        self._upkeep_at: float | None = None  # a failed release/re-write/count: not before this
        self._reclaim = Reclaimer(node_name, evidence, grace_seconds, rng)
        self._watch = SlotWatch(leases if watch else None, node_name=node_name, tally=tally, rng=random.Random(),
                                on_freed=wake)
        self._last_view: BudgetView | None = None
        self.wall_offset = 0.0  # wall time minus decision time in this step: Lease times are wall
        self.note = ""  # the last look in words, for the log and the Event
        self.clock: Callable[[], float] = time.monotonic  # when a confirm was made (``confirm_fresh``)
        self._confirmed_at: float | None = None

    @property
    def _counted(self) -> str:
        """The node selector of the GPU nodes this budget counts."""
        return self.scope.node_selector(self._selector)

    def begin(self) -> None:
        """A new reconcile: the next question looks again (unless a held node must wait)."""
        self._memo = None

    @property
    def holds_slot(self) -> bool:
        """Does this node hold a slot (as last read or written)? Always in dry-run, which has no
        cluster view and decides as if it did."""
        return self._store is None or self.slot is not None

    def startup(self, node: dict, now: float) -> None:
        """Which slot this node holds; a free one for a NoExecute of the agent's already on the
        node without one (it counts); then ``settle`` (a slot without a taint goes back). Never raises an API error: a failed look is counted and the first question
        looks again."""
        if self._store is None:
            return
        self.scope, self._scope_read = self.scope.of(node), True
        try:
            view = self._look(now)
            held = view.held_by(self._node)
            self.slot = held[0] if held else None
            # A slot held by a node without the agent's taint: the last run took it and stopped
            # before its node write landed. ``settle`` gives it back below; should that fail, the
            # slot is re-written after the first node write that lands, as for a slot just taken,
            # so a reclaim that judged it stale meanwhile cannot let a second node through.
            self._renew_due = self.slot is not None and not owned_taints(node, self._taint_key)
            if self.slot is None and carries_no_execute(node, self._taint_key):
                self._adopt(view, now)
        except ApiError as exc:
            self._failure(exc, f"cannot read the budget's Leases at start ({exc})")
            return
        self.settle(node, now, wants_slot=bool(owned_taints(node, self._taint_key)))

    def ask(self, now: float, node: dict | None = None) -> Budget:
        """ALLOWS or HOLDS for the node's disruptive step; ALLOWS means this node holds a slot.
        ``node``: its pool is read there when ``startup`` could not read the node."""
        if self._store is None:
            return Budget.ALLOWS
        if node is not None and not self._scope_read:
            self.scope, self._scope_read = self.scope.of(node), True
        if self._memo is not None:
            return self._memo
        if self.slot is not None:
            self._memo = Budget.ALLOWS
            return self._memo
        if self.recheck_at is not None and now < self.recheck_at:
            if self._watch.take_freed():  # a slot came free: look soon
                self.recheck_at = min(self.recheck_at, now + self._rng.uniform(0.0, FREED_SPREAD_SECONDS))
            return Budget.HOLDS
        try:
            slot = self._take(self._look(now), now)
        except ApiError as exc:
            self._failure(exc, f"cannot read or take a budget slot ({exc}); the node stays at NoSchedule")
            self.note = f"the budget's Leases could not be read or written ({exc})"
            self._memo = Budget.HOLDS
            return self._memo
        except Exception as exc:  # a Lease no parser foresaw: fail closed, never abort the node's write
            log.exception("effects node=%s budget=unreadable", self._node)
            self._tally.count("budget_unreadable", f"node={self._node} {exc!r}; the node stays at NoSchedule")
            self.note = f"the budget's Leases could not be understood ({exc!r})"
            self._memo = Budget.HOLDS
            return self._memo
        self._memo = self._answer(slot, now)
        self._renew_due = slot is not None
        return self._memo

    def confirm(self, now: float) -> Budget:
        """Right before a disruptive step: re-write this node's slot with the version read (a
        guarded update). A judge measures a slot's age from the last change it saw, so this write
        restarts every judge's clock: no reclaim can judge the slot stale within
        ``SLOT_GRACE_SECONDS`` of it, and the node write that follows lands within
        ``NODE_WRITE_DEADLINE_SECONDS`` or not at all (``effects/backend.py``). ALLOWS when the
        write lands; ROLLBACK when another node holds the slot now or it is gone (a reclaim, a
        peer's forged write: the node goes back to held NoSchedule and asks again); HOLDS when it
        cannot be read or written (the step waits, the slot is kept)."""
        if self._store is None or self.slot is None:
            return Budget.ALLOWS
        wall = self._wall(now)
        try:
            written, _ = self._write_own(self.slot, lambda lease: held_lease(lease, self._node, wall, acquired=False))
        except ApiError as exc:
            self._failure(exc, f"cannot confirm budget slot {self.slot.name} ({exc})")
            return Budget.HOLDS
        if written is not None and written.holder == self._node:
            self.slot, self._confirmed_at = written, self.clock()
            return Budget.ALLOWS
        log.warning("effects node=%s budget=slot_lost slot=%s: no disruptive step without a slot of its "
                    "own; back to NoSchedule", self._node, self.slot.name)
        self._tally.count("budget_slot_lost", f"node={self._node} slot {self.slot.name} is another node's or gone")
        self.slot, self._memo = None, None
        return Budget.ROLLBACK

    def confirm_fresh(self) -> bool:
        """Right before the node write: False when the confirm before it is older than
        ``CONFIRM_MARGIN_SECONDS`` (the caller confirms again instead of writing). Uses it up."""
        confirmed, self._confirmed_at = self._confirmed_at, None
        return confirmed is None or self.clock() - confirmed <= CONFIRM_MARGIN_SECONDS

    def slot_lost(self, now: float) -> bool:
        """Right after the first node write that landed with a new slot: re-write the slot (a
        reclaim that read it before fails now). True when it was reclaimed meanwhile: the node
        goes back to held NoSchedule. No request unless a re-write is due."""
        if self._store is None or self.slot is None or not self._renew_due:
            return False
        try:
            lost = self._renew(now)
        except ApiError as exc:
            # unknown, not kept: ``settle`` re-writes it at the next reconcile (``_renew_due`` stays)
            self._failure(exc, f"cannot re-write budget slot {self.slot.name} after the node write ({exc})")
            self._upkeep_at = None
            return False
        return lost and self._rolled_back(now)

    def settle(self, node: dict, now: float, wants_slot: bool) -> bool:
        """After a reconcile that left the node as planned: give the slot back when the plan wants
        none (``NodePlan.wants_slot``: no agent taint, or no disruptive step left), finish a
        re-write that failed. A steady state makes no request. True when
        that re-write finds the slot reclaimed: the node goes back to held NoSchedule, as with
        ``slot_lost``."""
        if self._store is None:
            return False
        keep = wants_slot and bool(owned_taints(node, self._taint_key))
        if not keep:
            self._watch.stop(0.0)  # no slot to wait for
        renew = keep and self._renew_due and self.slot is not None
        release = not keep and self.slot is not None
        if not (renew or release) or (self._upkeep_at is not None and now < self._upkeep_at):
            return False
        try:
            if renew:
                if self._renew(now):
                    return self._rolled_back(now)
            elif release:
                assert self.slot is not None
                self._release(self.slot)
        except ApiError as exc:
            # a re-write that failed leaves it unknown whether the slot is still this node's: the
            # next reconcile asks again; a give-back can wait
            self._upkeep_at = None if renew else now + self._delay()
            self._failure(exc, f"cannot keep the budget's Leases in step with the node ({exc})")
            return False
        except Exception as exc:  # a Lease or a reply no parser foresaw: try again later, never raise
            log.exception("effects node=%s budget=unreadable", self._node)
            self._upkeep_at = now + self._delay()
            self._tally.count("budget_unreadable", f"node={self._node} {exc!r}")
            return False
        self._upkeep_at = None
        return False

    def figures(self) -> dict[str, Any]:
        """The budget as last read, for the metrics: scope, limit and slots held (None before a
        look, and always in dry-run)."""
        view = self._last_view
        return {"budget_scope": self.scope.value if self.scope.label else "",
                "budget_limit": view.limit if view is not None else None,
                "budget_slots_held": len(view.holders) if view is not None else None}

    def close(self) -> None:
        """Stop waiting for a freed slot (the node got one or needs none, or the agent stops)."""
        self._watch.stop()

    def node_gone(self) -> None:
        """The Node object is gone, and with it any taint: give the slot back (best effort; if
        this fails, another agent reclaims it after a GET of the missing node)."""
        if self._store is None or self.slot is None:
            return
        try:
            self._release(self.slot)
        except ApiError as exc:
            self._failure(exc, f"cannot give back budget slot {self.slot.name} of a deleted node ({exc})")

    # -- the protocol --------------------------------------------------------------------------------

    def _look(self, now: float, consistent: bool = False) -> BudgetView:
        store = self._require_store()
        view = read_view(store.list(consistent, self.scope.lease_selector), self._counted, self._fraction,
                         self._max_nodes, self.scope)
        self._reclaim.note(view, now)
        self._last_view = view
        return view

    def _wall(self, now: float) -> float:
        """The wall time at decision time ``now``: what a Lease carries for people and peers."""
        return now + self.wall_offset

    def _take(self, view: BudgetView, now: float) -> Slot | None:
        """This node's slot: one it holds already, a free one, or a stale one reclaimed (after
        one GET of its holder's node at most); None when every slot is held by a live node."""
        store = self._require_store()
        judged, reclaim = False, None
        for _ in range(TAKE_ATTEMPTS):
            mine = view.held_by(self._node)
            if mine:
                return mine[0]
            if view.allows:
                reclaim = None
                index = self._rng.choice(view.free_indexes())
                existing = view.slot(index)
                base = existing.lease if existing is not None else new_lease(slot_name(index, self.scope),
                                                                             store.namespace, "slot", self.scope)
                body = held_lease(base, self._node, self._wall(now), acquired=True)
            else:
                reclaim = None if judged else self._reclaim.pick(view, now, store.node, self.scope)
                judged = True
                if reclaim is None:
                    self.note = view.describe()
                    return None
                log.warning("effects node=%s budget=%s slot=%s holder=%s: %s", self._node,
                            "reclaim" if reclaim.grant else "clear", reclaim.slot.name, reclaim.slot.holder,
                            reclaim.why)
                body = held_lease(reclaim.slot.lease, self._node, self._wall(now), acquired=True)
            try:
                written = store.create(body) if "resourceVersion" not in body["metadata"] else store.replace(body)
            except (Conflict, AlreadyExists):
                view = self._look(now, consistent=True)  # another node won that slot: look again
                continue
            if reclaim is not None and not reclaim.grant:  # past the limit: it grants nothing, give it back
                self._release(_slot(written, self.scope))
                view = self._look(now, consistent=True)
                reclaim = None
                continue
            self.note = view.describe()
            return _slot(written, self.scope)
        self.note = view.describe()
        return None

    def _rolled_back(self, now: float) -> bool:
        log.warning("effects node=%s budget=rollback: its slot was reclaimed before its taint landed; "
                    "back to NoSchedule", self._node)
        self.note = "its budget slot was reclaimed before its taint landed (rolled back to NoSchedule)"
        self._memo = Budget.HOLDS
        self._renew_due = False
        self._holds += 1
        self.recheck_at = now + self._delay()
        self._watch.follow(self.scope)  # held: hear of a slot coming free
        return True

    def _answer(self, slot: Slot | None, now: float) -> Budget:
        if slot is not None:
            self.slot, self._holds, self.recheck_at = slot, 0, None
            self._watch.stop(0.0)
            return Budget.ALLOWS
        self._watch.follow(self.scope)  # held: hear of a slot coming free
        self._holds += 1
        self.recheck_at = now + self._delay()
        judgement = self._reclaim.next_judgement(self._last_view, now) if self._last_view else None
        if judgement is not None and judgement < self.recheck_at:
            self.recheck_at = judgement + self._rng.uniform(0.0, 2.0)  # a leaked slot back as soon as it may
        return Budget.HOLDS

    def _renew(self, now: float) -> bool:
        """Re-write this node's slot. True when another node holds it now. A slot Lease deleted
        by hand is no slot: the next plan asks for another."""
        assert self.slot is not None
        wall = self._wall(now)
        self.slot, lost = self._write_own(self.slot, lambda lease: held_lease(lease, self._node, wall, acquired=False))
        self._renew_due = False
        return lost

    def _release(self, slot: Slot) -> None:
        """Give ``slot`` back (unless it is not this node's anymore)."""
        written, _ = self._write_own(slot, released_lease)
        if written is not None:
            log.info("effects node=%s budget=released slot=%s", self._node, slot.name)
        self.slot = None

    def _write_own(self, slot: Slot, change: Callable[[Any], dict]) -> tuple[Slot | None, bool]:
        """Write ``change`` of this node's ``slot`` with the version read; on a 409 read it again
        and, still this node's, write once more. (the slot written or None, whether another node
        holds it now); a Lease that is gone (404) is (None, False)."""
        store = self._require_store()
        for _ in range(2):
            try:
                return _slot(store.replace(change(slot.lease)), self.scope), False
            except Conflict:
                slot = _slot(store.read(slot.name), self.scope)
                if slot.holder != self._node:
                    return None, True
            except ApiRejected as exc:
                if exc.status != 404:
                    raise
                return None, False
        return None, False

    def _adopt(self, view: BudgetView, now: float) -> None:
        """The node carries the agent's NoExecute (its slot's Lease deleted by hand) but holds no
        slot: take one, so it counts. Never removes the taint: with every slot held it stands,
        the plan's questions look again later, and the budget holds other nodes' disruptive steps
        until holders are under the limit."""
        slot = self._take(view, now)
        if slot is None:
            log.warning("effects node=%s budget=over: the node carries the agent's NoExecute but no slot is "
                        "free (%s); the taint stays", self._node, self.note)
        self._answer(slot, now)

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

    def _delay(self) -> float:
        return recheck_delay(recheck_interval(self._recheck_seconds, max(1, self._holds)), self._rng)


def _slot(lease: Any, scope: Scope) -> Slot:
    """The slot a Lease reply describes."""
    view = read_view([lease] if isinstance(lease, dict) else [], "", 0.0, None, scope)
    if not view.slots:
        raise ApiUnavailable("the Lease reply is not a budget slot")
    return view.slots[0]
