"""Node effects: reconcile the agent's own node to the verdict through the ``kubernetes`` client.

``NodeEffects(settings, api_client, state)`` is driven by the loop's effects thread:
``startup(now, boot_id)`` once, then ``reconcile(verdict, now, boot_id)`` whenever the verdict
changes, whenever ``on_change`` fires, and every few seconds anyway; ``close()`` at shutdown.
Neither ever raises: API errors are counted in ``KubeStatus.writes`` and logged, the desired state
is kept and ``pending_writes`` says how much of it is not on the node yet; the next reconcile tries
again. ``api_client=None`` is ``--kube dry-run``: the same decisions, logged one line per intended
write, with no network at all (and no watch).

The node as last seen is a cache kept current by ONE watch on the agent's own node
(``effects/node_watch.py``, started by ``startup``): operator actions and foreign changes arrive
as they happen, and one that touches what the agent owns or the clear annotation calls
``on_change`` so the loop reconciles at once. In steady state that is zero writes, zero reads and
one open watch. While the watch is down, the effects fall back to reading the node before
planning, at most every ``resync_seconds``; a conflict on a write always takes a fresh node.

One reconcile:
  1. queue an Event for every open finding not reported yet, and one more when a finding's action
     became more severe (an escalation: one Event per finding and action; the record and the
     ledger make it once, the Event's deterministic name once across a lost state write);
  2. with the watch live, notice in the cached node what operators did (the
     ``healthagent.io/clear`` annotation, the agent's taint removed by hand, a recreated Node
     object) and adopt what the node records;
  3. if the plan against the cached node needs no write (and, with the watch down, the resync
     interval has not passed), stop: a steady state costs no request at all;
  4. plan against the cached node (watch live) or a fresh read (watch down), noticing as in 2:
     one plan per attempt (``effects/plan.py``, pure; the budget asked first, only while the node
     holds no slot and its plan has a disruptive step ahead); ``NodeWriter`` writes
     labels/annotations/taints (a JSON patch whose ``test`` operations pin what it replaces; a
     conflict -> the fresh node, a new plan, a retry with bounded exponential backoff and jitter),
     then the conditions (``/status``, merged by type, no precondition); ``BudgetGuard`` takes a
     slot of the disruption budget when the node is first tainted (NoSchedule needs none; the
     disruptive steps after the grace do), re-writes it once that write lands (the node goes back
     to held NoSchedule if the slot was reclaimed meanwhile), and gives it back once the node
     carries no agent taint;
  5. deliver the queued Events, save the record to the state file.

What the verdict could not see (``Verdict.unobserved``) is never taken for health: a condition
without findings whose area is unobserved says ``Unknown`` (``GpuNotObserved``,
``EfaNotObserved``), the health label says ``unknown`` instead of ``healthy``, and a reboot taint
already on the node stays while the subsystem its finding came from is unobserved (a driver that
stopped answering is not a recovery: no removal, no ``Cleared`` Event). Nothing is ever tainted
because of it, and the budget is not asked.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
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
from healthagent.effects.clear_cut import STATE_KEY as CLEAR_STATE_KEY
from healthagent.effects.clear_cut import ClearCut
from healthagent.effects.conditions import identify, vocabulary
from healthagent.effects.events import (
    EVENTS_NAMESPACE,
    NORMAL,
    EventLedger,
    EventSpec,
    budget_held_event,
    event_body,
    finding_events,
)
from healthagent.effects.node_desired import NO_EXECUTE, owned_taints, owned_view
from healthagent.effects.node_facts import NodeFacts
from healthagent.effects.node_watch import BACKOFF_SECONDS, WATCH_TIMEOUT_SECONDS, NodeCache, NodeWatch
from healthagent.effects.node_writer import NodeWriter
from healthagent.effects.plan import Budget, NodePlan, PlanSettings, clear_request, needs_budget, plan_node
from healthagent.effects.record import STATE_KEY, AppliedTaint, EffectsRecord
from healthagent.model import KubeStatus, SourceHealth, Verdict
from healthagent.common import ErrorTally

log = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0  # with the watch down or off: re-read the node this often (operator actions)
BUDGET_RECHECK_SECONDS = 30.0  # while over budget, look for a free slot this often (+-50% jitter, stretching)
MAX_ATTEMPTS = 6  # writes per object per reconcile before giving up until the next one


class NodeEffects:
    """Taint, labels, conditions and Events of the agent's own node (``settings.node_name``).

    The parts, one job each: ``plan_node`` decides (pure), ``NodeFacts`` notices operators'
    actions in the node, ``BudgetGuard`` answers the budget, ``NodeWriter`` writes a plan, the
    ``NodeWatch`` keeps the node cache current. This class runs them in order."""

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
        """``on_change`` (also settable later as the attribute, from the loop's effects worker) is
        called from the watch thread when the node changes in a way a reconcile must see; it
        must only wake the caller. ``watch=False`` keeps the read-on-a-timer behaviour (tests
        that drive time through ``now`` and count every request use it)."""
        self.settings = settings
        if not settings.node_name:  # in a pod the hostname is the pod's name: never guess the node
            raise ValueError("NodeEffects acts on one node: settings.node_name must name it")
        self.node_name = settings.node_name
        self.state = state
        self.record = EffectsRecord.from_state(state.get(STATE_KEY))
        self._clear = ClearCut(state.get(CLEAR_STATE_KEY), self.record.clear_token)
        self.ledger = EventLedger(self.record.emitted, self.record.outbox)
        self.dry_run = api_client is None
        self._tally = ErrorTally("kube")
        rng = rng or random.Random()
        if self.dry_run:
            self.mode = "dry-run"
            self.backend: Any = DryRunBackend(self.node_name, self.record.dry_run_node)
        else:
            self.mode = settings.kube if settings.kube in ("in-cluster", "kubeconfig") else "in-cluster"
            identify(api_client)  # the field manager of what the agent writes: "healthagent"
            self.backend = ApiBackend(api_client, self.node_name, request_timeout)
        self.resync_seconds = resync_seconds
        self.on_change = on_change
        self._plan_settings = PlanSettings(settings.taint_key, settings.replace_noexecute_grace_seconds,
                                           settings.hyperpod_labels, settings.reboot_node_noexecute,
                                           settings.condition_vocabulary)
        self._vocabulary = vocabulary(settings.condition_vocabulary)
        self.facts = NodeFacts(self.record, self.ledger, self.node_name, settings.taint_key, self._vocabulary)
        leases = None if self.dry_run else LeaseStore(self.backend, agent_namespace(settings.budget_namespace))
        self.budget = BudgetGuard(
            leases, node_name=self.node_name, taint_key=settings.taint_key,
            selector=settings.budget_node_selector, max_fraction=settings.budget_max_fraction,
            max_nodes=settings.budget_max_nodes, recheck_seconds=budget_recheck_seconds, tally=self._tally,
            rng=rng)
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
        self._rollback = False  # this node's budget slot was reclaimed: back to held NoSchedule
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
            self._verdict = self._clear.verdict_for(verdict, self._clear_pending())
            self._health = tuple(health)
            keys = {f.key for f in verdict.findings}
            self.record.cleared = [k for k in self.record.cleared if k in keys]
            cleared = set(self.record.cleared)
            self.ledger.want(finding_events([f for f in verdict.findings if f.key not in cleared], self.record,
                                            self.node_name, self._wall(now)))
            try:
                self._sync(now)
            except ApiError as exc:
                self._failed(exc)
                self._pending = self._pending_against_known(now)
            self._deliver_events(now)
        return self.status()

    def close(self) -> None:
        """Stop the watch (the loop's shutdown). The effects stay usable, reading on a timer."""
        if self._watch is not None:
            self._watch.stop()

    @property
    def watching(self) -> bool:
        """Is the watch on the node live (the cache as fresh as a read)?"""
        return self._watch is not None and self._watch.live

    @property
    def budget_recheck_at(self) -> float | None:
        """While the budget holds the node at NoSchedule: the time of the next look for a slot (jittered)."""
        return self.budget.recheck_at

    @property
    def node(self) -> dict | None:
        """The node as last seen (watch, read or write reply); read-only."""
        return self._cache.get()

    @property
    def node_watch(self) -> NodeWatch | None:
        """The watch on the node; None in dry-run or with ``watch=False``."""
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
        self._clear.arrived(self._verdict, self._clear_pending())  # the cache holds the changed node
        callback = self.on_change
        if callback is not None:
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
        self.facts.observe(node, now, self._verdict, self._wall(now))
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

    # -- planning ----------------------------------------------------------------------------------

    def _plan(self, node: dict, now: float, budget: Budget | None = None) -> NodePlan:
        """The one plan for this attempt; the budget is asked first, only while the node holds no
        slot and the plan has a disruptive step ahead (``budget`` given: that answer, no question)."""
        record = self.record
        if budget is None:
            budget = Budget.ROLLBACK if self._rollback else (
                Budget.ALLOWS if self.budget.holds_slot else Budget.UNASKED)
            if budget is Budget.UNASKED and needs_budget(self._verdict, node, record.taint, record.cleared,
                                                         self._plan_settings):
                budget = self.budget.ask(now)
        return plan_node(self._verdict, node, record.taint, record.cleared, budget, self._plan_settings, now,
                         self._health, self.facts.foreign, self._wall(now))

    def _observed_plan(self, node: dict, now: float) -> NodePlan:
        self.facts.observe(node, now, self._verdict, self._wall(now))
        return self._plan(node, now)

    # -- writing -----------------------------------------------------------------------------------

    def _sync(self, now: float) -> None:
        self.budget.begin()
        node = self._cache.get()
        trusted = node is not None and not self._dirty and self.watching
        if trusted:
            self._last_read = now  # the watch keeps the cache as fresh as a read
            self.facts.observe(node, now, self._verdict, self._wall(now))  # operators' acts, via the watch
        if not self._dirty and node is not None and not self._resync_due(now):
            plan = self._plan(node, now)
            if plan.writes == 0:
                self._commit(plan, node, now)
                self._settle_budget(node, plan, now)
                self._pending = 0
                return
        if not trusted:
            node = self._read(now)
        node, plan, basis, done = self._write_node(node, now)
        status_ok = False
        if done:  # conditions follow the node write (a pending clear must land first)
            self._commit(plan, basis, now)
            if plan.taint.taint is not None:
                node, plan = self._check_race(node, plan, now)
            node, status_ok = self.writer.write_status(node, plan)
        self._cache.offer(node)
        self._dirty = not (done and status_ok)
        self._pending = int(not done) + int(not status_ok)
        if done:
            self._settle_budget(node, plan, now)

    def _write_node(self, node: dict, now: float) -> tuple[dict, NodePlan, dict, bool]:
        """Plan against ``node`` (the budget asked here, before the write, when the plan needs
        it) and write until the plan lands; on a conflict, back off (the writer), take the fresh
        node (the conflict's, else a read) and plan again, at most ``max_attempts`` times.
        (the node after, the plan written, the node it was made against, whether it landed)."""
        for attempt in range(self.writer.max_attempts):
            plan = self._observed_plan(node, now)
            written = self.writer.write_node(node, plan, attempt)
            if written.landed:
                assert written.node is not None
                return written.node, plan, node, True
            node = written.node if written.node is not None else self._read(now)
        self.writer.gave_up()
        return node, self._observed_plan(node, now), node, False

    def _settle_budget(self, node: dict, plan: NodePlan, now: float) -> None:
        """The budget slot in step with the plan (no request when it already is); a slot found
        reclaimed after a failed re-write sends the node back to NoSchedule on the next attempt."""
        if self.budget.settle(node, now, plan.wants_slot):
            self._rollback = True
            self._dirty = True

    def _resync_due(self, now: float) -> bool:
        # a negative interval is a wall clock set back: read now, not once the clock catches up
        return self._last_read is None or not 0 <= now - self._last_read < self.resync_seconds

    def _check_race(self, node: dict, plan: NodePlan, now: float) -> tuple[dict, NodePlan]:
        """Right after the first node write with a new slot landed, the budget re-writes the slot;
        if another node reclaimed it meanwhile (see ``effects/budget.py``), plan again: the node goes
        back to held NoSchedule (an API error here leaves the node dirty: the next attempt does)."""
        if not self.budget.slot_lost(now):
            return node, plan
        self._rollback = True  # stays set until the rollback lands
        node, plan, basis, done = self._write_node(node, now)
        if done:
            self._commit(plan, basis, now)
        return node, plan

    def _commit(self, plan: NodePlan, basis: dict, now: float) -> None:
        """Record what the node now carries (the write succeeded, or nothing differed)."""
        if plan.clear is not None:
            self.facts.cleared(plan.clear, self._wall(now), self._verdict)
        had_taint = bool(owned_taints(basis, self.settings.taint_key))
        want = plan.taint.taint
        recorded = self.record.taint
        if want is None:
            if had_taint:
                self.record.taint = None
                log.info("effects node=%s taint=removed reason=%s", self.node_name,
                         plan.clear.via if plan.clear else "healthy")
                if plan.clear is None:
                    self.ledger.want([EventSpec(
                        key=f"cleared/{now:.3f}", type=NORMAL, reason="Cleared", action="Cleared",
                        note="Checks pass again: the agent removed its taint from the node.", at=self._wall(now))])
        elif recorded is None or recorded.value != want.value:
            self.record.taint = AppliedTaint(want.value, want.effect, now, plan.leading_code)
            log.warning("effects node=%s taint=added value=%s effect=%s finding=%s", self.node_name,
                        want.value, want.effect, plan.leading_code or "-")
        elif recorded.effect != want.effect:
            recorded.effect = want.effect
            log.warning("effects node=%s taint=changed value=%s effect=%s since_taint_seconds=%.0f",
                        self.node_name, want.value, want.effect, now - recorded.since)
        self._note_budget(plan, now)
        self._rollback = False  # a plan made under it landed: the node is back at NoSchedule

    def _note_budget(self, plan: NodePlan, now: float) -> None:
        if not plan.taint.budget_blocked:
            if self.record.budget_blocked:
                log.info("effects node=%s budget=released", self.node_name)
            self.record.budget_blocked = False
            return
        if self.record.budget_blocked:
            return
        self.record.budget_blocked = True
        self.record.budget_blocked_total += 1
        limits = (f"budget_max_fraction={self.settings.budget_max_fraction} "
                  f"budget_max_nodes={self.settings.budget_max_nodes}")
        log.warning("effects node=%s budget=blocked action=%s %s %s", self.node_name, plan.shown.value,
                    self.budget.note, limits)
        self.ledger.want([budget_held_event(plan.leading_key, plan.shown, plan.leading_code,
                                            f"{self.budget.note} ({limits})", self._wall(now))])

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
        return self._plan(node, now, budget=Budget.ALLOWS if self.budget.holds_slot else Budget.HOLDS).writes

    def _note_boot(self, boot_id: str) -> None:
        if boot_id and boot_id != self.record.boot_id:
            if self.record.boot_id:
                log.info("effects node=%s boot changed %s -> %s", self.node_name, self.record.boot_id, boot_id)
            self.record.boot_id = boot_id

    def _clear_pending(self) -> bool:
        """Does the node as last seen show a clear not applied yet (the annotation with a new
        token, or the agent's confirmed taint gone)?"""
        node = self._cache.get()
        return node is not None and (clear_request(node) is not None or (
            self.record.taint is not None and not owned_taints(node, self.settings.taint_key)))

    def _save(self) -> None:
        self._clear.note(self.record.clear_token, self._verdict)
        self._clear.settle(self._clear_pending())
        self.state.put(CLEAR_STATE_KEY, self._clear.to_state())
        ledger = self.ledger.to_state()
        self.record.emitted, self.record.outbox = ledger["emitted"], ledger["outbox"]
        if self.dry_run:
            self.record.dry_run_node = self.backend.node
        self.state.put(STATE_KEY, self.record.to_state())
        self.state.flush()

    def status(self) -> KubeStatus:
        self._clear.note(self.record.clear_token, self._verdict)  # the token and its cut-off, together
        effects = {t.get("effect") for t in owned_taints(self._cache.get() or {}, self.settings.taint_key)}
        effect = NO_EXECUTE if NO_EXECUTE in effects else (next(iter(effects)) if effects else "")
        return KubeStatus(
            mode=self.mode, reachable=self._reachable, taint_effect=effect,
            budget_blocked=self.record.budget_blocked, budget_blocked_total=self.record.budget_blocked_total,
            writes=dict(self.writer.writes), pending_writes=self._pending + len(self.ledger.outbox),
            clear_token=self.record.clear_token, clear_as_of=self._clear.as_of,
            watching=self.watching, api_errors=self.api_errors,
        )

