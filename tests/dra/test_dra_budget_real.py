"""A device NoExecute takes the node's disruption-budget slot, on a real kube-apiserver v1.36.

Two nodes share a budget of one slot (no count yet: the limit of an empty cluster), each with a
reset-class XID on one GPU past the grace, with ``scope.noexecute`` on. Proven here: only one
NoExecute DeviceTaintRule stands at a time; the other node's rule stays NoSchedule, held by the
budget (and said so), also once the holder's slot is old enough for the reclaim rule to judge it
(the holder's Node shows its device NoExecute in ``healthagent.io/device-noexecute``); when the
holder's GPU is reset and its rule goes, its slot goes back and the other node takes its step.
"""

from __future__ import annotations

import pytest

from healthagent.effects.budget_reclaim import DEVICE_NO_EXECUTE_ANNOTATION
from healthagent.model import Verdict
from healthagent.policy.scope import ScopePolicy
from tests.dra.slices import gpu_finding
from tests.dra.test_dra_real import GRACE, _agent, _rules, _taints
from tests.effects.helpers import T0

pytestmark = pytest.mark.integration
BUDGET = "budget-dra-pair"
RESTART_BUDGET = "budget-dra-pair-restart"  # not budget-<node> of another test's node
PAST_GRACE = T0 + GRACE + 1


def _effects_of(plane, *nodes: str) -> dict[str, str]:
    return {node: r["spec"]["taint"]["effect"] for node in nodes for r in _rules(plane, node)}


def _annotation(plane, node: str) -> str | None:
    from kubernetes import client

    return (client.CoreV1Api(plane.api_client()).read_node(node).metadata.annotations or {}).get(
        DEVICE_NO_EXECUTE_ANNOTATION)


def _pair(plane, tmp_path, a: str, b: str, budget: str):
    """Two agents of nodes ``a`` and ``b`` sharing the budget in namespace ``budget``, device
    NoExecute on; and a reset-class XID on GPU 3."""
    scope = ScopePolicy(noexecute=True)
    return (_agent(plane, tmp_path / a, a, scope, budget=budget), _agent(plane, tmp_path / b, b, scope, budget=budget),
            Verdict.of([gpu_finding(3)], T0))


def test_only_one_device_noexecute_at_a_time_within_a_budget_of_one(dra_plane, tmp_path):
    a, b = "dra-budget-a", "dra-budget-b"
    first, second, bad = _pair(dra_plane, tmp_path, a, b, BUDGET)
    for effects in (first, second):
        effects.reconcile(bad, T0, "boot-1")
    assert _effects_of(dra_plane, a, b) == {a: "NoSchedule", b: "NoSchedule"}

    first.reconcile(bad, PAST_GRACE, "boot-1")
    second.reconcile(bad, PAST_GRACE, "boot-1")
    assert _effects_of(dra_plane, a, b) == {a: "NoExecute", b: "NoSchedule"}
    assert _annotation(dra_plane, a) == "gpu-3" and _annotation(dra_plane, b) is None
    assert second.status()["held_by_budget"] == [f"gpu.nvidia.com/{b}/gpu-3"]
    status = second.reconcile(bad, PAST_GRACE, "boot-1")
    assert [row[3] for row in status.gpu_quarantines] == ["held_by_budget"] and status.budget_blocked
    assert _taints(dra_plane, a) == [] and _taints(dra_plane, b) == []  # both nodes stay in the job

    # Long past the slot's grace: the held node looks again, judges the holder's slot, and the
    # holder's Node shows its device NoExecute: the slot stands, the second rule stays NoSchedule.
    for step in (100, 400, 1000):
        first.reconcile(bad, PAST_GRACE + step, "boot-1")
        second.reconcile(bad, PAST_GRACE + step, "boot-1")
        assert _effects_of(dra_plane, a, b) == {a: "NoExecute", b: "NoSchedule"}

    first.reconcile(Verdict.of([], PAST_GRACE + 1001), PAST_GRACE + 1001, "boot-1")  # GPU 3 of a was reset
    assert _effects_of(dra_plane, a, b) == {b: "NoSchedule"} and _annotation(dra_plane, a) is None
    second.reconcile(bad, PAST_GRACE + 2000, "boot-1")  # its next look finds the slot free
    assert _effects_of(dra_plane, a, b) == {b: "NoExecute"}
    assert second.status()["held_by_budget"] == [] and _annotation(dra_plane, b) == "gpu-3"
    status = second.reconcile(bad, PAST_GRACE + 2001, "boot-1")
    assert [row[3] for row in status.gpu_quarantines] == ["NoExecute"] and not status.budget_blocked
    first.close()
    second.close()


def _holders(plane, namespace: str = RESTART_BUDGET) -> set[str]:
    from kubernetes import client

    leases = client.CoordinationV1Api(plane.api_client()).list_namespaced_lease(namespace).items
    return {lease.spec.holder_identity for lease in leases
            if lease.metadata.name.startswith("healthagent-budget-slot") and lease.spec.holder_identity}


def test_an_agent_restarted_under_its_device_noexecute_keeps_the_slot(dra_plane, tmp_path):
    """The restarted agent knows nothing of its rules before its first DRA pass; the Node's
    annotation holds the slot meanwhile, so no second node is let in while the eviction stands."""
    from tests.dra.test_dra_real import _effects

    a, b = "dra-pair-restart-a", "dra-pair-restart-b"
    first, second, bad = _pair(dra_plane, tmp_path, a, b, RESTART_BUDGET)
    for now in (T0, PAST_GRACE):
        first.reconcile(bad, now, "boot-1")
    assert _effects_of(dra_plane, a) == {a: "NoExecute"} and _holders(dra_plane) == {a}
    first.close()

    restarted = _effects(dra_plane, tmp_path / f"{a}-again", a, ScopePolicy(noexecute=True), RESTART_BUDGET)  # a fresh state file too
    restarted.startup(PAST_GRACE + 1, "boot-1")
    assert _holders(dra_plane) == {a}
    second.reconcile(bad, PAST_GRACE + 2, "boot-1")
    second.reconcile(bad, PAST_GRACE + 3, "boot-1")
    assert _effects_of(dra_plane, a, b) == {a: "NoExecute", b: "NoSchedule"} and _holders(dra_plane) == {a}
    restarted.reconcile(bad, PAST_GRACE + 4, "boot-1")
    assert _effects_of(dra_plane, a) == {a: "NoExecute"} and _holders(dra_plane) == {a}
    restarted.close()
    second.close()

