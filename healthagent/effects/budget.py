"""Cluster-wide circuit breaker for the disruptive taint.

A bug in the agent or a bad driver roll-out can make every node look broken at once; tainting them
all would drain the cluster. Before ADDING its taint, an agent lists the GPU nodes
(``budget_node_selector``) and counts those already carrying the agent's taint key. The taint is
allowed while ``tainted + 1 <= limit`` with ``limit = max(1, floor(budget_max_fraction * total))``,
capped by ``budget_max_nodes`` when set. At the default 10%, a cluster of 20 GPU nodes allows 2:
the 3rd node is held back. Over budget, the agent reports (metric, Event, log line, label and
conditions still say what is wrong) but does not taint.

The budget never blocks healing: removing a taint, a label or a condition always proceeds, and a
taint already on the node may change effect (NoSchedule -> NoExecute) without asking.

Two agents deciding at once can both see ``limit - 1`` tainted nodes and both taint. So after
adding its taint an agent lists again; if more than ``limit`` nodes carry the key, the nodes are
ordered by the taint's ``timeAdded`` (then by name) and every node past the first ``limit`` removes
its own taint again. Every agent sorts the same timestamps read from the same node objects, so they
agree on the order and the oldest decisions stand. No database: the node objects are the shared
record. A peer's write can land just after this agent's re-count (its ``timeAdded``, taken from its
own clock before the write, may even be older), so the agent counts once more
``budget_recheck_seconds`` later and applies the same rule.

What a count costs the API server: a LIST of the GPU nodes. The count before tainting (and every
re-check while blocked) asks with ``resourceVersion=0``, which the API server answers from its
watch cache instead of a quorum read from etcd; the re-counts after tainting ask for a list not
older than the agent's own write (``resourceVersionMatch=NotOlderThan``), also served from the
cache, because a cache that lags behind would hide the very taint the re-count must see. The
interval to the next count (a blocked node's re-check, the late re-count) is jittered
(``recheck_delay``) so agents blocked in the same moment - a mass failure - do not list together.
And a blocked agent re-checks less often the more nodes wait with it (``recheck_interval``): the
fleet's re-checks stay near ``FLEET_RECHECKS_PER_SECOND`` however many nodes are blocked, while
some blocked node still re-checks about that often, so a freed slot is taken as soon as before.
Which waiting node gets it does not matter: all of them are faulty.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterable, Mapping

from healthagent.effects.node_desired import (
    HEALTH_LABEL,
    REBOOT_REQUIRED,
    REPLACE_REQUIRED,
    labels_of,
    owned_taints,
    parse_rfc3339,
)

RECHECK_JITTER = 0.5  # the next count comes after interval * [1 - j, 1 + j] seconds
FLEET_RECHECKS_PER_SECOND = 1.0  # while many nodes are blocked, their re-checks together


def budget_limit(total: int, fraction: float, max_nodes: int | None) -> int:
    """How many GPU nodes may carry the agent's taint at once.

    ``max(1, floor(fraction * total))`` so a small cluster can still take one bad node out; capped
    by ``max_nodes`` when set (0 = never taint). The epsilon keeps 0.29 * 100 at 29 instead of
    binary floating point's 28.999...
    """
    limit = max(1, math.floor(fraction * total + 1e-9))
    if max_nodes is not None:
        limit = min(limit, max_nodes)
    return limit


def recheck_interval(base: float, waiting: int) -> float:
    """A blocked node's re-check interval before jitter: ``base``, stretched so that ``waiting``
    blocked nodes together list about ``FLEET_RECHECKS_PER_SECOND`` times a second (1,800
    nodes blocked at once: each every 30 minutes, the fleet once a second, not 60 times)."""
    return max(base, waiting / FLEET_RECHECKS_PER_SECOND)


def recheck_delay(base: float, rng: random.Random) -> float:
    """Seconds to the next count: ``base`` +-50%, uniformly, so its mean stays ``base``. Agents
    blocked (or tainting) in the same moment spread their next lists over a whole interval, and
    stay spread, instead of listing the GPU nodes together every ``base`` seconds."""
    return rng.uniform(base * (1 - RECHECK_JITTER), base * (1 + RECHECK_JITTER))


@dataclass(frozen=True)
class BudgetCount:
    """The cluster as one agent saw it when it asked."""

    total: int
    tainted: tuple[str, ...]  # other GPU nodes carrying the agent's taint key
    limit: int
    waiting: int = 1  # GPU nodes blocked by the budget (this one included): action label, no taint

    @property
    def allows(self) -> bool:
        return len(self.tainted) + 1 <= self.limit

    def describe(self) -> str:
        return f"tainted={len(self.tainted)} limit={self.limit} gpu_nodes={self.total} waiting={self.waiting}"


def count_budget(nodes: Iterable[Mapping], taint_key: str, node_name: str, fraction: float,
                 max_nodes: int | None) -> BudgetCount:
    nodes = list(nodes)
    tainted = tuple(sorted(_name(n) for n in nodes if owned_taints(n, taint_key) and _name(n) != node_name))
    waiting = sum(1 for n in nodes if _name(n) != node_name and not owned_taints(n, taint_key)
                  and labels_of(n).get(HEALTH_LABEL) in (REBOOT_REQUIRED, REPLACE_REQUIRED))
    return BudgetCount(total=len(nodes), tainted=tainted, limit=budget_limit(len(nodes), fraction, max_nodes),
                       waiting=waiting + 1)


def must_roll_back(nodes: Iterable[Mapping], taint_key: str, node_name: str, limit: int) -> bool:
    """After tainting: True when this node's taint is one of the newest past ``limit``."""
    tainted = []
    for node in nodes:
        taints = owned_taints(node, taint_key)
        if taints:
            added = [parse_rfc3339(t.get("timeAdded")) for t in taints]
            known = [a for a in added if a is not None]
            # a taint without timeAdded (by hand, another tool) counts as the oldest: it stands
            tainted.append((min(known) if known else float("-inf"), _name(node)))
    if len(tainted) <= limit:
        return False
    tainted.sort()
    return node_name in {name for _, name in tainted[limit:]}


def late_older_peers(nodes: Iterable[Mapping], taint_key: str, node_name: str, seen: set[str],
                     own_added: float) -> list[str]:
    """Tainted peers not seen at the first re-count whose ``timeAdded`` is not newer than this
    node's: decisions made at the same time whose writes landed late. Only they can make this
    node's standing taint the excess; a taint added later, or by hand without ``timeAdded``, is
    not a race this node lost."""
    late = []
    for node in nodes:
        name = _name(node)
        if name == node_name or name in seen:
            continue
        added = [parse_rfc3339(t.get("timeAdded")) for t in owned_taints(node, taint_key)]
        if any(a is not None and a <= own_added for a in added):
            late.append(name)
    return late


def _name(node: Mapping) -> str:
    return (node.get("metadata") or {}).get("name", "")
