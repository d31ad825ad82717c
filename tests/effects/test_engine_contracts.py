"""Contract tests: a scripted incident timeline, and at every step what each replacement engine,
as released, would do with the node the agent left.

The oracles hold each engine's documented semantics, not the agent's:

- Karpenter v1.14.1 node repair with the AWS provider's policies (feature gate ``NodeRepair``):
  a node whose ``AcceleratedHardwareReady`` has been ``False`` for 10 minutes, or
  ``NetworkingReady`` for 30, counted from the condition's ``lastTransitionTime``, is replaced;
  type and status only, never the reason; no repair in a NodePool where more than 20% of the
  nodes (rounded up) are unhealthy.
- EKS managed node groups' node auto repair: ``AcceleratedHardwareReady`` ``False`` for 10 minutes
  (reboot or replace, by reason), ``NetworkingReady`` for 30 (replace); nothing while more than
  20% of a group of more than five nodes is unhealthy.
- SageMaker HyperPod: acts as soon as ``node-health-status`` says ``UnschedulablePending*``.

Each runs on the fake and on a real API server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from healthagent.effects.api_time import parse_rfc3339
from healthagent.effects.hyperpod import HYPERPOD_HEALTH_LABEL, HYPERPOD_PENDING_REBOOT, HYPERPOD_PENDING_REPLACEMENT
from healthagent.effects.node_desired import CLEAR_ANNOTATION
from healthagent.model import Action, Finding, Verdict
from tests.effects.helpers import T0, cleared_by
from tests.effects.test_scenarios import (  # noqa: F401 (cluster, fake_or_none: fixtures)
    XID79_LINE,
    XID94_LINE,
    cluster,
    effects_for,
    fake_or_none,
    no_internal_errors,
    ours,
    xid_finding,
)

pytestmark = pytest.mark.integration

GRACE = 120.0
KARPENTER_POLICIES = {"AcceleratedHardwareReady": ("False", 600.0), "NetworkingReady": ("False", 1800.0)}
NODE_GROUP_POLICIES = {"AcceleratedHardwareReady": ("False", 600.0), "NetworkingReady": ("False", 1800.0)}


@dataclass(frozen=True)
class Repair:
    condition: str
    at: float  # wall time the engine acts, by the condition's lastTransitionTime


def due_repair(node: dict, policies: dict[str, tuple[str, float]]) -> Repair | None:
    """When an engine acting on conditions (type and status only) would repair ``node``: the
    earliest matching condition's lastTransitionTime plus its toleration; None: never, as it is."""
    due = []
    for cond in (node.get("status") or {}).get("conditions") or []:
        status, wait = policies.get(cond.get("type"), (None, 0.0))
        since = parse_rfc3339(cond.get("lastTransitionTime"))
        if status is not None and cond.get("status") == status and since is not None:
            due.append(Repair(cond["type"], since + wait))
    return min(due, key=lambda r: r.at, default=None)


def karpenter_pool_allows(nodes: list[dict]) -> bool:
    """Karpenter repairs in a NodePool only while at most 20% (rounded up) of it is unhealthy."""
    unhealthy = sum(1 for n in nodes if due_repair(n, KARPENTER_POLICIES) is not None)
    return unhealthy <= math.ceil(0.2 * len(nodes))


def hyperpod_acts(node: dict) -> str:
    value = (node["metadata"].get("labels") or {}).get(HYPERPOD_HEALTH_LABEL, "")
    return {HYPERPOD_PENDING_REBOOT: "reboot", HYPERPOD_PENDING_REPLACEMENT: "replace"}.get(value, "")


def efa_missing(at: float) -> Finding:
    return Finding(code="EFA_DEVICE_MISSING", action=Action.REBOOT_NODE, summary="EFA device rdmap79s0 missing",
                   evidence="31 EFA devices read, expected 32", next_steps="reboot", fabric_device="rdmap79s0",
                   first_seen=at, last_seen=at, id=2)


PCI = "0000:29:00.0"
XID79 = xid_finding(79, Action.REBOOT_NODE, PCI, XID79_LINE)
XID94 = xid_finding(94, Action.REPLACE_NODE, PCI, XID94_LINE)  # the same incident, escalated


