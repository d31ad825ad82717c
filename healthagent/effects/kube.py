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
planning, at most every ``resync_seconds``; a 409 on a write always re-reads.

One reconcile:
  1. queue an Event for every open finding not reported yet, and one more when a finding's action
     became more severe (an escalation: one Event per finding and action; the record and the
     ledger make it once, the Event's deterministic name once across a lost state write);
  2. with the watch live, notice in the cached node what operators did (the
     ``healthagent.io/clear`` annotation, the agent's taint removed by hand, a recreated Node
     object) and adopt what the node records;
  3. if the plan against the cached node needs no write (and, with the watch down, the resync
     interval has not passed), stop: a steady state costs no request at all;
  4. plan against the cached node (watch live) or a fresh read (watch down), noticing as in 2;
     write labels/annotations/taints (a JSON patch whose ``test`` operations pin what it replaces;
     a conflict -> re-read, re-plan, retry with bounded exponential backoff and jitter), then the
     conditions (``/status``, merged by type, no precondition); after ADDING the taint, re-count the budget and roll back if this
     node is the newest past the limit;
  5. deliver the queued Events, save the record to the state file.

What the verdict could not see (``Verdict.unobserved``) is never taken for health: a condition
without findings whose area is unobserved says ``Unknown`` (``GpuNotObserved``,
``EfaNotObserved``), the health label says ``unknown`` instead of ``healthy``, and a reboot taint
already on the node stays while the subsystem its finding came from is unobserved (a driver that
stopped answering is not a recovery: no removal, no ``Cleared`` Event). Nothing is ever tainted
because of it, and the budget is not asked.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from healthagent.config import Settings
from healthagent.effects.backend import (
    DEFAULT_REQUEST_TIMEOUT,
    AlreadyExists,
    ApiBackend,
    ApiError,
    ApiRejected,
    ApiUnavailable,
    Conflict,
    DryRunBackend,
    jittered_backoff,
    split_api_conditions,
)
from healthagent.effects.budget import (
    BudgetCount,
    count_budget,
    late_older_peers,
    must_roll_back,
    recheck_delay,
    recheck_interval,
)
from healthagent.effects.events import (
    EVENTS_NAMESPACE,
    NORMAL,
    WARNING,
    EventLedger,
    EventSpec,
    escalation_event,
    event_body,
    finding_event,
)
from healthagent.effects.node_desired import (
    CLEAR_ANNOTATION,
    CLEAR_HANDLED_ANNOTATION,
    NO_EXECUTE,
    TAINT_ACTIONS,
    DesiredNode,
    TaintPlan,
    annotations_of,
    grace_start,
    node_patch,
    not_observed_conditions,
    observed_by,
    owned_taints,
    owned_view,
    parse_rfc3339,
    plan_conditions,
    plan_labels,
    plan_taint,
    status_patch,
)
from healthagent.effects.node_watch import (
    BACKOFF_SECONDS,
    WATCH_TIMEOUT_SECONDS,
    NodeCache,
    NodeWatch,
    resource_version,
)
from healthagent.effects.record import STATE_KEY, AppliedTaint, EffectsRecord
from healthagent.model import Action, Finding, KubeStatus, SourceHealth, Verdict
from healthagent.sources.base import ErrorTally

log = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0  # with the watch down or off: re-read the node this often (operator actions)
BUDGET_RECHECK_SECONDS = 30.0  # while over budget, count the cluster again this often (+-50% jitter)
MAX_ATTEMPTS = 6  # writes per object per reconcile before giving up until the next one
BACKOFF_BASE_SECONDS = 0.1
BACKOFF_CAP_SECONDS = 3.2


@dataclass(frozen=True)
class ClearRequest:
    token: str
    via: str  # "annotation" | "taint-removed"


@dataclass(frozen=True)
class NodePlan:
    desired: DesiredNode
    patch: dict | None
    taint: TaintPlan
    clear: ClearRequest | None
    findings: tuple[Finding, ...]
    shown: Action
    leading_key: str
    leading_code: str


class NodeEffects:
    """Taint, labels, conditions and Events of the agent's own node (``settings.node_name``)."""

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
        self.node_name = settings.node_name or socket.gethostname()
        self.state = state
        self.record = EffectsRecord.from_state(state.get(STATE_KEY))
        self.ledger = EventLedger(self.record.emitted, self.record.outbox)
        self.dry_run = api_client is None
        self._tally = ErrorTally("kube")
        if self.dry_run:
            self.mode = "dry-run"
            self.backend: Any = DryRunBackend(self.node_name, self.record.dry_run_node)
        else:
            self.mode = settings.kube if settings.kube in ("in-cluster", "kubeconfig") else "in-cluster"
            self.backend = ApiBackend(api_client, self.node_name, request_timeout)
        self._sleep = sleep
        self._rng = rng or random.Random()
        self.resync_seconds = resync_seconds
        self.budget_recheck_seconds = budget_recheck_seconds
        self.max_attempts = max(1, max_attempts)
        self.on_change = on_change
        self._verdict: Verdict | None = None
        self._health: tuple[SourceHealth, ...] = ()
        self._cache = NodeCache()
        self._watch: NodeWatch | None = None
        if watch and not self.dry_run:
            self._watch = NodeWatch(
                self.backend, self._cache, owned=self._owned_view, on_change=self._changed,
                tally=self._tally, rng=random.Random(self._rng.random()),
                timeout_seconds=watch_timeout_seconds, backoff=watch_backoff)
        self._last_read: float | None = None
        self._dirty = True
        self._pending = 0
        self._writes: Counter = Counter()
        self._reachable = self.dry_run
        self._budget_memo: BudgetCount | None = None
        self._recheck_at: float | None = None  # while blocked: no count before this time
        self._budget_note = ""
        self._rollback = False
        self._recount_at: float | None = None  # one more budget count after tainting (late peers)
        self._seen_tainted: set[str] = set()  # the peers tainted at the first re-count

    # -- the two entry points ----------------------------------------------------------------------

    def startup(self, now: float, boot_id: str) -> KubeStatus:
        """Read the node (the watch's LIST), start the watch, adopt what the node records, deliver
        queued Events. Writes nothing to the node: the first reconcile (right after the loop's
        first cycle) does, with a verdict in hand."""
        self._guard(lambda: self._startup(now, boot_id))
        return self.status()

    def reconcile(self, verdict: Verdict, now: float, boot_id: str,
                  health: "tuple[SourceHealth, ...] | list[SourceHealth]" = ()) -> KubeStatus:
        """Bring the node to the verdict. Never raises. ``health``: the sources' latest health,
        whose detail says in an ``Unknown`` condition why a subsystem could not be observed."""
        self._guard(lambda: self._reconcile(verdict, now, boot_id, tuple(health)))
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
        """While the budget holds the taint back: the time of the next count (jittered)."""
        return self._recheck_at

    @property
    def budget_recount_at(self) -> float | None:
        """After tainting: the time of the late re-count for peers that raced (jittered)."""
        return self._recount_at

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
        ``budget_count_failed``, ``watch_expired``, ...): see ``backend.API_CONDITION_KINDS``."""
        return split_api_conditions(self._tally.snapshot())[1]

    def _changed(self) -> None:
        callback = self.on_change
        if callback is not None:
            callback()

    def _owned_view(self, node: dict | None) -> tuple:
        return owned_view(node, self.settings.taint_key, self.settings.hyperpod_labels)

    def _guard(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception:  # a bug here must not stop the effects thread; the state is kept
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
        self._dirty = False
        self._deliver_events(now)

    def _reconcile(self, verdict: Verdict, now: float, boot_id: str, health: tuple[SourceHealth, ...]) -> None:
        self._start_watch()  # a no-op after ``startup``
        self._note_boot(boot_id)
        self._verdict = verdict
        self._health = health
        keys = {f.key for f in verdict.findings}
        self.record.cleared = [k for k in self.record.cleared if k in keys]
        cleared = set(self.record.cleared)
        self.ledger.want(self._finding_events([f for f in verdict.findings if f.key not in cleared], now))
        try:
            self._sync(now)
        except ApiError as exc:
            self._failed(exc)
            self._pending = self._pending_against_known(now)
        self._deliver_events(now)

    def _finding_events(self, findings: list[Finding], now: float) -> list[EventSpec]:
        """The Event that first reports each new finding, and one for each finding whose action
        became more severe than the one last reported (XID 79 then 94 on one GPU: one incident,
        reboot_node then replace_node). A finding whose action falls back is not reported again."""
        specs = []
        for finding in findings:
            before = _action_or_none(self.record.reported.get(finding.key))
            if before is None:
                specs.append(finding_event(finding, now))
            elif finding.action.severity > before.severity:
                log.warning("effects node=%s finding=%s escalated from=%s to=%s", self.node_name,
                            finding.code, before.value, finding.action.value)
                specs.append(escalation_event(finding, before, now))
            else:
                continue
            self.record.note_reported(finding.key, finding.action.value)
        return specs

    def _blind_to(self, code: str) -> bool:
        """Is a subsystem that a finding of ``code`` is seen through unobserved right now?"""
        unobserved = self._verdict.unobserved if self._verdict is not None else ()
        return any(part in unobserved for part in observed_by(code))

    # -- reading and noticing ----------------------------------------------------------------------

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

    def _observe(self, node: dict, now: float) -> None:
        """Adopt what the node records; notice a recreated Node and a taint removed by hand."""
        meta = node.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if uid and self.record.node_uid and uid != self.record.node_uid and self.record.taint is not None:
            log.warning("effects node=%s object recreated (uid %s -> %s); the applied taint is "
                        "forgotten and decided again", self.node_name, self.record.node_uid, uid)
            self.record.taint = None
        if uid:
            self.record.node_uid = uid
        handled = annotations_of(node).get(CLEAR_HANDLED_ANNOTATION, "")
        if handled and not self.record.clear_token:
            self.record.clear_token = handled
        taint_key = self.settings.taint_key
        ours = owned_taints(node, taint_key)
        recorded = self.record.taint
        if ours:
            main = max(ours, key=lambda t: (t.get("value") == Action.REPLACE_NODE.value,
                                            t.get("effect") == NO_EXECUTE))
            value, effect = str(main.get("value") or ""), str(main.get("effect") or "")
            if recorded is None or recorded.value != value:
                since = grace_start(node, taint_key, value, None)
                self.record.taint = AppliedTaint(value, effect, now if since is None else since)
                log.info("effects node=%s adopted taint from the node value=%s effect=%s", self.node_name,
                         value, effect)
            elif recorded.effect != effect:
                recorded.effect = effect
        elif recorded is not None and self._verdict is not None:
            # gone while the agent still wanted it (a replace taint, a taint action, or a reboot
            # taint held while unobserved): someone removed it by hand
            if recorded.value == Action.REPLACE_NODE.value or self._effective_action() in TAINT_ACTIONS \
                    or self._blind_to(recorded.code):
                self._operator_cleared(ClearRequest(f"taint-removed-{int(now)}", "taint-removed"), now)
            else:
                self.record.taint = None  # our own removal whose reply was lost

    def _clear_request(self, node: dict) -> ClearRequest | None:
        annotations = annotations_of(node)
        token = annotations.get(CLEAR_ANNOTATION, "")
        if token and token != annotations.get(CLEAR_HANDLED_ANNOTATION, ""):
            return ClearRequest(token, "annotation")
        return None

    def _operator_cleared(self, clear: ClearRequest, now: float) -> None:
        verdict = self._verdict
        keys = [f.key for f in verdict.findings] if verdict else []
        self.record.cleared = list(dict.fromkeys(self.record.cleared + keys))
        self.record.clear_token = clear.token
        self.record.taint = None
        how = ("the healthagent.io/clear annotation" if clear.via == "annotation"
               else "removing the agent's taint by hand")
        log.warning("effects node=%s operator_clear=%s via=%s findings_cleared=%d", self.node_name,
                    clear.token, clear.via, len(keys))
        self.ledger.want([EventSpec(
            key=f"cleared/{clear.token}", type=NORMAL, reason="Cleared", action="Cleared",
            note=f"An operator cleared the node ({how}, token {clear.token}); the agent removed its "
                 f"taint and labels and forgot {len(keys)} open finding(s).", at=now)])

    def _effective(self, extra_cleared: set[str]) -> tuple[Finding, ...]:
        verdict = self._verdict
        if verdict is None:
            return ()
        cleared = set(self.record.cleared) | extra_cleared
        return tuple(f for f in verdict.findings if f.key not in cleared)

    def _effective_action(self) -> Action:
        return Action.most_severe([f.action for f in self._effective(set())])

    # -- planning ----------------------------------------------------------------------------------

    def _plan(self, node: dict, now: float, budget_allows: Callable[[], bool] | None = None) -> NodePlan:
        clear = self._clear_request(node)
        all_keys = {f.key for f in self._verdict.findings} if (clear and self._verdict) else set()
        findings = self._effective(all_keys)
        action = Action.most_severe([f.action for f in findings])
        taint_key = self.settings.taint_key
        recorded = self.record.taint
        values = {t.get("value") for t in owned_taints(node, taint_key)} if clear is None else set()
        sticky = Action.REPLACE_NODE.value in values
        # a reboot taint whose finding cannot be seen any more stays: unobserved is not healthy
        held = Action.REBOOT_NODE.value in values and self._blind_to(recorded.code if recorded else "")
        shown = Action.REPLACE_NODE if sticky else (
            Action.most_severe([action, Action.REBOOT_NODE]) if held else action)
        unobserved = self._verdict.unobserved if self._verdict is not None else ()
        if self._rollback:
            taint = TaintPlan(taint=None, adds_taint=True, budget_blocked=True)
        else:
            since = grace_start(node, taint_key, shown.value,
                                recorded.since if recorded and recorded.value == shown.value else None)
            taint = plan_taint(action=shown, node=node, taint_key=taint_key,
                               grace_seconds=self.settings.replace_noexecute_grace_seconds, since=since,
                               now=now, budget_allows=budget_allows or (lambda: self._budget_allows(now)))
        leading_code = findings[0].code if findings else (recorded.code if recorded else "")
        conditions = plan_conditions(
            findings, sticky_without_finding=sticky and all(f.action is not Action.REPLACE_NODE for f in findings),
            sticky_code=recorded.code if recorded else "",
            not_observed=not_observed_conditions(node, unobserved, self._health))
        labels = plan_labels(node=node, shown=shown, taint=taint, leading_code=leading_code,
                             hyperpod=self.settings.hyperpod_labels, unobserved=bool(unobserved))
        annotations = {CLEAR_HANDLED_ANNOTATION: clear.token} if clear else {}
        desired = DesiredNode(taint=taint.taint, labels=labels, annotations=annotations, conditions=conditions)
        return NodePlan(desired=desired, patch=node_patch(node, desired, taint_key, now), taint=taint,
                        clear=clear, findings=findings, shown=shown,
                        leading_key=findings[0].key if findings else "", leading_code=leading_code)

    def _budget_allows(self, now: float) -> bool:
        """May this node ADD the taint? One cluster count per sync (a list from the API server's
        watch cache); over budget, the answer is kept for ``budget_recheck_seconds``, jittered. A
        count that fails holds the taint back (fail closed) until the next reconcile counts again."""
        if self._budget_memo is not None:
            return self._budget_memo.allows
        if self._recheck_at is not None and now < self._recheck_at:
            return False
        try:
            nodes = self.backend.list_nodes(self.settings.budget_node_selector)
        except ApiError as exc:
            # held back for this sync only: the count is tried again on the next reconcile
            self._count_budget_failure(exc, f"cannot count GPU nodes ({exc}); taint held back")
            self._budget_note = f"the GPU nodes could not be counted ({exc})"
            self._budget_memo = BudgetCount(total=0, tainted=(), limit=0)
            return False
        count = count_budget(nodes, self.settings.taint_key, self.node_name,
                             self.settings.budget_max_fraction, self.settings.budget_max_nodes)
        self._budget_memo = count
        self._budget_note = count.describe()
        self._recheck_at = None if count.allows else now + self._recheck_delay(count.waiting)
        return count.allows

    def _recheck_delay(self, waiting: int = 1) -> float:
        return recheck_delay(recheck_interval(self.budget_recheck_seconds, waiting), self._rng)

    # -- writing -----------------------------------------------------------------------------------

    def _sync(self, now: float) -> None:
        self._budget_memo = None
        recount_due = self._recount_at is not None and now >= self._recount_at
        node = self._cache.get()
        trusted = node is not None and not self._dirty and self.watching
        if trusted:
            self._last_read = now  # the watch keeps the cache as fresh as a read
            self._observe(node, now)  # what operators did arrived through the watch
        if not self._dirty and node is not None and not self._resync_due(now) and not recount_due:
            plan = self._plan(node, now)
            if plan.patch is None and status_patch(node, plan.desired, now) is None:
                self._commit(plan, node, now)
                self._pending = 0
                return
        if not trusted:
            node = self._read(now)
        node, plan, basis, node_ok = self._write_node(node, now)
        status_ok = False
        if node_ok:  # conditions follow the node write (a pending clear must land first)
            self._commit(plan, basis, now)
            if plan.taint.adds_taint and plan.taint.taint is not None:
                node = self._recount_after_taint(node, now, first=True)
            elif recount_due:
                self._recount_at = None
                if owned_taints(node, self.settings.taint_key):
                    node = self._recount_after_taint(node, now, first=False)
            node, status_ok = self._write_status(node, now)
        self._cache.offer(node)
        self._dirty = not (node_ok and status_ok)
        self._pending = int(not node_ok) + int(not status_ok)

    def _resync_due(self, now: float) -> bool:
        return self._last_read is None or now - self._last_read >= self.resync_seconds

    def _write_node(self, node: dict, now: float) -> tuple[dict, NodePlan, dict, bool]:
        """PATCH labels/annotations/taints until the node matches; (node, plan, basis, done)."""
        def make(current: dict) -> tuple[dict | None, NodePlan]:
            self._observe(current, now)
            plan = self._plan(current, now)
            return plan.patch, plan

        return self._write_until_matching("node", node, now, make, self.backend.patch_node)

    def _write_status(self, node: dict, now: float) -> tuple[dict, bool]:
        """PATCH the agent's conditions on ``/status`` until they match."""
        def make(current: dict) -> tuple[dict | None, NodePlan]:
            plan = self._plan(current, now)
            return status_patch(current, plan.desired, now), plan

        node, _, _, done = self._write_until_matching(
            "node_status", node, now, make, lambda patch, _basis: self.backend.patch_node_status(patch))
        return node, done

    def _write_until_matching(self, kind: str, node: dict, now: float,
                              make: Callable[[dict], tuple[dict | None, NodePlan]],
                              send: Callable[[dict, dict], dict]) -> tuple[dict, NodePlan, dict, bool]:
        """Read-modify-write: plan against ``node``, send (with the node planned against, whose
        values the write's preconditions pin), and on a conflict back off, re-read, re-plan.

        Returns (node after, the plan, the node the plan was made against, done). API errors other
        than a conflict are counted and raised to the caller (the desired state stays pending).
        """
        for attempt in range(self.max_attempts):
            patch, plan = make(node)
            if patch is None:
                return node, plan, node, True
            try:
                new = send(patch, node)
            except Conflict as exc:
                self._count(kind, "conflict")
                self._backoff(attempt)
                node = self._read(now) if exc.node is None else self._seen(exc.node, now)
                continue
            except ApiError:
                self._count(kind, "error")
                raise
            self._count(kind, "ok")
            log.info("effects write=%s node=%s %s", kind, self.node_name, _describe(patch))
            return new, plan, node, True
        self._tally.count("conflicts_exhausted", f"{kind} write gave up after {self.max_attempts} "
                                                 "conflicts; retrying on the next reconcile")
        return node, plan, node, False

    def _backoff(self, attempt: int) -> None:
        self._sleep(jittered_backoff(attempt, BACKOFF_BASE_SECONDS, BACKOFF_CAP_SECONDS, self._rng))

    def _commit(self, plan: NodePlan, basis: dict, now: float) -> None:
        """Record what the node now carries (the write succeeded, or nothing differed)."""
        if plan.clear is not None:
            self._operator_cleared(plan.clear, now)
        had_taint = bool(owned_taints(basis, self.settings.taint_key))
        want = plan.taint.taint
        recorded = self.record.taint
        if want is None:
            if had_taint:
                self.record.taint = None
                log.info("effects node=%s taint=removed reason=%s", self.node_name,
                         "budget_rollback" if self._rollback else (plan.clear.via if plan.clear else "healthy"))
                if plan.clear is None and not self._rollback:
                    self.ledger.want([EventSpec(
                        key=f"cleared/{now:.3f}", type=NORMAL, reason="Cleared", action="Cleared",
                        note="Checks pass again: the agent removed its taint from the node.", at=now)])
        elif recorded is None or recorded.value != want.value:
            self.record.taint = AppliedTaint(want.value, want.effect, now, plan.leading_code)
            log.warning("effects node=%s taint=added value=%s effect=%s finding=%s", self.node_name,
                        want.value, want.effect, plan.leading_code or "-")
        elif recorded.effect != want.effect:
            recorded.effect = want.effect
            log.warning("effects node=%s taint=changed value=%s effect=%s after_grace_seconds=%.0f",
                        self.node_name, want.value, want.effect, now - recorded.since)
        self._note_budget(plan, now)
        if self._rollback and want is None:
            self._rollback = False  # the rolled-back taint is off the node

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
                    self._budget_note, limits)
        self.ledger.want([EventSpec(
            key=f"budget/{plan.leading_key or f'{now:.3f}'}", type=WARNING, reason="TaintBlockedByBudget",
            action="TaintHeldBack",
            note=f"The node needs {plan.shown.value} ({plan.leading_code or 'no finding'}) but the "
                 f"disruption budget holds the taint back: {self._budget_note} ({limits}). Labels and "
                 "conditions still report the fault.", at=now)])

    def _recount_after_taint(self, node: dict, now: float, first: bool) -> dict:
        """Two agents may have tainted at once: count again and roll back if this node is the
        newest past the limit (see ``effects/budget.py``). Right after tainting, and once more
        about ``budget_recheck_seconds`` (jittered) later for a peer whose write landed after this
        first count. Both lists are at least as new as ``node`` (this agent's own write): a watch
        cache lagging behind would hide this node's taint and with it the race."""
        if self.dry_run:
            return node  # no cluster view
        if first:
            self._recount_at = now + self._recheck_delay()
        try:
            nodes = self.backend.list_nodes(self.settings.budget_node_selector,
                                            not_older_than=resource_version(node))
        except ApiError as exc:
            self._count_budget_failure(exc, f"cannot re-count GPU nodes after tainting ({exc})")
            return node
        taint_key = self.settings.taint_key
        count = count_budget(nodes, taint_key, self.node_name, self.settings.budget_max_fraction,
                             self.settings.budget_max_nodes)
        if first:
            self._seen_tainted = set(count.tainted)
        else:
            own = [parse_rfc3339(t.get("timeAdded")) for t in owned_taints(node, taint_key)]
            own_added = min((a for a in own if a is not None), default=None)
            if own_added is None or not late_older_peers(nodes, taint_key, self.node_name,
                                                         self._seen_tainted, own_added):
                return node
        if not must_roll_back(nodes, taint_key, self.node_name, count.limit):
            return node
        self._recount_at = None
        log.warning("effects node=%s budget=rollback %s: another agent tainted at the same time",
                    self.node_name, count.describe())
        self._budget_note = f"{count.describe()} (rolled back: another node tainted at the same time)"
        self._budget_memo = count  # counted with this node's taint excluded: does not allow
        self._recheck_at = now + self._recheck_delay(count.waiting)
        self._rollback = True  # stays set until the removal lands (an API error retries it later)
        node, plan, basis, ok = self._write_node(node, now)
        if ok:
            self._commit(plan, basis, now)
        return node

    def _count(self, kind: str, result: str) -> None:
        if not self.dry_run:
            self._writes[(kind, result)] += 1

    # -- events ------------------------------------------------------------------------------------

    def _deliver_events(self, now: float) -> None:
        for spec in list(self.ledger.outbox):
            body = event_body(spec, self.node_name, self.record.node_uid)
            try:
                self.backend.create_event(EVENTS_NAMESPACE, body)
            except AlreadyExists:
                self._count("event", "conflict")  # delivered before a restart: same name, same Event
            except ApiUnavailable as exc:
                self._count("event", "error")
                self._failed(exc)
                return
            except ApiRejected as exc:
                self._count("event", "error")
                self._tally.count(f"event_rejected_{exc.status}", f"event {spec.key} rejected ({exc}); dropped")
            else:
                self._count("event", "ok")
                self._reachable = True
            self.ledger.delivered(spec, now)

    # -- bookkeeping -------------------------------------------------------------------------------

    def _count_budget_failure(self, exc: ApiError, message: str) -> None:
        """A budget count that failed: the API's condition when it did not answer, the setup's
        fault (``rejected_403``: no ``list nodes``) when it refused."""
        if isinstance(exc, ApiRejected):
            self._tally.count(f"rejected_{exc.status}", f"node={self.node_name} {message}")
        else:
            self._tally.count("budget_count_failed", message)

    def _failed(self, exc: ApiError) -> None:
        self._dirty = True
        if isinstance(exc, ApiRejected) and exc.status == 404:
            self._reachable = True
            self._tally.count("node_not_found", f"node={self.node_name} is not in the cluster ({exc}); "
                                                "desired state kept until it is")
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
        plan = self._plan(node, now, budget_allows=lambda: True)
        return int(plan.patch is not None) + int(status_patch(node, plan.desired, now) is not None)

    def _note_boot(self, boot_id: str) -> None:
        if boot_id and boot_id != self.record.boot_id:
            if self.record.boot_id:
                log.info("effects node=%s boot changed %s -> %s", self.node_name, self.record.boot_id, boot_id)
            self.record.boot_id = boot_id

    def _save(self) -> None:
        ledger = self.ledger.to_state()
        self.record.emitted, self.record.outbox = ledger["emitted"], ledger["outbox"]
        if self.dry_run:
            self.record.dry_run_node = self.backend.node
        self.state.put(STATE_KEY, self.record.to_state())
        self.state.flush()

    def status(self) -> KubeStatus:
        effects = {t.get("effect") for t in owned_taints(self._cache.get() or {}, self.settings.taint_key)}
        effect = NO_EXECUTE if NO_EXECUTE in effects else (next(iter(effects)) if effects else "")
        return KubeStatus(
            mode=self.mode, reachable=self._reachable, taint_effect=effect,
            budget_blocked=self.record.budget_blocked, budget_blocked_total=self.record.budget_blocked_total,
            writes=dict(self._writes), pending_writes=self._pending + len(self.ledger.outbox),
            clear_token=self.record.clear_token, watching=self.watching, api_errors=self.api_errors,
        )


def _action_or_none(value: object) -> Action | None:
    """The action a state file recorded; None for a missing or unknown one (reported afresh)."""
    try:
        return Action(value)
    except ValueError:
        return None


def _describe(patch: dict) -> str:
    """One short line for the log: which owned things the patch changes."""
    meta = patch.get("metadata") or {}
    parts = [f"{k}={'-' if v is None else v}" for k, v in sorted((meta.get("labels") or {}).items())]
    parts += [f"{k}={'-' if v is None else v}" for k, v in sorted((meta.get("annotations") or {}).items())]
    if "taints" in (patch.get("spec") or {}):
        parts.append("taints=" + ",".join(f"{t.get('key')}={t.get('value')}:{t.get('effect')}"
                                          for t in patch["spec"]["taints"]))
    parts += [f"condition={c['type']}={c['status']}:{c['reason']}"
              for c in (patch.get("status") or {}).get("conditions") or []]
    return " ".join(parts)
