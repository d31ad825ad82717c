"""Contract tests for Karpenter v1.15.0's node repair, beside test_engine_contracts.py's v1.14.1.

The oracle holds Karpenter v1.15.0's released semantics (its release notes: "node repair as
voluntary disruption", "reboot as a node action", "integrate reason-aware matching"; karpenter.sh's
v1.15 "Disruption" page; the EKS User Guide's "Repair behavior on Karpenter v1.15.0 and later"):

- the toleration is unchanged: a node is due once ``AcceleratedHardwareReady`` has been ``False``
  for 10 minutes (``NetworkingReady``: 30), counted from the condition's ``lastTransitionTime``;
- repair is the first disruption method, so it is paced by the NodePool's disruption budgets: the
  budgets that apply to repair (those without ``reasons``, or naming repair's reason), or the
  default ``nodes: 10%`` when the NodePool sets none; less the nodes of the pool already being
  disrupted. v1.14.1 applies no budget to repair;
- the 20% breaker stays: no repair in a NodePool where more than 20% (rounded up) is unhealthy;
- ``karpenter.sh/do-not-repair: "true"`` on the node vetoes repair;
- the action follows the condition's reason: with the AWS provider's ``RebootForRepair`` gate on,
  a reason the EKS User Guide's table reboots for is a reboot, every other one a replacement.

The agent's side (which nodes get a ``False`` condition, with which reason and transition time) is
read from the fake and a real API server, as in test_engine_contracts.py.
"""

from __future__ import annotations

import math
import re

import pytest

from healthagent.effects.node_desired import CLEAR_ANNOTATION
from healthagent.model import Action, Verdict
from healthagent.present.engine_words import EKS_REBOOT_XIDS
from tests.effects.helpers import T0, cleared_by
from tests.effects.test_engine_contracts import (  # noqa: F401 (cluster, fake_or_none: fixtures)
    GRACE, KARPENTER_POLICIES, POOL, XID79, XID94, XID94_LINE, cluster, due_repair, effects_for, fake_or_none,
    no_internal_errors, ours, xid_finding,
)

pytestmark = pytest.mark.integration

DO_NOT_REPAIR = "karpenter.sh/do-not-repair"
REPAIR_REASON = "Unhealthy"  # the budget reason repair runs under in the v1.15.0 sources
DEFAULT_BUDGETS = ({"nodes": "10%"},)  # what a NodePool without budgets gets


def reason_of(node: dict, condition: str) -> str:
    return next((c.get("reason", "") for c in node["status"].get("conditions") or [] if c["type"] == condition), "")


def v115_action(node: dict, reboot_for_repair: bool) -> str:
    """What Karpenter v1.15.0 does to a due node: "" (not due, or vetoed), "reboot" or "replace"."""
    due = due_repair(node, KARPENTER_POLICIES)
    if due is None or (node["metadata"].get("annotations") or {}).get(DO_NOT_REPAIR) == "true":
        return ""
    found = re.fullmatch(r"NvidiaXID(\d+)Error", reason_of(node, due.condition))
    reboots = due.condition == "AcceleratedHardwareReady" and found and int(found.group(1)) in EKS_REBOOT_XIDS
    return "reboot" if reboot_for_repair and reboots else "replace"


def allowed(budgets: tuple[dict, ...], pool_size: int, disrupting: int) -> int:
    """Karpenter's allowed disruptions for repair in a NodePool: the smallest budget that applies
    (a percentage rounds up), less the pool's nodes already being disrupted; no budget applies: no
    limit from budgets."""
    limits = []
    for budget in budgets:
        if budget.get("reasons") and REPAIR_REASON not in budget["reasons"]:
            continue
        nodes = budget["nodes"]
        limits.append(math.ceil(pool_size * int(nodes[:-1]) / 100) if nodes.endswith("%") else int(nodes))
    return max(0, min(limits, default=pool_size) - disrupting)


def unhealthy(node: dict) -> bool:
    """The breaker's count: a condition matching a repair policy, due or not yet."""
    return any(KARPENTER_POLICIES.get(c["type"], ("",))[0] == c.get("status")
               for c in node["status"].get("conditions") or [])


def v115_started(pool: list[dict], budgets: tuple[dict, ...], disrupting: int = 0) -> int:
    """How many of the pool's due nodes v1.15.0 starts repairing now (one command per node)."""
    due = [node for node in pool if v115_action(node, reboot_for_repair=False)]
    if sum(map(unhealthy, pool)) > math.ceil(0.2 * len(pool)):  # the breaker
        return 0
    return min(len(due), allowed(budgets, len(pool), disrupting))


def v114_started(pool: list[dict]) -> int:
    """v1.14.1: every due node at once (no budget applies to repair), under the same breaker."""
    due = [node for node in pool if due_repair(node, KARPENTER_POLICIES) is not None]
    return 0 if len(due) > math.ceil(0.2 * len(pool)) else len(due)


