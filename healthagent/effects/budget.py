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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from healthagent.effects.node_desired import owned_taints, parse_rfc3339


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


@dataclass(frozen=True)
class BudgetCount:
    """The cluster as one agent saw it when it asked."""

    total: int
    tainted: tuple[str, ...]  # other GPU nodes carrying the agent's taint key
    limit: int

    @property
    def allows(self) -> bool:
        return len(self.tainted) + 1 <= self.limit

    def describe(self) -> str:
        return f"tainted={len(self.tainted)} limit={self.limit} gpu_nodes={self.total}"


def count_budget(nodes: Iterable[Mapping], taint_key: str, node_name: str, fraction: float,
                 max_nodes: int | None) -> BudgetCount:
    nodes = list(nodes)
    tainted = tuple(sorted(_name(n) for n in nodes if owned_taints(n, taint_key) and _name(n) != node_name))
    return BudgetCount(total=len(nodes), tainted=tainted, limit=budget_limit(len(nodes), fraction, max_nodes))


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
