"""The disruption budget as the effects ask it: count the GPU nodes, remember the answer, re-count.

``effects/budget.py`` holds the rule (pure: a count, a limit, who rolls back); this module does
the cluster reads it needs and keeps their timing: one count per reconcile at most, a blocked node
counting again only after a jittered interval, and the two re-counts after tainting (right away,
and once more about ``recheck_seconds`` later for a peer whose write landed late). A count that
fails holds the taint back (fail closed) until a later reconcile counts again. In dry-run there
is no cluster view: every count allows.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from healthagent.effects.backend import ApiError, ApiRejected
from healthagent.effects.budget import (
    BudgetCount,
    count_budget,
    late_older_peers,
    must_roll_back,
    recheck_delay,
    recheck_interval,
)
from healthagent.effects.node_desired import owned_taints, parse_rfc3339
from healthagent.effects.node_watch import resource_version
from healthagent.effects.plan import Budget
from healthagent.common import ErrorTally

log = logging.getLogger(__name__)


class BudgetGuard:
    """May this node add its taint, and must it give a fresh one back?"""

    def __init__(self, backend: Any, *, node_name: str, taint_key: str, selector: str, max_fraction: float,
                 max_nodes: int | None, recheck_seconds: float, tally: ErrorTally, rng: random.Random,
                 dry_run: bool) -> None:
        self._backend = backend
        self._node_name = node_name
        self._taint_key = taint_key
        self._selector = selector
        self._fraction = max_fraction
        self._max_nodes = max_nodes
        self._recheck_seconds = recheck_seconds
        self._tally = tally
        self._rng = rng
        self._dry_run = dry_run
        self._memo: BudgetCount | None = None  # this reconcile's count
        self.recheck_at: float | None = None  # while blocked: no count before this time
        self.recount_at: float | None = None  # the late re-count after tainting
        self._seen_tainted: set[str] = set()  # the peers tainted at the first re-count
        self.note = ""  # the last count in words, for the log and the Event

    def begin(self) -> None:
        """A new reconcile: the next question counts again (unless a blocked node must wait)."""
        self._memo = None

    def recount_due(self, now: float) -> bool:
        return self.recount_at is not None and now >= self.recount_at

    def ask(self, now: float) -> Budget:
        """ALLOWS or HOLDS for adding the taint now."""
        if self._dry_run:
            return Budget.ALLOWS
        if self._memo is not None:
            return Budget.ALLOWS if self._memo.allows else Budget.HOLDS
        if self.recheck_at is not None and now < self.recheck_at:
            return Budget.HOLDS
        try:
            nodes = self._backend.list_nodes(self._selector)
        except ApiError as exc:
            self._count_failure(exc, f"cannot count GPU nodes ({exc}); taint held back")
            self.note = f"the GPU nodes could not be counted ({exc})"
            self._memo = BudgetCount(total=0, tainted=(), limit=0)
            return Budget.HOLDS
        count = self._count(nodes)
        self._memo = count
        self.note = count.describe()
        self.recheck_at = None if count.allows else now + self._delay(count.waiting)
        return Budget.ALLOWS if count.allows else Budget.HOLDS

    def must_roll_back(self, node: dict, now: float, first: bool) -> bool:
        """After tainting: count again (at least as new as ``node``, this agent's own write: a
        lagging watch cache would hide the taint and with it the race) and say whether this
        node's taint is among the newest past the limit. ``first``: right after the write; else
        the late re-count, which only counts peers that decided no later than this node."""
        if self._dry_run:
            return False
        if first:
            self.recount_at = now + self._delay()
        else:
            self.recount_at = None
        try:
            nodes = self._backend.list_nodes(self._selector, not_older_than=resource_version(node))
        except ApiError as exc:
            self._count_failure(exc, f"cannot re-count GPU nodes after tainting ({exc})")
            return False
        count = self._count(nodes)
        if first:
            self._seen_tainted = set(count.tainted)
        else:
            own = [parse_rfc3339(t.get("timeAdded")) for t in owned_taints(node, self._taint_key)]
            own_added = min((a for a in own if a is not None), default=None)
            if own_added is None or not late_older_peers(nodes, self._taint_key, self._node_name,
                                                         self._seen_tainted, own_added):
                return False
        if not must_roll_back(nodes, self._taint_key, self._node_name, count.limit):
            return False
        self.recount_at = None
        log.warning("effects node=%s budget=rollback %s: another agent tainted at the same time",
                    self._node_name, count.describe())
        self.note = f"{count.describe()} (rolled back: another node tainted at the same time)"
        self._memo = count  # counted with this node's taint excluded: does not allow
        self.recheck_at = now + self._delay(count.waiting)
        return True

    def _count(self, nodes: list[dict]) -> BudgetCount:
        return count_budget(nodes, self._taint_key, self._node_name, self._fraction, self._max_nodes)

    def _count_failure(self, exc: ApiError, message: str) -> None:
        """The API's condition when it did not answer; the setup's fault (``rejected_403``: no
        ``list nodes``) when it refused."""
        if isinstance(exc, ApiRejected):
            self._tally.count(f"rejected_{exc.status}", f"node={self._node_name} {message}")
        else:
            self._tally.count("budget_count_failed", message)

    def _delay(self, waiting: int = 1) -> float:
        return recheck_delay(recheck_interval(self._recheck_seconds, waiting), self._rng)
