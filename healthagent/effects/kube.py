"""Node effects: reconcile the agent's own node to the verdict through the ``kubernetes`` client.

``NodeEffects(settings, api_client, state)`` is driven by the loop's effects thread: ``startup``
once, then ``reconcile(verdict, now, boot_id)`` when the verdict changes, ``on_change`` fires or
``KubeStatus.due_at`` comes (a grace's end), and every few seconds anyway; ``close()`` at shutdown.
Neither raises: API errors are counted and logged, the desired state is kept (``pending_writes``:
how much is not on the node yet) for the next reconcile. ``api_client=None`` is ``--kube dry-run``:
the same decisions, logged one line per intended write, with no network (and no watch).

The node as last seen is a cache kept current by ONE watch on the agent's own node
(``effects/node_watch.py``, started by ``startup``): operator actions and foreign changes arrive
as they happen, and one that touches what the agent owns or the clear annotation calls
``on_change`` so the loop reconciles at once. In steady state that is zero writes, zero reads and
one open watch. While the watch is down, the effects read the node before a step that may write
(a new verdict, a grace's end or a budget look due, a write that failed) and at least every
``resync_seconds``; a write carries ``test`` preconditions on what it replaces (a conflict).

One reconcile is one sequence, read -> step -> budget exchange -> write -> settle (``NodeEffects``).

What the verdict could not see (``Verdict.unobserved``) is never taken for health: an area
unobserved says ``Unknown`` (``GpuNotObserved``, ``NetworkNotObserved``), the health label ``unknown``,
and a reboot taint stays while its subsystem is unobserved (a driver that stopped answering is no
recovery). Nothing is ever tainted because of it, and the budget is not asked.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from typing import Any, Callable

from healthagent.config import Settings
from healthagent.effects.backend import (
    DEFAULT_REQUEST_TIMEOUT,
    ApiBackend,
    ApiError,
    ApiRejected,
    ApiUnavailable,
    DryRunBackend,
    split_api_conditions,
)
from healthagent.effects.budget_guard import BudgetGuard, GuardState
from healthagent.effects.budget_leases import LeaseStore, agent_namespace
from healthagent.effects.budget_reclaim import Evidence
from healthagent.effects.conditions import identify, vocabulary
from healthagent.effects.device_slot import Want, device_exchange
from healthagent.effects.events import EventLedger, EventSpec
from healthagent.effects.driver_state import DriverState
from healthagent.effects.node_desired import NO_EXECUTE, owned_taints, owned_view
from healthagent.effects.node_watch import BACKOFF_SECONDS, WATCH_TIMEOUT_SECONDS, NodeCache, NodeWatch
from healthagent.effects.node_writer import NodeWriter
from healthagent.effects.plan import Budget, NodePlan, PlanSettings, clear_request
from healthagent.effects.record import STATE_KEY, EffectsState, saved_part
from healthagent.effects.stage import node_side
from healthagent.effects.worker import verdict_signature
from healthagent.effects.step import (BUDGET_WORDS, CONFIRM, LATER, TAKE, WARNING, Note, Step, StepContext, due_at,
                                      observe, plan_for, report_findings, step)
from healthagent.model import KubeStatus, SourceHealth, Verdict
from healthagent.common import ErrorTally

log = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0  # with the watch down or off: re-read the node this often (operator actions)
BUDGET_RECHECK_SECONDS = 30.0  # while over budget, look for a free slot this often (+-50% jitter, stretching)
MAX_ATTEMPTS = 6  # writes per object per reconcile before giving up until the next one


class NodeEffects:
    """Taint, labels, conditions and Events of the agent's own node (``settings.node_name``).

    The driver of the pure ``effects/step.py``. One reconcile, in this order:

    1. **read**: the node from the watch cache, else a GET (the module text); queue an Event for each finding
       not reported yet or escalated.
    2. **step**: the pure ``effects/step.py`` ``step``, exactly once, against that node, with what
       the budget guard knows without asking (a slot held, a rollback). It returns the plan, the
       state once the plan lands, and the one budget exchange the plan needs with the plan to write
       under each answer. A node's first NoSchedule needs none: it is written first (a burst of
       faults cordons every node before any budget traffic) and the sequence runs again at once.
    3. **the budget exchange** the step asked for, at most one: ``take`` a slot (a disruptive step
       ahead and no slot: a Lease write) or ``confirm`` the slot held (right before the disruptive
       step: a guarded re-write). The reclaim inside a take judges a stale slot from reads done
       before it (``effects/budget_reclaim.py``). The answer selects the plan to write.
    4. **write**: the node PATCH at most once (a slot's write older than ``CONFIRM_MARGIN_SECONDS``
       by then: not sent), then the ``/status`` PATCH. A conflict ends the reconcile with the fresh
       node the conflict carried and calls ``on_change``: the next reconcile starts again at 1.
    5. **settle**: the slot in step with the node as written (given back when no longer wanted;
       re-written once after a take, so a reclaim that read it before the taint landed fails: found
       reclaimed, the node goes back to held NoSchedule on the next reconcile, called at once).

    Then the queued Events are delivered and the state saved. All of it is one frozen
    ``DriverState`` (``effects/driver_state.py``: the record, the ledger, the budget's knowledge,
    the read and write bookkeeping), replaced once per reconcile. The attributes are wiring set at
    construction (``on_change`` by the loop's effects worker, before the first reconcile):
    ``BudgetGuard`` answers the exchange, ``NodeWriter`` writes, ``NodeWatch`` keeps the cache."""

    # a device NoExecute holds the node's slot (set by ``dra/budget.py``; ``effects/device_slot.py``)
    device_slot: Callable[[], bool] = staticmethod(lambda: False)

    def __init__(
        self,
        settings: Settings,
        api_client: Any,
        state: Any,
        *,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        request_timeout: tuple[float, float] = DEFAULT_REQUEST_TIMEOUT,
        resync_seconds: float = RESYNC_SECONDS,
        budget_recheck_seconds: float = BUDGET_RECHECK_SECONDS,
        max_attempts: int = MAX_ATTEMPTS,
        on_change: Callable[[], None] | None = None,
        watch: bool = True,
        watch_timeout_seconds: tuple[int, int] = WATCH_TIMEOUT_SECONDS,
        watch_backoff: tuple[float, float] = BACKOFF_SECONDS,
    ) -> None:
        """``on_change`` (also settable later, by the loop's effects worker) is called from a watch
        thread when a reconcile must look (the node changed, a budget slot freed), and from a
        reconcile that leaves the next one due at once (a conflict, a rollback); it must only
        wake the caller. ``watch=False`` keeps the read-on-a-timer behaviour of both watches
        (tests that drive time through ``now`` and count every request use it). ``max_attempts``:
        conflicts in a row before the effects wait for the next timed reconcile."""
        self.settings = settings
        if not settings.node_name:  # in a pod the hostname is the pod's name: never guess the node
            raise ValueError("NodeEffects acts on one node: settings.node_name must name it")
        self.node_name = settings.node_name
        self.state = state
        saved = state.get(STATE_KEY)
        self.dry_run = api_client is None
        self._tally = ErrorTally("kube")
        rng = rng or random.Random()
        if self.dry_run:
            self.mode = "dry-run"
            self.backend: Any = DryRunBackend(self.node_name, saved_part(saved, "dry_run_node", dict, None))
        else:
            self.mode = settings.kube if settings.kube in ("in-cluster", "kubeconfig") else "in-cluster"
            identify(api_client)  # the field manager of what the agent writes: "healthagent"
            self.backend = ApiBackend(api_client, self.node_name, request_timeout)
        self.resync_seconds = resync_seconds
        self.on_change = on_change
        self._plan_settings = PlanSettings(settings.taint_key, settings.replace_noexecute_grace_seconds,
                                           settings.hyperpod_labels, settings.reboot_node_noexecute,
                                           settings.condition_vocabulary, settings.foreign_condition_quiet_seconds)
        self._vocabulary = vocabulary(settings.condition_vocabulary)
        self._limits = (f"budget_max_fraction={settings.budget_max_fraction} "
                        f"budget_max_nodes={settings.budget_max_nodes}")
        leases = None if self.dry_run else LeaseStore(self.backend, agent_namespace(settings.budget_namespace))
        self.budget = BudgetGuard(
            leases, node_name=self.node_name, evidence=Evidence.of(settings), wake=self._changed, watch=watch,
            selector=settings.budget_node_selector, max_fraction=settings.budget_max_fraction,
            max_nodes=settings.budget_max_nodes, recheck_seconds=budget_recheck_seconds, tally=self._tally,
            rng=rng, scope_label=settings.budget_scope_label, grace_seconds=settings.replace_noexecute_grace_seconds,
            state=lambda: self._state.budget)
        self.writer = NodeWriter(self.backend, node_name=self.node_name, tally=self._tally, sleep=sleep, rng=rng,
                                 max_attempts=max_attempts, dry_run=self.dry_run)
        self._cache = NodeCache()
        self._watch: NodeWatch | None = None
        if watch and not self.dry_run:
            self._watch = NodeWatch(
                self.backend, self._cache, owned=self._owned_view, on_change=self._changed,
                tally=self._tally, rng=random.Random(rng.random()),
                timeout_seconds=watch_timeout_seconds, backoff=watch_backoff)
        self._state = DriverState(
            record=EffectsState.from_state(saved), budget=self.budget.initial(), reachable=self.dry_run,
            ledger=EventLedger(saved_part(saved, "emitted", dict, {}), saved_part(saved, "outbox", list, [])))

    # -- the two entry points ----------------------------------------------------------------------

    def startup(self, now: float, boot_id: str, wall: float | None = None) -> KubeStatus:
        """Read the node (the watch's LIST), start the watch, adopt what the node records, deliver
        queued Events. Writes nothing to the node: the first reconcile (right after the loop's
        first cycle) does, with a verdict in hand. ``now`` and ``wall``: as for ``reconcile``."""
        self._run(lambda s: self._startup(s, now, boot_id, now if wall is None else wall))
        return self.status()

    def reconcile(self, verdict: Verdict, now: float, boot_id: str,
                  health: "tuple[SourceHealth, ...] | list[SourceHealth]" = (), wall: float | None = None) -> KubeStatus:
        """Bring the node to the verdict, in the order the module text gives. Never raises.
        ``health``: the sources' latest health, whose detail says in an ``Unknown`` condition why
        a subsystem could not be observed.

        ``now`` is the decision clock (``clock.py``), which never jumps: the grace, the resync and
        the budget's back-offs are measured on it. ``wall`` is the wall time written for people
        and the API server (``timeAdded``, condition and Event times, Lease times); None: the
        caller has one clock."""
        self._run(lambda s: self._reconcile(s, verdict, tuple(health), now, now if wall is None else wall, boot_id))
        return self.status()

    def close(self) -> None:
        """Stop the watches (the loop's shutdown). The effects stay usable, reading on a timer."""
        if self._watch is not None:
            self._watch.stop()
        self.budget.close()

    @property
    def record(self) -> EffectsState:
        """What the effects know that the node cannot tell, as of the last reconcile."""
        return self._state.record

    @property
    def ledger(self) -> EventLedger:
        """The Events delivered and queued, as of the last reconcile."""
        return self._state.ledger

    @property
    def watching(self) -> bool:
        """Is the watch on the node live (the cache as fresh as a read)?"""
        return self._watch is not None and self._watch.live

    @property
    def budget_recheck_at(self) -> float | None:  # held at NoSchedule: the next look for a slot (jittered)
        return self._state.budget.recheck_at

    @property
    def node(self) -> dict | None:
        """The node as last seen (watch, read or write reply); read-only."""
        return self._cache.get()

    @property
    def node_watch(self) -> NodeWatch | None:  # None in dry-run or with ``watch=False``
        return self._watch

    @property
    def errors(self) -> dict[str, int]:
        """Cumulative internal errors by kind: what someone must fix (``rejected_403``,
        ``internal``, ``watch_bad_event``, ...). The API server's own condition is ``api_errors``."""
        return split_api_conditions(self._tally.snapshot())[0]

    @property
    def api_errors(self) -> dict[str, int]:
        """Cumulative API conditions by kind (``unavailable``, ``node_not_found``,
        ``budget_count_failed``, ``watch_expired``, ...): see ``model.API_CONDITION_KINDS``."""
        return split_api_conditions(self._tally.snapshot())[1]

    def _changed(self) -> None:
        if (callback := self.on_change) is not None:
            callback()

    def _owned_view(self, node: dict | None) -> tuple:
        return owned_view(node, self.settings.taint_key, self.settings.hyperpod_labels, self._vocabulary)

    def _run(self, change: Callable[[DriverState], DriverState]) -> None:
        """Replace the state with ``change``'s result, once, and save it. A bug must not stop the
        effects thread: the state the call started from is kept (read the node again next time)
        and the error counted."""
        try:
            after = change(self._state)
        except Exception:
            after = replace(self._state, dirty=True)
            self._tally.count("internal", "effects step failed (see the traceback)")
            log.exception("effects internal error node=%s", self.node_name)
        self._state = after
        self._save(after)

    def _startup(self, s: DriverState, now: float, boot_id: str, wall: float) -> DriverState:
        s = replace(s, record=self._booted(s.record, boot_id))
        try:
            if self._watch is not None:
                node, version = self.backend.list_own_node()
                if node is None:
                    raise ApiRejected(404, "NotFound", f"node {self.node_name} is not in the node list")
                node = self._seen(node)
                self._start_watch(version)
            else:
                node = self._seen(self.backend.read_node())
        except ApiError as exc:
            self._start_watch()  # it lists by itself once the API server answers
            return self._failed(s, exc)
        s = replace(s, reachable=True, last_read=now)
        record, events, notes = observe(s.record, node, s.verdict, now, wall, self._context(s))
        s = self._said(replace(s, record=record), events, notes)
        s = replace(s, budget=self.budget.startup(s.budget, node, now, wall), dirty=False)
        return self._deliver_events(s, now)

    def _reconcile(self, s: DriverState, verdict: Verdict, health: tuple[SourceHealth, ...], now: float,
                   wall: float, boot_id: str) -> DriverState:
        self._start_watch()  # a no-op after ``startup``
        due = due_at(s.record, self.settings.replace_noexecute_grace_seconds, s.budget.recheck_at)
        # nothing new to act on: a node as fresh as the resync interval is enough to step against
        quiet = (s.verdict is not None and verdict_signature(s.verdict) == verdict_signature(verdict)
                 and (due is None or now < due))
        s = replace(s, verdict=verdict, health=health, record=self._booted(s.record, boot_id))
        record, specs, notes = report_findings(s.record, verdict.findings, wall, self.node_name)
        s = self._said(replace(s, record=record), specs, notes)
        return self._deliver_events(self._sequence(s, now, wall, quiet), now)

    # -- the sequence: read, step, the budget exchange, write, settle ------------------------------

    def _sequence(self, s: DriverState, now: float, wall: float, quiet: bool, cordoned: bool = False) -> DriverState:
        """Read, step, exchange, write, settle; a node's first NoSchedule lands before the budget is
        asked, then the sequence runs once more (``cordoned``), against the write's reply."""
        try:
            node, s = self._read(s, now, quiet)
        except ApiError as exc:
            return self._unwritten(self._failed(s, exc), now, wall)
        guard = self.budget.begin(s.budget)
        known = (Budget.ROLLBACK if s.record.rollback else
                 Budget.ALLOWS if self.budget.held(guard) else Budget.UNASKED)
        planned = step(s.record, s.verdict, node, known, now, wall, self._context(s))
        guard, answer = self._exchange(planned.exchange, guard, node, now, wall)
        chosen = planned.under(answer).told(guard.note)
        s = self._said(replace(s, record=chosen.observed, budget=guard), chosen.noticed, ())
        try:
            s, node, landed = self._write(s, node, chosen, now)
        except ApiError as exc:
            self._log(chosen.seen_notes)
            if isinstance(exc, ApiUnavailable) and s.record.taint is not None and chosen.state.taint is None:
                s = self._said(replace(s, record=replace(s.record, removing=True)), chosen.events, ())  # may land
            return self._unwritten(self._failed(s, exc), now, wall)
        if not landed:
            self._log(chosen.seen_notes)
            return s
        s = self._settle(s, node, chosen.plan, now, wall)
        return self._sequence(s, now, wall, True, cordoned=True) if planned.exchange == LATER and not cordoned else s

    def _read(self, s: DriverState, now: float, quiet: bool) -> tuple[dict, DriverState]:
        """The node to step against: the cache while the watch is live and nothing failed; with
        the watch down, the cache only while nothing new is to be acted on (``quiet``: the same
        verdict, no grace's end or budget look due) and the last read is younger than
        ``resync_seconds`` (a steady state costs no request); else a GET, so that a step that may
        write sees what operators did meanwhile."""
        node = self._cache.get()
        if node is not None and not s.dirty:
            if self.watching:
                return node, replace(s, last_read=now)  # the watch keeps the cache as fresh as a read
            if quiet and not self._resync_due(s, now):
                return node, s
        node = self._seen(self.backend.read_node())
        return node, replace(s, reachable=True, last_read=now)

    def _exchange(self, exchange: str, guard: GuardState, node: dict, now: float,
                  wall: float) -> tuple[GuardState, Budget]:
        """The one budget exchange the step asked for (none: the step's own answer stands)."""
        if exchange == TAKE:
            return self.budget.ask(guard, now, wall, node)
        if exchange == CONFIRM:
            return self.budget.confirm(guard, now, wall)
        return guard, Budget.FIRST if exchange == LATER else Budget.ALLOWS

    def _write(self, s: DriverState, node: dict, chosen: Step, now: float) -> tuple[DriverState, dict, bool]:
        """PATCH the node once, then its status (a first NoSchedule alone): (the state, the node
        after, whether the node write landed and the status write did not fail). A conflict or a
        stale confirm leaves the next reconcile due at once."""
        plan = chosen.plan
        if plan.node_patch is not None and not self.budget.confirm_fresh(s.budget):
            log.warning("effects node=%s budget=confirm_stale: the slot is confirmed again before the write",
                        self.node_name)
            self._changed()
            return replace(s, dirty=True, pending=plan.writes), node, False
        s = replace(s, budget=self.budget.confirm_used(s.budget))
        written = self.writer.write_node(node, plan, s.conflicts)
        if not written.landed:  # a conflict: the node changed under the write
            s = replace(s, conflicts=s.conflicts + 1, pending=plan.writes)
            if written.node is not None:
                self._cache.offer(written.node)
                s = replace(s, dirty=False, last_read=now)
            else:
                s = replace(s, dirty=True)
            if s.conflicts >= self.writer.max_attempts:
                self.writer.gave_up()
                return replace(s, conflicts=0), node, False
            self._changed()
            return s, node, False
        assert written.node is not None
        node = written.node
        s = self._said(replace(s, record=chosen.state, conflicts=0, reachable=True,
                               last_read=now if plan.node_patch is not None else s.last_read),  # the reply is the node
                       chosen.events, ())
        self._log(chosen.notes)
        self._cache.offer(node)
        if chosen.exchange == LATER:  # the cordon alone: the conditions go with the budget's answer, at once
            return replace(s, dirty=False, pending=0), node, True
        node, status_ok = self.writer.write_status(node, plan)
        self._cache.offer(node)
        return replace(s, dirty=not status_ok, pending=int(not status_ok)), node, True

    def _settle(self, s: DriverState, node: dict, plan: NodePlan, now: float, wall: float) -> DriverState:
        """The budget slot in step with the node as written (no request when it already is; kept
        for a device NoExecute, ``device_slot``); a slot found reclaimed sends the node back to held
        NoSchedule on the next reconcile, at once."""
        guard, lost = self.budget.settle(s.budget, node, now, wall, plan.wants_slot, self.device_slot())
        s = replace(s, budget=guard)
        if lost:
            self._changed()
            return replace(s, record=replace(s.record, rollback=True), dirty=True)
        return s

    def _resync_due(self, s: DriverState, now: float) -> bool:
        # the decision clock never goes back; an injected one might: read now, not once it catches up
        return s.last_read is None or not 0 <= now - s.last_read < self.resync_seconds

    # -- small parts -------------------------------------------------------------------------------

    def _seen(self, node: Any) -> dict:
        if not isinstance(node, dict) or not isinstance(node.get("metadata"), dict):
            raise ApiUnavailable("the node reply is not a Node object")
        self._cache.offer(node)
        return node

    def _start_watch(self, listed_version: str = "") -> None:
        if self._watch is not None and not self._watch.started:
            self._watch.start(listed_version)

    def _context(self, s: DriverState) -> StepContext:
        # the budget's words come with its answer, after the step (``Step.told``)
        return StepContext(self.node_name, self._plan_settings, self._vocabulary, s.health, BUDGET_WORDS,
                           self._limits)

    def _said(self, s: DriverState, events: "tuple[EventSpec, ...] | list[EventSpec]",
              notes: "tuple[Note, ...]") -> DriverState:
        """Queue Events and log notes."""
        self._log(notes)
        return replace(s, ledger=s.ledger.want(events))

    @staticmethod
    def _log(notes: "tuple[Note, ...]") -> None:
        for note in notes:
            log.log(logging.WARNING if note.level == WARNING else logging.INFO, "%s", note.text)

    def device_exchange(self, want: Want, now: float, wall: float | None = None) -> bool:
        """A device NoExecute's budget exchange (``effects/device_slot.py``) on this driver's state:
        one slot, one state, whichever path disrupts."""
        answer = [False]

        def change(s: DriverState) -> DriverState:
            guard, answer[0] = device_exchange(self.budget, s.budget, self._cache.get(), want, now,
                                               now if wall is None else wall)
            return replace(s, budget=guard)
        self._run(change)
        return answer[0]

    def _deliver_events(self, s: DriverState, now: float) -> DriverState:
        ledger, answered, error = self.writer.deliver_events(s.ledger, s.record.node_uid, now)
        s = replace(s, ledger=ledger, reachable=s.reachable or answered)
        return self._failed(s, error) if error is not None else s

    def _failed(self, s: DriverState, exc: ApiError) -> DriverState:
        s = replace(s, dirty=True)
        if isinstance(exc, ApiRejected) and exc.status == 404:
            self._tally.count("node_not_found", f"node={self.node_name} is not in the cluster ({exc}); "
                                                "desired state kept until it is")
            # no Node, no taint: its budget slot goes back
            return replace(s, reachable=True, budget=self.budget.node_gone(s.budget))
        if isinstance(exc, ApiRejected):
            self._tally.count(f"rejected_{exc.status}", f"node={self.node_name} {exc}")
            return replace(s, reachable=True)
        self._tally.count("unavailable", f"node={self.node_name} API server unavailable ({exc}); "
                                         "desired state kept")
        return replace(s, reachable=False)

    def _unwritten(self, s: DriverState, now: float, wall: float) -> DriverState:
        """How many node writes the desired state still needs (the API server could not say)."""
        node = self._cache.get()
        if node is None:
            return replace(s, pending=1)
        answer = Budget.ALLOWS if self.budget.held(s.budget) else Budget.HOLDS
        return replace(s, pending=plan_for(s.record, s.verdict, node, answer, now, wall, self._context(s)).writes)

    def _booted(self, record: EffectsState, boot_id: str) -> EffectsState:
        if boot_id and boot_id != record.boot_id:
            if record.boot_id:
                log.info("effects node=%s boot changed %s -> %s", self.node_name, record.boot_id, boot_id)
            return replace(record, boot_id=boot_id)
        return record

    def pending_clear(self) -> str:
        """An operator's clear on the node as last seen (watch, read or write reply) that the agent
        has not handled yet: the ``healthagent.io/clear`` token, or "". Any thread: the loop
        reads it into the ``Collection``, and policy decides what it closes."""
        node = self._cache.get()
        clear = clear_request(node) if node is not None else None
        return clear.token if clear is not None else ""

    def _save(self, s: DriverState) -> None:
        self.state.put(STATE_KEY, s.record.to_state({  # the ledger's "emitted" and "outbox"
            **s.ledger.to_state(), "dry_run_node": self.backend.node if self.dry_run else None}))
        self.state.flush()

    def status(self) -> KubeStatus:
        s = self._state
        node = self._cache.get() or {}
        effects = {t.get("effect") for t in owned_taints(node, self.settings.taint_key)}
        effect = NO_EXECUTE if NO_EXECUTE in effects else (next(iter(effects)) if effects else "")
        return KubeStatus(
            mode=self.mode, reachable=s.reachable, taint_effect=effect,
            budget_blocked=s.record.budget_blocked, budget_blocked_total=s.record.budget_blocked_total,
            writes=dict(self.writer.writes), pending_writes=s.pending + len(s.ledger.outbox),
            clear_pending=self.pending_clear() or s.record.clear_to_write,
            watching=self.watching, api_errors=self.api_errors, **self.budget.figures(),
            **vars(node_side(node, self.budget.evidence)),
            conditions_owned_elsewhere=sum(not w.released for w in s.record.foreign),
            due_at=due_at(s.record, self.settings.replace_noexecute_grace_seconds, s.budget.recheck_at))
