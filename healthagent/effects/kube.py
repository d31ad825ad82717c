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
one open watch. While the watch is down, the effects fall back to reading the node before
planning, at most every ``resync_seconds``; a conflict on a write always takes a fresh node.

One reconcile: queue an Event for each finding not reported yet or escalated; step against the
node (the cached one while the watch is live and nothing is pending, else a read); stop when the
plan needs no write (a steady state costs no request); otherwise ask the budget first when the
step needs it, write the node patch (``test`` operations pin what it replaces; a conflict -> the
fresh node, a new step, a retry with backoff), keep the landed state, re-write a new budget slot
(a reclaim meanwhile rolls the node back to held NoSchedule), write the conditions, settle the
slot; deliver the queued Events and save the state (drawn in docs/design.md).

What the verdict could not see (``Verdict.unobserved``) is never taken for health: an area
unobserved says ``Unknown`` (``GpuNotObserved``, ``NetworkNotObserved``), the health label ``unknown``,
and a reboot taint stays while its subsystem is unobserved (a driver that stopped answering is no
recovery). Nothing is ever tainted because of it, and the budget is not asked.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import replace
from typing import Any, Callable, Iterator

from healthagent.config import Settings
from healthagent.effects.backend import (
    DEFAULT_REQUEST_TIMEOUT,
    AlreadyExists,
    ApiBackend,
    ApiError,
    ApiRejected,
    ApiUnavailable,
    DryRunBackend,
    split_api_conditions,
)
from healthagent.effects.budget_guard import BudgetGuard
from healthagent.effects.budget_leases import LeaseStore, agent_namespace
from healthagent.effects.budget_reclaim import Evidence
from healthagent.effects.conditions import identify, vocabulary
from healthagent.effects.events import EVENTS_NAMESPACE, EventLedger, EventSpec, event_body
from healthagent.effects.node_desired import NO_EXECUTE, carries_no_execute, owned_taints, owned_view
from healthagent.effects.node_watch import BACKOFF_SECONDS, WATCH_TIMEOUT_SECONDS, NodeCache, NodeWatch
from healthagent.effects.node_writer import NodeWriter
from healthagent.effects.plan import Budget, NodePlan, PlanSettings, clear_request
from healthagent.effects.record import STATE_KEY, EffectsState, saved_part
from healthagent.effects.stage import node_side
from healthagent.effects.step import (
    WARNING,
    Note,
    Step,
    StepContext,
    asks_budget,
    due_at,
    observe,
    plan_for,
    report_findings,
    step,
)
from healthagent.model import KubeStatus, SourceHealth, Verdict
from healthagent.common import ErrorTally

log = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0  # with the watch down or off: re-read the node this often (operator actions)
BUDGET_RECHECK_SECONDS = 30.0  # while over budget, look for a free slot this often (+-50% jitter, stretching)
MAX_ATTEMPTS = 6  # writes per object per reconcile before giving up until the next one