def test_an_incident_timeline_under_karpenter_node_groups_and_hyperpod(tmp_path, cluster):  # noqa: F811
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster, condition_vocabulary="eks", hyperpod_labels=True,
                             replace_noexecute_grace_seconds=GRACE)

    def at(now: float, verdict: Verdict) -> dict:
        effects.reconcile(verdict, now, "boot-1")
        return cluster.node(name)

    # XID 79: NoSchedule; no engine is asked before the job's grace is over
    node = at(T0, Verdict.of([XID79], T0))
    assert due_repair(node, KARPENTER_POLICIES) is None and hyperpod_acts(node) == ""
    # the grace is over: Karpenter replaces 10 minutes from now, a node group too, HyperPod reboots at once
    node = at(T0 + GRACE, Verdict.of([XID79], T0))
    first = due_repair(node, KARPENTER_POLICIES)
    assert first == Repair("AcceleratedHardwareReady", T0 + GRACE + 600)
    assert due_repair(node, NODE_GROUP_POLICIES) == first and hyperpod_acts(node) == "reboot"
    # XID 94 on the same GPU: the repair Karpenter scheduled stays where it was; HyperPod's becomes a replacement
    for now in (T0 + 130, T0 + 131, T0 + 300, T0 + 700):
        node = at(now, Verdict.of([XID94], T0 + 130))
        assert due_repair(node, KARPENTER_POLICIES) == first, now - T0
        assert [(t["value"], t["effect"]) for t in ours(node)] == [("replace_node", "NoExecute")]
    assert hyperpod_acts(node) == "replace"
    # an EFA fault as well: NetworkingReady False too; the earliest repair is still the first
    node = at(T0 + 710, Verdict.of([XID94, efa_missing(T0 + 710)], T0 + 710))
    net = next(c for c in node["status"]["conditions"] if c["type"] == "NetworkingReady")
    assert net["status"] == "False" and due_repair(node, KARPENTER_POLICIES) == first
    # an operator clears the node: no engine has anything left to act on
    cluster.update_node(name, lambda n: n["metadata"].setdefault("annotations", {}).update({CLEAR_ANNOTATION: "c1"}))
    node = at(T0 + 720, cleared_by("c1"))
    assert due_repair(node, KARPENTER_POLICIES) is None and hyperpod_acts(node) == "" and ours(node) == []
    no_internal_errors(effects)


def test_a_reboot_ends_a_reboot_request_and_no_engine_acts_after_it(tmp_path, cluster):  # noqa: F811
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster, condition_vocabulary="eks", hyperpod_labels=True,
                             replace_noexecute_grace_seconds=GRACE)
    effects.reconcile(Verdict.of([XID79], T0), T0, "boot-1")
    effects.reconcile(Verdict.of([XID79], T0), T0 + GRACE, "boot-1")
    assert hyperpod_acts(cluster.node(name)) == "reboot"
    cluster.update_node(name, lambda n: n["status"].setdefault("nodeInfo", {}).update({"bootID": "boot-2"}))
    effects.reconcile(Verdict.of([], T0 + 900), T0 + 900, "boot-2")
    node = cluster.node(name)
    assert ours(node) == [] and due_repair(node, KARPENTER_POLICIES) is None and hyperpod_acts(node) == ""
    no_internal_errors(effects)


POOL = "karpenter.sh/nodepool"


@pytest.mark.parametrize("scoped", [True, False], ids=["budget-per-pool", "budget-per-fleet"])
def test_the_budget_never_pushes_a_pool_past_karpenters_20_percent(tmp_path, cluster, scoped):  # noqa: F811
    """A small pool of 5 beside a large one of 45, all 5 of the small pool faulty at once. Counted
    per pool (10% of 5: one node), the agent asks Karpenter to repair one node and Karpenter can.
    Counted for the fleet (10% of 50: five), it asks for all five: Karpenter then repairs none."""
    for index in range(10, 50):  # the fixture made 10
        cluster.create_node(cluster.name(index))
    for index in range(50):
        value = "small" if index < 5 else "large"
        cluster.update_node(cluster.name(index), lambda n, v=value: n["metadata"]["labels"].update({POOL: v}))
    small = [cluster.name(index) for index in range(5)]
    cluster.count_gpu_nodes(POOL if scoped else "")
    extra = {"budget_scope_label": POOL} if scoped else {}
    fault = Verdict.of([xid_finding(94, Action.REPLACE_NODE, "0000:53:00.0", XID94_LINE)], T0)
    for node in small:
        agent, _ = effects_for(tmp_path, cluster, node=node, condition_vocabulary="eks",
                               replace_noexecute_grace_seconds=0.0, **extra)
        agent.reconcile(fault, T0, "boot-1")
        no_internal_errors(agent)
    pool = [cluster.node(n) for n in small]
    asked = sum(1 for n in pool if due_repair(n, KARPENTER_POLICIES) is not None)
    if scoped:
        assert asked == 1 and karpenter_pool_allows(pool)
    else:
        assert asked == 5 and not karpenter_pool_allows(pool)  # why budget_scope_label exists
