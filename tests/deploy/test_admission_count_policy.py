"""The budget's count policy (``healthagent-budget-count``): only the budget counter's service
account, in the Lease's own namespace, may create or update a GPU node count, and only as a
whole number from 0 to 100000. The count sets the budget's limit, so a node's token must never
write it; its CEL evaluated by ``PolicyEvaluator`` (``tests/support/admission_cel.py``). The same
on a real API server with real tokens: tests/deploy/test_budget_attacks.py and
tests/deploy/test_access_real.py."""

from __future__ import annotations

from typing import Any

import pytest

from healthagent.budget_counter import COUNTER_ACCOUNT
from healthagent.effects.budget import COUNT_LEASE, GPU_NODES_ANNOTATION, Scope, counted, new_lease, slot_name
from tests.support.admission_cel import AGENT_USER, Decision, PolicyEvaluator, request
from tests.support.deploy import find

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0
COUNT_POLICY = "healthagent-budget-count"
COUNTER_USER = f"system:serviceaccount:healthagent:{COUNTER_ACCOUNT}"
POOL_COUNT = Scope("karpenter.sh/nodepool", "a").count_name


@pytest.fixture(scope="module")
def count_evaluator(rendered) -> PolicyEvaluator:
    return PolicyEvaluator(find(rendered["generic"], "ValidatingAdmissionPolicy", COUNT_POLICY))


def count_lease(nodes: str, name: str = COUNT_LEASE) -> dict[str, Any]:
    lease = counted(new_lease(name, "healthagent", "count"), 0, "nvidia.com/gpu.present=true", T0)
    lease["metadata"]["annotations"][GPU_NODES_ANNOTATION] = nodes
    return lease


def write(evaluator: PolicyEvaluator, user: str, new: dict[str, Any], node: str | None = None,
          namespace: str = "healthagent", old: dict[str, Any] | None = None) -> Decision:
    token = {**request(user, node), "namespace": namespace}
    return evaluator.admit(token, old, new, resource="leases", operation="CREATE" if old is None else "UPDATE",
                           group="coordination.k8s.io")


@pytest.mark.parametrize("nodes", ["0", "20", "2048", "100000"])
@pytest.mark.parametrize("name", [COUNT_LEASE, POOL_COUNT])
def test_the_counter_records_a_count(count_evaluator, nodes, name):
    assert write(count_evaluator, COUNTER_USER, count_lease(nodes, name)) == Decision(applies=True, allowed=True)
    assert write(count_evaluator, COUNTER_USER, count_lease(nodes, name), old=count_lease("7", name)).allowed


@pytest.mark.parametrize("user,node,namespace", [
    (AGENT_USER, "gpu-1", "healthagent"),  # a node's token: the agent, or whoever stole it
    (AGENT_USER, None, "healthagent"),
    (COUNTER_USER, None, "gpu-health"),  # the counter's name, but another namespace's Lease
    ("system:serviceaccount:gpu-health:healthagent-budget-counter", None, "healthagent"),
    ("kubernetes-admin", None, "healthagent"),
    ("system:node:gpu-1", None, "healthagent"),
])
@pytest.mark.parametrize("name", [COUNT_LEASE, POOL_COUNT])
def test_no_one_else_writes_a_count(count_evaluator, user, node, namespace, name):
    for old in (None, count_lease("2", name)):
        decision = write(count_evaluator, user, count_lease("100000", name), node, namespace, old)
        assert decision.applies and not decision.allowed
        assert decision.messages[0] == (
            f"only the budget counter (service account healthagent-budget-counter in namespace {namespace}) "
            f"may write the GPU node count {name}, not {user}")


@pytest.mark.parametrize("nodes", ["\u00b2", "9" * 401, "100001", "-1", "007", " 12", ""])
def test_the_counter_records_only_a_whole_number_of_nodes(count_evaluator, nodes):
    decision = write(count_evaluator, COUNTER_USER, count_lease(nodes))
    assert decision.applies and decision.messages == (
        "a GPU node count is a whole number from 0 to 100000 (healthagent.io/gpu-nodes)",)
    bare = count_lease("1")
    del bare["metadata"]["annotations"][GPU_NODES_ANNOTATION]
    assert not write(count_evaluator, COUNTER_USER, bare).allowed


def test_slots_and_other_leases_are_not_the_count_policys(count_evaluator):
    slot = new_lease(slot_name(0), "healthagent", "slot")
    assert write(count_evaluator, AGENT_USER, slot, "gpu-1") == Decision(applies=False, allowed=True)
    other = new_lease("kube-scheduler", "healthagent", "slot")
    assert write(count_evaluator, AGENT_USER, other, "gpu-1") == Decision(applies=False, allowed=True)
    spec = find_constraints(count_evaluator)
    assert spec == [{"apiGroups": ["coordination.k8s.io"], "apiVersions": ["v1"],
                     "operations": ["CREATE", "UPDATE"], "resources": ["leases"]}]


def find_constraints(evaluator: PolicyEvaluator) -> list[dict[str, Any]]:
    assert evaluator.spec["failurePolicy"] == "Fail"
    return evaluator.spec["matchConstraints"]["resourceRules"]
