"""The DRA admission policy's CEL without an API server (Google's CEL runtime, as for the node
policy): the rule the agent itself builds passes for its own pool; anything else a node's token
might send is denied. tests/dra/test_access_dra_real.py runs the same policy on the real server."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from healthagent.dra.rules import RuleSpec, rule_name
from tests.effects.helpers import TAINT_KEY
from tests.support.admission_cel import PolicyEvaluator, request

POLICY_FILE = Path(__file__).resolve().parents[2] / "deploy" / "components" / "dra" / "admission-policy.yaml"
NODE = "gpu-1"


@pytest.fixture(scope="module")
def policy() -> PolicyEvaluator:
    docs = [d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d]
    return PolicyEvaluator(next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"))


def own(pool: str = NODE, effect: str = "NoSchedule") -> dict:
    return RuleSpec(rule_name(pool, "gpu-3"), "gpu.nvidia.com", pool, "gpu-3", effect, "GPU_XID").body(TAINT_KEY)


def admit(policy, operation: str, old, new, node: str | None = NODE):
    req = {**request(node=node), "operation": operation}
    return policy.admit(req, old, new, resource="devicetaintrules", operation=operation, group="resource.k8s.io")


@pytest.mark.parametrize("effect", ["None", "NoSchedule", "NoExecute"])
def test_the_agents_own_rule_passes_each_operation(policy, effect):
    assert admit(policy, "CREATE", None, own(effect=effect)).allowed
    assert admit(policy, "UPDATE", own(), own(effect=effect)).allowed
    assert admit(policy, "DELETE", own(effect=effect), None).allowed


def _edited(edit) -> dict:
    body = own()
    edit(body)
    return body


@pytest.mark.parametrize("body", [
    own(pool="gpu-2"),
    _edited(lambda b: b["metadata"].pop("labels")),
    _edited(lambda b: b["metadata"]["labels"].update({"app.kubernetes.io/managed-by": "someone"})),
    _edited(lambda b: b["spec"]["deviceSelector"].pop("device")),
    _edited(lambda b: b["spec"]["deviceSelector"].pop("pool")),
    _edited(lambda b: b["spec"]["taint"].update({"key": "example.com/x"})),
    _edited(lambda b: b["spec"]["taint"].update({"effect": "Evict"})),
], ids=["other-pool", "no-labels", "other-manager", "whole-pool", "no-pool", "foreign-key", "unknown-effect"])
def test_what_is_not_its_own_is_denied(policy, body):
    decision = admit(policy, "CREATE", None, body)
    assert decision.applies and not decision.allowed


def test_another_nodes_rule_cannot_be_taken_over_or_deleted(policy):
    assert not admit(policy, "UPDATE", own(pool="gpu-2"), own()).allowed
    assert not admit(policy, "DELETE", own(pool="gpu-2"), None).allowed


def test_a_token_without_a_node_is_denied_and_other_users_are_not_matched(policy):
    assert not admit(policy, "CREATE", None, own(), node=None).allowed
    other = {**request(user="system:serviceaccount:kube-system:dra-driver"), "operation": "CREATE"}
    assert not policy.admit(other, None, own(pool="gpu-2"), resource="devicetaintrules", operation="CREATE",
                            group="resource.k8s.io").applies
