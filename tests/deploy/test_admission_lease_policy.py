"""The budget's Lease policy (``healthagent-own-budget-slot``): the agent may hold the disruption
budget's Leases only in its own name or give back its own; its CEL evaluated by ``PolicyEvaluator``
(``tests/support/admission_cel.py``, see ``test_admission_policy.py`` for what that fake honours)."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from healthagent.effects.budget import (
    held_lease,
    new_lease,
    released_lease,
    slot_name,
)
from tests.support.admission_cel import (AGENT_USER, NODE_NAME_EXTRA, Decision, PolicyEvaluator, _definitions,
                                         _properties, request)

pytestmark = pytest.mark.integration


# -- the budget's Leases ---------------------------------------------------------------------------

T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def lease_evaluator(lease_policy) -> PolicyEvaluator:
    return PolicyEvaluator(lease_policy)


def test_lease_policy_fails_closed_on_lease_writes_only(lease_policy):
    spec = lease_policy["spec"]
    assert spec["failurePolicy"] == "Fail" and "paramKind" not in spec
    assert spec["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["coordination.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
        "resources": ["leases"]}]


def test_all_three_policies_agree_on_who_the_agent_is(policy, lease_policy):
    bound = [next(v for v in p["spec"]["variables"] if v["name"] == "boundNode") for p in (policy, lease_policy)]
    assert lease_policy["spec"]["matchConditions"] == policy["spec"]["matchConditions"]
    assert bound[0] == bound[1]


def test_lease_policy_paths_exist_in_the_lease_schema(lease_policy):
    defs = _definitions("1.30.0")
    parts = {"metadata": _properties(defs, "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
             "spec": _properties(defs, "io.k8s.api.coordination.v1.LeaseSpec")}
    text = json.dumps(lease_policy["spec"])
    paths = set(re.findall(r"\b(?:object|oldObject)\.(metadata|spec)(?:\.(\w+))?", text))
    assert {part for part, _ in paths} == {"metadata", "spec"}
    assert [f"{part}.{field}" for part, field in paths if field and field not in parts[part]] == []


def slot(holder: str = "", index: int = 3) -> dict[str, Any]:
    """A slot Lease as the API server holds it (held by ``holder``, or free)."""
    lease = new_lease(slot_name(index), "healthagent", "slot")
    lease["metadata"]["resourceVersion"] = "77"
    return held_lease(lease, holder, T0 - 600, acquired=True) if holder else lease


def write_lease(evaluator: PolicyEvaluator, old: dict[str, Any] | None, new: dict[str, Any],
                token: dict[str, Any] | None = None) -> Decision:
    return evaluator.admit(token or request(), old, new, resource="leases",
                           operation="CREATE" if old is None else "UPDATE", group="coordination.k8s.io")


LEASES_ALLOWED = {
    "create a slot in its own name": lambda: (None, held_lease(new_lease(slot_name(0), "healthagent", "slot"),
                                                               "gpu-1", T0, acquired=True)),
    "take a free slot": lambda: (slot(), held_lease(slot(), "gpu-1", T0, acquired=True)),
    "reclaim another node's (stale) slot": lambda: (slot("gpu-2"), held_lease(slot("gpu-2"), "gpu-1", T0,
                                                                               acquired=True)),
    "re-write its own slot": lambda: (slot("gpu-1"), held_lease(slot("gpu-1"), "gpu-1", T0, acquired=False)),
    "give back its own slot": lambda: (slot("gpu-1"), released_lease(slot("gpu-1"))),
}


@pytest.mark.parametrize("make", list(LEASES_ALLOWED.values()), ids=list(LEASES_ALLOWED))
def test_agent_may_hold_budget_leases_as_itself_and_give_back_its_own(lease_evaluator, make):
    old, new = make()
    assert write_lease(lease_evaluator, old, new) == Decision(applies=True, allowed=True)


def named(lease: dict[str, Any], name: str) -> dict[str, Any]:
    lease = copy.deepcopy(lease)
    lease["metadata"]["name"] = name
    return lease


HOLD_ONLY = "healthagent on node gpu-1 may hold a budget Lease only in its own name or give back its own, "
LEASES_DENIED = {
    "create a slot in another node's name": (
        None, held_lease(new_lease(slot_name(0), "healthagent", "slot"), "gpu-2", T0, acquired=True),
        HOLD_ONLY + "not hold healthagent-budget-slot-0 as gpu-2"),
    "take a free slot for another node": (
        slot(), held_lease(slot(), "gpu-2", T0, acquired=True), HOLD_ONLY + "not hold healthagent-budget-slot-3 as gpu-2"),
    "give back another node's slot": (
        slot("gpu-2"), released_lease(slot("gpu-2")), HOLD_ONLY + "not give back healthagent-budget-slot-3 held by gpu-2"),
    "rewrite another node's slot in its name": (
        slot("gpu-2"), held_lease(slot("gpu-2"), "gpu-2", T0, acquired=False),
        HOLD_ONLY + "not hold healthagent-budget-slot-3 as gpu-2"),
    "write a free slot (no holder before or after)": (
        slot(), {**slot(), "metadata": {**slot()["metadata"], "labels": {}}},
        HOLD_ONLY + "not give back healthagent-budget-slot-3 held by nobody"),
    "create a free slot": (None, new_lease(slot_name(4), "healthagent", "slot"),
                           HOLD_ONLY + "not give back healthagent-budget-slot-4 held by nobody"),
    "a Lease that is not the budget's (a node's heartbeat)": (
        None, named(held_lease(new_lease("gpu-2", "healthagent", "slot"), "gpu-1", T0, acquired=True), "gpu-2"),
        "healthagent may write only the budget Leases healthagent-budget-*, not Lease gpu-2"),
    "a leader-election Lease in its own name": (
        None, named(held_lease(new_lease("x", "healthagent", "slot"), "gpu-1", T0, acquired=True), "kube-scheduler"),
        "healthagent may write only the budget Leases healthagent-budget-*, not Lease kube-scheduler"),
}


@pytest.mark.parametrize("old,new,reason", list(LEASES_DENIED.values()), ids=list(LEASES_DENIED))
def test_agent_may_not_hold_or_give_back_slots_for_others(lease_evaluator, old, new, reason):
    decision = write_lease(lease_evaluator, old, new)
    assert decision.applies and not decision.allowed
    assert decision.messages == (reason,), decision.messages


def test_a_lease_without_spec_is_handled_not_an_evaluation_error(lease_evaluator):
    bare = {"metadata": {"name": slot_name(1)}}
    decision = write_lease(lease_evaluator, slot("gpu-1"), bare)
    assert decision == Decision(applies=True, allowed=True)  # giving back its own, spec and all
    decision = write_lease(lease_evaluator, None, bare)
    assert not decision.allowed and "held by nobody" in decision.messages[0]


@pytest.mark.parametrize("token", [
    pytest.param(request(node=None), id="token without extra"),
    pytest.param({**request(), "userInfo": {**request()["userInfo"], "extra": {NODE_NAME_EXTRA: []}}},
                 id="node-name extra without a value"),
])
def test_a_token_without_a_node_holds_no_slot(lease_evaluator, token):
    decision = write_lease(lease_evaluator, slot(), held_lease(slot(), "", T0, acquired=True), token)
    assert not decision.allowed
    assert decision.messages == (
        "healthagent: the service-account token names no node (Kubernetes 1.30+ with "
        "ServiceAccountTokenPodNodeInfo is required); refusing to write Lease healthagent-budget-slot-3",)


@pytest.mark.parametrize("user,applies", [
    (AGENT_USER, True),
    ("system:serviceaccount:gpu-health:healthagent", True),
    ("system:node:gpu-2", False),  # the kubelet renews its heartbeat Lease
    ("system:serviceaccount:kube-system:leader-election", False),
    ("admin", False),
])
def test_lease_policy_applies_to_agent_service_accounts_only(lease_evaluator, user, applies):
    decision = write_lease(lease_evaluator, slot(), held_lease(slot(), "gpu-2", T0, acquired=True),
                           request(user=user))
    assert (decision.applies, decision.allowed) == (applies, not applies)


def test_lease_policy_leaves_other_operations_alone(lease_evaluator):
    assert lease_evaluator.admit(request(), slot("gpu-2"), slot("gpu-2"), resource="leases", operation="DELETE",
                                 group="coordination.k8s.io").applies is False