class NodeEffects:
    """Taint, labels, conditions and Events of the agent's own node (``settings.node_name``).

    The driver of the pure ``effects/step.py``: it holds the ``EffectsState`` value (``record``)
    and replaces it whole with what a step returns, keeping the landed state only once the API
    server confirmed the write. The other parts, one job each: ``BudgetGuard`` answers the budget
    (asked before a write, when the step needs it), ``NodeWriter`` writes a plan, the
    ``NodeWatch`` keeps the node cache current."""

    device_slot: Callable[[], bool] = staticmethod(lambda: False)  # a device NoExecute holds the slot (dra/budget.py)
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
        thread when a reconcile must look (the node changed, a budget slot freed); it must only
        wake the caller. ``watch=False`` keeps the read-on-a-timer behaviour of both watches (tests
        that drive time through ``now`` and count every request use it)."""
        self.settings = settings
        if not settings.node_name:  # in a pod the hostname is the pod's name: never guess the node
            raise ValueError("NodeEffects acts on one node: settings.node_name must name it")
        self.node_name = settings.node_name
        self.state = state
        saved = state.get(STATE_KEY)
        self.record = EffectsState.from_state(saved)
        self.ledger = EventLedger(saved_part(saved, "emitted", dict, {}), saved_part(saved, "outbox", list, []))
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
        leases = None if self.dry_run else LeaseStore(self.backend, agent_namespace(settings.budget_namespace))
        self.budget = BudgetGuard(
            leases, node_name=self.node_name, evidence=Evidence.of(settings), wake=self._changed, watch=watch,
            selector=settings.budget_node_selector, max_fraction=settings.budget_max_fraction,
            max_nodes=settings.budget_max_nodes, recheck_seconds=budget_recheck_seconds, tally=self._tally,
            rng=rng, scope_label=settings.budget_scope_label, grace_seconds=settings.replace_noexecute_grace_seconds)
        self.writer = NodeWriter(self.backend, node_name=self.node_name, tally=self._tally, sleep=sleep, rng=rng,
                                 max_attempts=max_attempts, dry_run=self.dry_run)
        self._verdict: Verdict | None = None
        self._health: tuple[SourceHealth, ...] = ()
        self._cache = NodeCache()
        self._watch: NodeWatch | None = None
        if watch and not self.dry_run:
            self._watch = NodeWatch(
                self.backend, self._cache, owned=self._owned_view, on_change=self._changed,
                tally=self._tally, rng=random.Random(rng.random()),
                timeout_seconds=watch_timeout_seconds, backoff=watch_backoff)
        self._last_read: float | None = None
        self._dirty = True
        self._pending = 0
        self._reachable = self.dry_run
        self._wall_offset = 0.0  # this step's wall time minus its decision time (``_wall``)

    # -- the two entry points ----------------------------------------------------------------------

    def startup(self, now: float, boot_id: str, wall: float | None = None) -> KubeStatus:
        """Read the node (the watch's LIST), start the watch, adopt what the node records, deliver
        queued Events. Writes nothing to the node: the first reconcile (right after the loop's
        first cycle) does, with a verdict in hand. ``now`` and ``wall``: as for ``reconcile``."""
        self._set_wall(now, wall)
        with self._guarded():
            self._startup(now, boot_id)
        return self.status()

    def reconcile(self, verdict: Verdict, now: float, boot_id: str,
                  health: "tuple[SourceHealth, ...] | list[SourceHealth]" = (), wall: float | None = None) -> KubeStatus:
        """Bring the node to the verdict. Never raises. ``health``: the sources' latest health,
        whose detail says in an ``Unknown`` condition why a subsystem could not be observed.

        ``now`` is the decision clock (``clock.py``), which never jumps: the grace, the resync and
        the budget's back-offs are measured on it. ``wall`` is the wall time written for people
        and the API server (``timeAdded``, condition and Event times, Lease times); None: the
        caller has one clock."""
        self._set_wall(now, wall)
        with self._guarded():
            self._start_watch()  # a no-op after ``startup``
            self._note_boot(boot_id)
            self._verdict = verdict
            self._health = tuple(health)
            self.record, specs, notes = report_findings(self.record, verdict.findings, self._wall(now),
                                                        self.node_name)
            self._said(specs, notes)
            try:
                self._sync(now)
            except ApiError as exc:
                self._failed(exc)
                self._pending = self._pending_against_known(now)
            self._deliver_events(now)
        return self.status()

    def close(self) -> None:
        """Stop the watches (the loop's shutdown). The effects stay usable, reading on a timer."""
        if self._watch is not None:
            self._watch.stop()
        self.budget.close()

    @property
    def watching(self) -> bool:
        """Is the watch on the node live (the cache as fresh as a read)?"""
        return self._watch is not None and self._watch.live

    @property
    def budget_recheck_at(self) -> float | None:  # held at NoSchedule: the next look for a slot (jittered)
        return self.budget.recheck_at

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

    def _set_wall(self, now: float, wall: float | None) -> None:
        """Keep this step's wall time as an offset from its decision time (``_wall``)."""
        self._wall_offset = 0.0 if wall is None else wall - now
        self.budget.wall_offset = self._wall_offset

    def _wall(self, now: float) -> float:
        """The wall time at decision time ``now`` in this step."""
        return now + self._wall_offset

    def _changed(self) -> None:
        if (callback := self.on_change) is not None:
            callback()

    def _owned_view(self, node: dict | None) -> tuple:
        return owned_view(node, self.settings.taint_key, self.settings.hyperpod_labels, self._vocabulary)

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """Around each entry point: a bug must not stop the effects thread (the state is kept,
        the error counted); the record is saved after every step."""
        try:
            yield
        except Exception:
            self._dirty = True
            self._tally.count("internal", "effects step failed (see the traceback)")
            log.exception("effects internal error node=%s", self.node_name)
        self._save()

    def _startup(self, now: float, boot_id: str) -> None:
        self._note_boot(boot_id)
        try:
            node = self._list_read(now) if self._watch is not None else self._read(now)
        except ApiError as exc:
            self._failed(exc)
            self._start_watch()  # it lists by itself once the API server answers
            return
        self._observe(node, now)
        self.budget.startup(node, now)  # which budget slot this node holds (a restart forgets it)
        self._dirty = False
        self._deliver_events(now)

    # -- reading -----------------------------------------------------------------------------------

    def _read(self, now: float) -> dict:
        return self._seen(self.backend.read_node(), now)

    def _list_read(self, now: float) -> dict:
        """Read the node through the watch's LIST and start the watch from the list's version."""
        node, version = self.backend.list_own_node()
        if node is None:
            raise ApiRejected(404, "NotFound", f"node {self.node_name} is not in the node list")
        node = self._seen(node, now)
        self._start_watch(version)
        return node

    def _seen(self, node: Any, now: float) -> dict:
        if not isinstance(node, dict) or not isinstance(node.get("metadata"), dict):
            raise ApiUnavailable("the node reply is not a Node object")
        self._reachable = True
        self._cache.offer(node)
        self._last_read = now
        return node

    def _start_watch(self, listed_version: str = "") -> None:
        if self._watch is not None and not self._watch.started:
            self._watch.start(listed_version)

    # -- one step ---------------------------------------------------------------------------------

    def _context(self) -> StepContext:
        limits = (f"budget_max_fraction={self.settings.budget_max_fraction} "
                  f"budget_max_nodes={self.settings.budget_max_nodes}")
        return StepContext(self.node_name, self._plan_settings, self._vocabulary, self._health,
                           self.budget.note, limits)

    def _said(self, events: "tuple[EventSpec, ...] | list[EventSpec]", notes: "tuple[Note, ...]") -> None:
        """Queue a step's Events and log its notes."""
        self.ledger.want(events)
        for note in notes:
            log.log(logging.WARNING if note.level == WARNING else logging.INFO, "%s", note.text)

    def _observe(self, node: dict, now: float) -> None:
        """Keep what ``node`` tells (whether or not a write follows)."""
        self.record, events, notes = observe(self.record, node, self._verdict, now, self._wall(now),
                                             self._context())
        self._said(events, notes)

    def _budget_answer(self, node: dict, now: float) -> Budget:
        """The budget's answer for a step against ``node``: a question (Lease reads) only while the
        node holds no slot and the step's plan has a disruptive step ahead; fail closed."""
        if self.record.rollback:
            return Budget.ROLLBACK
        if self.budget.holds_slot:
            return Budget.ALLOWS
        if asks_budget(self.record, self._verdict, node, self._plan_settings):
            return self.budget.ask(now, node)
        return Budget.UNASKED

    def _step(self, node: dict, now: float, confirm: bool = True) -> Step:
        """Observe ``node``, ask the budget when the step needs it, then the pure step. A step to be
        written that newly takes the disruptive step confirms first that the slot is still its own."""
        self._observe(node, now)
        answer = self._budget_answer(node, now)
        planned = step(self.record, self._verdict, node, answer, now, self._wall(now), self._context())
        taint = planned.plan.taint
        if confirm and answer is Budget.ALLOWS and taint.disruptive_ready and planned.plan.writes and \
                not carries_no_execute(node, self.settings.taint_key):
            confirmed = self.budget.confirm(now)
            if confirmed is not Budget.ALLOWS:
                if confirmed is Budget.ROLLBACK:
                    self.record = replace(self.record, rollback=True)
                planned = step(self.record, self._verdict, node, confirmed, now, self._wall(now), self._context())
        return planned

    def _land(self, done: Step) -> None:
        """The step's plan is on the node: keep its state, queue its Events."""
        self.record = done.state
        self._said(done.events, done.notes)

    # -- writing -----------------------------------------------------------------------------------

    def _sync(self, now: float) -> None:
        self.budget.begin()
        node = self._cache.get()
        trusted = node is not None and not self._dirty and self.watching
        if trusted:
            self._last_read = now  # the watch keeps the cache as fresh as a read
        if not self._dirty and node is not None and not self._resync_due(now):
            planned = self._step(node, now, confirm=False)  # operators' acts arrived through the watch
            if planned.plan.writes == 0:
                self._land(planned)
                self._settle_budget(node, planned.plan, now)
                self._pending = 0
                return
        if not trusted:
            node = self._read(now)
        node, planned, done = self._write_node(node, now)
        plan, status_ok = planned.plan, False
        if done:  # conditions follow the node write (a pending clear must land first)
            self._land(planned)
            if plan.taint.taint is not None:
                node, plan = self._check_race(node, plan, now)
            node, status_ok = self.writer.write_status(node, plan)
        self._cache.offer(node)
        self._dirty = not (done and status_ok)
        self._pending = int(not done) + int(not status_ok)
        if done:
            self._settle_budget(node, plan, now)

    def _write_node(self, node: dict, now: float) -> tuple[dict, Step, bool]:
        """Step against ``node`` (the budget asked before the write, when the step needs it) and
        write until its plan lands; on a conflict, back off (the writer), take the fresh node (the
        conflict's, else a read) and step again, at most ``max_attempts`` times.
        (the node after, the step written, whether it landed)."""
        for attempt in range(self.writer.max_attempts):
            planned = self._step(node, now)
            written = self.writer.write_node(node, planned.plan, attempt, self.budget.confirm_fresh)
            if written.landed:
                assert written.node is not None
                return written.node, planned, True
            node = written.node if written.node is not None else self._read(now)
        self.writer.gave_up()
        return node, self._step(node, now), False

    def _settle_budget(self, node: dict, plan: NodePlan, now: float) -> None:
        """The budget slot in step with the plan (no request when it already is); a slot found
        reclaimed after a failed re-write sends the node back to NoSchedule on the next attempt."""
        if not (self.device_slot() and not plan.wants_slot) and self.budget.settle(node, now, plan.wants_slot):
            self.record = replace(self.record, rollback=True)
            self._dirty = True

    def _resync_due(self, now: float) -> bool:
        # the decision clock never goes back; an injected one might: read now, not once it catches up
        return self._last_read is None or not 0 <= now - self._last_read < self.resync_seconds

    def _check_race(self, node: dict, plan: NodePlan, now: float) -> tuple[dict, NodePlan]:
        """Right after the first node write with a new slot landed, the budget re-writes the slot;
        if another node reclaimed it meanwhile (see ``effects/budget.py``), step again: the node
        goes back to held NoSchedule (an API error here leaves the node dirty: the next attempt does)."""
        if not self.budget.slot_lost(now):
            return node, plan
        self.record = replace(self.record, rollback=True)  # kept until the rollback lands
        node, planned, done = self._write_node(node, now)
        if done:
            self._land(planned)
        return node, planned.plan

    # -- events ------------------------------------------------------------------------------------

    def _deliver_events(self, now: float) -> None:
        for spec in list(self.ledger.outbox):
            body = event_body(spec, self.node_name, self.record.node_uid)
            try:
                self.backend.create_event(EVENTS_NAMESPACE, body)
            except AlreadyExists:
                self.writer.count("event", "conflict")  # delivered before a restart: same name, same Event
            except ApiUnavailable as exc:
                self.writer.count("event", "error")
                self._failed(exc)
                return
            except ApiRejected as exc:
                self.writer.count("event", "error")
                self._tally.count(f"event_rejected_{exc.status}", f"event {spec.key} rejected ({exc}); dropped")
            else:
                self.writer.count("event", "ok")
                self._reachable = True
            self.ledger.delivered(spec, now)

    # -- bookkeeping -------------------------------------------------------------------------------

    def _failed(self, exc: ApiError) -> None:
        self._dirty = True
        if isinstance(exc, ApiRejected) and exc.status == 404:
            self._reachable = True
            self._tally.count("node_not_found", f"node={self.node_name} is not in the cluster ({exc}); "
                                                "desired state kept until it is")
            self.budget.node_gone()  # no Node, no taint: its budget slot goes back
        elif isinstance(exc, ApiRejected):
            self._reachable = True
            self._tally.count(f"rejected_{exc.status}", f"node={self.node_name} {exc}")
        else:
            self._reachable = False
            self._tally.count("unavailable", f"node={self.node_name} API server unavailable ({exc}); "
                                             "desired state kept")

    def _pending_against_known(self, now: float) -> int:
        """How many node writes the desired state still needs (the API server could not say)."""
        node = self._cache.get()
        if node is None:
            return 1
        answer = Budget.ALLOWS if self.budget.holds_slot else Budget.HOLDS
        return plan_for(self.record, self._verdict, node, answer, now, self._wall(now), self._context()).writes

    def _note_boot(self, boot_id: str) -> None:
        if boot_id and boot_id != self.record.boot_id:
            if self.record.boot_id:
                log.info("effects node=%s boot changed %s -> %s", self.node_name, self.record.boot_id, boot_id)
            self.record = replace(self.record, boot_id=boot_id)

    def pending_clear(self) -> str:
        """An operator's clear on the node as last seen (watch, read or write reply) that the agent
        has not handled yet: the ``healthagent.io/clear`` token, or "". Any thread: the loop
        reads it into the ``Collection``, and policy decides what it closes."""
        node = self._cache.get()
        clear = clear_request(node) if node is not None else None
        return clear.token if clear is not None else ""

    def _save(self) -> None:
        self.state.put(STATE_KEY, self.record.to_state({  # the ledger's "emitted" and "outbox"
            **self.ledger.to_state(), "dry_run_node": self.backend.node if self.dry_run else None}))
        self.state.flush()

    def status(self) -> KubeStatus:
        node = self._cache.get() or {}
        effects = {t.get("effect") for t in owned_taints(node, self.settings.taint_key)}
        effect = NO_EXECUTE if NO_EXECUTE in effects else (next(iter(effects)) if effects else "")
        return KubeStatus(
            mode=self.mode, reachable=self._reachable, taint_effect=effect,
            budget_blocked=self.record.budget_blocked, budget_blocked_total=self.record.budget_blocked_total,
            writes=dict(self.writer.writes), pending_writes=self._pending + len(self.ledger.outbox),
            clear_pending=self.pending_clear() or self.record.clear_to_write,
            watching=self.watching, api_errors=self.api_errors, **self.budget.figures(),
            **vars(node_side(node, self.budget.evidence)),
            conditions_owned_elsewhere=sum(not w.released for w in self.record.foreign),
            due_at=due_at(self.record, self.settings.replace_noexecute_grace_seconds, self.budget.recheck_at))

