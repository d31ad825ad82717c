"""Writing one plan to the node: the node patch, then status.

A node write carries preconditions on what it replaces (``effects/backend.py``); when one fails
(a foreign taint changed meanwhile) the writer backs off with jitter and hands back the fresh
node; the caller ends its reconcile there and steps against that node in the next, at once, giving
up after ``max_attempts`` conflicts in a row until a timed one. The ``/status`` patch has no
precondition and is simply sent again after a 409, at most ``max_attempts`` times. Every write is
counted by (kind, result) for ``healthagent_kube_writes_total``; nothing is counted in dry-run.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from healthagent.effects.backend import AlreadyExists, ApiError, ApiRejected, ApiUnavailable, Conflict, jittered_backoff
from healthagent.effects.events import EVENTS_NAMESPACE, EventLedger, event_body
from healthagent.effects.plan import NodePlan
from healthagent.common import ErrorTally

log = logging.getLogger(__name__)

BACKOFF_BASE_SECONDS = 0.1
BACKOFF_CAP_SECONDS = 3.2


@dataclass(frozen=True)
class NodeWrite:
    """The outcome of one ``write_node``: the node after it (the reply; on a conflict the fresh
    node the conflict carried, None when it carried none) and whether the plan landed."""

    node: dict | None
    landed: bool


class NodeWriter:
    """Sends what a plan says and nothing else: it plans nothing and calls nothing back. The
    caller (``NodeEffects``) steps against a node, makes the budget exchange, then writes once."""

    def __init__(self, backend: Any, *, node_name: str, tally: ErrorTally, sleep: Callable[[float], None],
                 rng: random.Random, max_attempts: int, dry_run: bool) -> None:
        self._backend = backend
        self._node_name = node_name
        self._tally = tally
        self._sleep = sleep
        self._rng = rng
        self.max_attempts = max(1, max_attempts)
        self._dry_run = dry_run
        self.writes: Counter = Counter()

    def write_node(self, node: dict, plan: NodePlan, attempt: int) -> NodeWrite:
        """PATCH ``plan``'s node patch (made against ``node``) once. A conflict is counted and
        backed off (``attempt``: how many came before it in a row) and returned as not landed,
        with the fresh node when the conflict carried one. Other API errors are counted and
        raised (the desired state stays pending)."""
        if plan.node_patch is None:
            return NodeWrite(node, True)
        reply = self._attempt("node", self._backend.patch_node, (plan.node_patch, node, plan.taint.disruptive_ready),
                              attempt)
        if isinstance(reply, Conflict):
            return NodeWrite(reply.node, False)
        return NodeWrite(reply, True)

    def gave_up(self) -> None:
        """The caller's conflicts in a row ran out (``max_attempts``)."""
        self._exhausted("node")

    def write_status(self, node: dict, plan: NodePlan) -> tuple[dict, bool]:
        """PATCH the plan's conditions on ``/status``: merged by type, with no precondition, so
        the same patch is simply sent again after a 409 (the API server's own contention)."""
        patch = plan.status_patch
        if patch is None:
            return node, True
        for attempt in range(self.max_attempts):
            reply = self._attempt("node_status", self._backend.patch_node_status,
                                  (patch, plan.taint.disruptive_ready), attempt)
            if not isinstance(reply, Conflict):
                return reply, True
        self._exhausted("node_status")
        return node, False

    def deliver_events(self, ledger: EventLedger, node_uid: str, now: float
                       ) -> tuple[EventLedger, bool, ApiUnavailable | None]:
        """Send the queued Events in order: (the ledger after, whether the API server answered,
        the error that stopped delivery). Each goes once: a name that exists is one delivered before
        a restart, and a rejected one is counted and dropped; an unreachable server stops the run."""
        answered = False
        for spec in ledger.outbox:
            try:
                self._backend.create_event(EVENTS_NAMESPACE, event_body(spec, self._node_name, node_uid))
            except AlreadyExists:
                self.count("event", "conflict")
            except ApiUnavailable as exc:
                self.count("event", "error")
                return ledger, answered, exc
            except ApiRejected as exc:
                self.count("event", "error")
                self._tally.count(f"event_rejected_{exc.status}", f"event {spec.key} rejected ({exc}); dropped")
            else:
                self.count("event", "ok")
                answered = True
            ledger = ledger.delivered(spec, now)
        return ledger, answered, None

    def _attempt(self, kind: str, send: Callable[..., dict], args: tuple, attempt: int) -> "dict | Conflict":
        """One write, ``send(*args)`` with the patch first: its reply, or the Conflict after the
        backoff; other API errors raise."""
        try:
            reply = send(*args)
        except Conflict as exc:
            self.count(kind, "conflict")
            self._sleep(jittered_backoff(attempt, BACKOFF_BASE_SECONDS, BACKOFF_CAP_SECONDS, self._rng))
            return exc
        except ApiError:
            self.count(kind, "error")
            raise
        self.count(kind, "ok")
        log.info("effects write=%s node=%s %s", kind, self._node_name, describe(args[0]))
        return reply

    def _exhausted(self, kind: str) -> None:
        self._tally.count("conflicts_exhausted", f"{kind} write gave up after {self.max_attempts} "
                                                 "conflicts; retrying on the next reconcile")

    def count(self, kind: str, result: str) -> None:
        if not self._dry_run:
            self.writes[(kind, result)] += 1


def describe(patch: dict) -> str:
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