def test_v115_waits_as_v114_does_and_acts_by_the_reason_at_that_time(tmp_path, cluster):  # noqa: F811
    """XID 79 then XID 94 on one GPU: the condition keeps its transition time, so v1.15.0 is due when
    v1.14.1 is; by then the reason is NvidiaXID94Error, a reboot with RebootForRepair. The reboot
    does not end the agent's replace_node verdict: taint and False condition stay, due at once."""
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster, condition_vocabulary="eks", replace_noexecute_grace_seconds=GRACE)
    effects.reconcile(Verdict.of([XID79], T0), T0, "boot-1")
    effects.reconcile(Verdict.of([XID79], T0), T0 + GRACE, "boot-1")
    node = cluster.node(name)
    first = due_repair(node, KARPENTER_POLICIES)
    assert first is not None and first.at == T0 + GRACE + 600
    assert v115_action(node, reboot_for_repair=True) == "replace"  # XID 79: a replacement in the table
    effects.reconcile(Verdict.of([XID94], T0 + 130), T0 + 700, "boot-1")
    node = cluster.node(name)
    assert due_repair(node, KARPENTER_POLICIES) == first
    assert reason_of(node, "AcceleratedHardwareReady") == "NvidiaXID94Error"
    assert (v115_action(node, reboot_for_repair=True), v115_action(node, reboot_for_repair=False)) == (
        "reboot", "replace")
    # Karpenter reboots the node: a new boot id; the XID 94 finding (replace_node) is still there
    cluster.update_node(name, lambda n: n["status"].setdefault("nodeInfo", {}).update({"bootID": "boot-2"}))
    effects.reconcile(Verdict.of([XID94], T0 + 130), T0 + 1500, "boot-2")
    node = cluster.node(name)
    assert [t["value"] for t in ours(node)] == ["replace_node"]
    assert due_repair(node, KARPENTER_POLICIES) == first  # due again at once: Karpenter acts again
    # the veto, then an operator's clear: nothing left to act on
    cluster.update_node(name, lambda n: n["metadata"].setdefault("annotations", {}).update({DO_NOT_REPAIR: "true"}))
    assert v115_action(cluster.node(name), reboot_for_repair=True) == ""
    cluster.update_node(name, lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: "c1"}))
    effects.reconcile(cleared_by("c1"), T0 + 1600, "boot-2")
    assert due_repair(cluster.node(name), KARPENTER_POLICIES) is None and ours(cluster.node(name)) == []
    no_internal_errors(effects)


@pytest.mark.parametrize("budgets, v115_now", [
    (({"nodes": "1"},), 1),                                   # applies to every reason: one at a time
    (({"nodes": "1", "reasons": ["Drifted", "Empty"]},), 2),  # leaves repair out: no limit from it
    (DEFAULT_BUDGETS, 1),                                     # no budgets: 10% of 10 nodes
    (({"nodes": "0", "reasons": [REPAIR_REASON]},), 0),      # repair held back entirely
], ids=["budget-all-reasons", "budget-drift-empty", "default-budget", "repair-budget-zero"])
def test_v115_paces_the_agents_requests_by_the_nodepool_budget(tmp_path, cluster, budgets, v115_now):  # noqa: F811
    """Two faulty nodes of a 10-node NodePool, the agent's budget per pool (20%) allowing two: both get
    AcceleratedHardwareReady False. v1.14.1 replaces both at once; v1.15.0 starts what the pool's
    budget for repair allows, and the next once the first is done."""
    pool_names = [cluster.name(index) for index in range(10)]
    for name in pool_names:
        cluster.update_node(name, lambda n: n["metadata"]["labels"].update({POOL: "gpu"}))
    cluster.count_gpu_nodes(POOL)  # the counter's count per pool: 20% of 10, two
    fault = Verdict.of([xid_finding(94, Action.REPLACE_NODE, "0000:53:00.0", XID94_LINE)], T0)
    for name in pool_names[:2]:
        agent, _ = effects_for(tmp_path, cluster, node=name, condition_vocabulary="eks",
                               replace_noexecute_grace_seconds=0.0, budget_scope_label=POOL, budget_max_fraction=0.2)
        agent.reconcile(fault, T0, "boot-1")
        no_internal_errors(agent)
    pool = [cluster.node(name) for name in pool_names]
    assert sum(1 for n in pool if due_repair(n, KARPENTER_POLICIES) is not None) == 2
    assert v114_started(pool) == 2
    assert v115_started(pool, budgets) == v115_now
    if v115_now == 1:  # the first repair in flight holds the budget; the second waits for it
        assert v115_started(pool, budgets, disrupting=1) == 0
