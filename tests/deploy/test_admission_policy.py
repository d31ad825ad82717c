"""The ValidatingAdmissionPolicies: an agent may change only its own node, and only what it owns
(``healthagent-own-node-only``), may write Events only about its own node
(``healthagent-own-node-events``), and may hold the disruption budget's Leases only in its own
name or give back its own (``healthagent-own-budget-slot``).

Here, with no API server at all, the policies' CEL is evaluated by ``PolicyEvaluator``
(``tests/support/admission_cel.py``; ``test_access_real.py`` runs the same policies in a real kube-apiserver where its binaries are
installed, and skips elsewhere), with Google's CEL implementation (``cel-expr-python``, the C++
runtime; Kubernetes uses the Go one, same language). The evaluator is a fake of the API server's
admission step and honours its order: matchConstraints (group, resource and operation),
matchConditions, then the variables in declaration order (visible as ``variables.<name>``), then
every validation; an expression that errors counts as the policy's failurePolicy says. What it
leaves out: objects are untyped here (Kubernetes types them from the OpenAPI schema, so
``test_policy_paths_exist_in_the_node_schema`` and ``test_event_policy_paths_exist_in_the_event_
schema`` check every field path against the Kubernetes 1.30 schema instead), the Kubernetes CEL
extension libraries (the policies use none: an unknown function fails compilation here), the cost
budget, the ``authorizer``/``params`` variables (the policies use neither), and ``matchPolicy:
Equivalent``'s conversion of a core/v1 Event into events.k8s.io/v1 (``test_access_real.py``
checks that on the real API server).
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any

import pytest
import yaml

from tests.support.admission_cel import (
    AGENT_USER,
    EVENT_POLICY,
    LEASE_POLICY,
    NODE_NAME_EXTRA,
    NODE_POLICY,
    Decision,
    PolicyEvaluator,
    _definitions,
    _properties,
    node,
    request,
)
from tests.support.deploy import DEPLOY, REPO, find, oldest_kubectl_binary, render

pytestmark = pytest.mark.integration


# -- structure --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [NODE_POLICY, EVENT_POLICY, LEASE_POLICY])
def test_binding_denies_through_the_policy(rendered, name):
    for objects in rendered.values():
        binding = find(objects, "ValidatingAdmissionPolicyBinding", name)
        assert binding["spec"] == {"policyName": name, "validationActions": ["Deny"]}
        assert find(objects, "ValidatingAdmissionPolicy", name)["spec"]["failurePolicy"] == "Fail"


def test_policy_fails_closed_on_node_updates_only(policy):
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert "paramKind" not in spec
    assert spec["matchConstraints"]["resourceRules"] == [{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
        "resources": ["nodes", "nodes/status"]}]


def test_policy_covers_every_verb_that_writes_nodes(rendered, policy):
    """RBAC lets the agent only patch nodes: admission sees a patch as an UPDATE, which is matched."""
    rules = find(rendered["generic"], "ClusterRole", "healthagent")["rules"]
    writes = {(resource, verb) for rule in rules if rule["apiGroups"] == [""]
              for resource in rule["resources"] for verb in rule["verbs"]
              if verb not in ("get", "list", "watch")}
    matched = policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"]
    assert writes == {("nodes", "patch"), ("nodes/status", "patch")}
    assert {resource for resource, _ in writes} <= set(matched)


def test_policy_paths_exist_in_the_node_schema(policy):
    """Kubernetes type-checks the CEL against the Node schema: a field that does not exist in the
    oldest supported version (1.30) would make every agent write fail (failurePolicy: Fail)."""
    defs = _definitions("1.30.0")
    parts = {
        "metadata": _properties(defs, "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
        "spec": _properties(defs, "io.k8s.api.core.v1.NodeSpec"),
        "status": _properties(defs, "io.k8s.api.core.v1.NodeStatus"),
    }
    text = json.dumps(policy["spec"])
    paths = set(re.findall(r"\b(?:object|oldObject)\.(metadata|spec|status)(?:\.(\w+))?", text))
    assert {part for part, _ in paths} == {"metadata", "spec", "status"}
    missing = [f"{part}.{field}" for part, field in paths if field and field not in parts[part]]
    assert missing == []
    assert {"key", "effect"} <= set(_properties(defs, "io.k8s.api.core.v1.Taint"))
    assert "type" in _properties(defs, "io.k8s.api.core.v1.NodeCondition")
    assert "extra" in _properties(defs, "io.k8s.api.authentication.v1.UserInfo")


@pytest.fixture(scope="module")
def evaluator(policy) -> PolicyEvaluator:
    return PolicyEvaluator(policy)


def changed(edit) -> tuple[dict[str, Any], dict[str, Any]]:
    old = node()
    new = copy.deepcopy(old)
    edit(new)
    return old, new


OWN_TAINT = {"key": "healthagent.io/unhealthy", "value": "replace_node", "effect": "NoSchedule"}


def add_own_taint(n):
    n["spec"]["taints"].append(dict(OWN_TAINT))


def own_taint_to_noexecute(n):
    n["spec"]["taints"].append({**OWN_TAINT, "effect": "NoExecute", "timeAdded": "2025-01-01T00:00:00Z"})


def reorder_foreign_taints(n):
    n["spec"]["taints"].reverse()
    n["spec"]["taints"].append(dict(OWN_TAINT))


def set_labels(n):
    n["metadata"]["labels"].update({
        "healthagent.io/health": "replace_node",
        "sagemaker.amazonaws.com/node-health-status": "UnschedulablePendingReplacement",
        "sagemaker.amazonaws.com/fault-types": "GpuXid",
        "sagemaker.amazonaws.com/fault-reasons": "Xid94",
    })


def remove_own_label(n):
    del n["metadata"]["labels"]["healthagent.io/health"]


def set_annotations(n):
    n["metadata"]["annotations"]["healthagent.io/findings"] = "GPU_XID:3"
    n["metadata"]["annotations"]["sagemaker.amazonaws.com/fault-details"] = "[]"


def set_own_conditions(n):
    n["status"]["conditions"][1] = {"type": "GpuHealthy", "status": "False", "reason": "GPU_XID",
                                    "message": "XID 94 on GPU 3"}
    n["status"]["conditions"].append({"type": "NetworkHealthy", "status": "True", "reason": "NoFindings",
                                      "message": "ok"})


ALLOWED = {
    "nothing changes": lambda n: None,
    "add its own NoSchedule taint": add_own_taint,
    "add its own NoExecute taint": own_taint_to_noexecute,
    "reorder foreign taints while adding its own": reorder_foreign_taints,
    "set its own and HyperPod's labels": set_labels,
    "remove its own label": remove_own_label,
    "set its own and HyperPod's annotations": set_annotations,
    "set GpuHealthy and add NetworkHealthy": set_own_conditions,
}


def cordon(n):
    n["spec"]["unschedulable"] = True


def foreign_taint_added(n):
    n["spec"]["taints"].append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})


def foreign_taint_removed(n):
    n["spec"]["taints"].pop(0)


def foreign_taint_effect_changed(n):
    n["spec"]["taints"][1]["effect"] = "NoExecute"


def lookalike_taint(n):
    n["spec"]["taints"].append({"key": "evil.healthagent.io/x", "effect": "NoExecute"})


def foreign_label_changed(n):
    n["metadata"]["labels"]["nvidia.com/gpu.present"] = "false"


def foreign_label_removed(n):
    del n["metadata"]["labels"]["kubernetes.io/hostname"]


def foreign_label_added(n):
    n["metadata"]["labels"]["node-role.kubernetes.io/control-plane"] = ""


def lookalike_label(n):
    n["metadata"]["labels"]["healthagent.io.example.com/x"] = "1"


def foreign_annotation_changed(n):
    n["metadata"]["annotations"]["node.alpha.kubernetes.io/ttl"] = "30"


def ready_condition_changed(n):
    n["status"]["conditions"][0]["status"] = "False"


def foreign_condition_added(n):
    n["status"]["conditions"].append({"type": "KernelDeadlock", "status": "True", "reason": "x", "message": "y"})


def foreign_condition_removed(n):
    del n["status"]["conditions"][0]


def allocatable_changed(n):
    n["status"]["allocatable"]["nvidia.com/gpu"] = "0"


def provider_id_changed(n):
    n["spec"]["providerID"] = "aws:///us-east-1a/i-0fff"


def pod_cidr_set(n):
    n["spec"]["podCIDR"] = "10.0.0.0/24"
    n["spec"]["podCIDRs"] = ["10.0.0.0/24"]


def addresses_set(n):
    n["status"]["addresses"] = [{"type": "InternalIP", "address": "10.9.9.9"}]


def boot_id_forged(n):
    # status.nodeInfo.bootID is what ends a reboot_node taint: a node's token must not fake a reboot
    n["status"]["nodeInfo"] = {"bootID": "forged-boot"}


def kubelet_port_changed(n):
    n["status"]["daemonEndpoints"] = {"kubeletEndpoint": {"Port": 1}}


def images_listed(n):
    n["status"]["images"] = [{"names": ["registry.example/evil:latest"], "sizeBytes": 1}]


DENIED = {
    "change the provider id": (provider_id_changed, "in a node's spec"),
    "set the pod CIDRs": (pod_cidr_set, "in a node's spec"),
    "set the node's addresses": (addresses_set, "in a node's status"),
    "forge the boot id": (boot_id_forged, "in a node's status"),
    "change the kubelet's port": (kubelet_port_changed, "in a node's status"),
    "list images": (images_listed, "in a node's status"),
    "cordon the node": (cordon, "cordon"),
    "add a foreign taint": (foreign_taint_added, "taints"),
    "remove a foreign taint": (foreign_taint_removed, "taints"),
    "change a foreign taint's effect": (foreign_taint_effect_changed, "taints"),
    "a taint key that only contains healthagent.io": (lookalike_taint, "taints"),
    "change a foreign label": (foreign_label_changed, "labels"),
    "remove a foreign label": (foreign_label_removed, "labels"),
    "add a foreign label": (foreign_label_added, "labels"),
    "a label key that only starts like healthagent.io": (lookalike_label, "labels"),
    "change a foreign annotation": (foreign_annotation_changed, "annotations"),
    "change the Ready condition": (ready_condition_changed, "GpuHealthy and NetworkHealthy"),
    "add a foreign condition": (foreign_condition_added, "GpuHealthy and NetworkHealthy"),
    "remove a foreign condition": (foreign_condition_removed, "GpuHealthy and NetworkHealthy"),
    "change allocatable GPUs": (allocatable_changed, "allocatable"),
}


@pytest.mark.parametrize("edit", list(ALLOWED.values()), ids=list(ALLOWED))
@pytest.mark.parametrize("resource", ["nodes", "nodes/status"])
def test_agent_may_change_what_it_owns_on_its_own_node(evaluator, edit, resource):
    old, new = changed(edit)
    assert evaluator.admit(request(), old, new, resource) == Decision(applies=True, allowed=True)


@pytest.mark.parametrize("edit,reason", list(DENIED.values()), ids=list(DENIED))
def test_agent_may_not_change_what_others_own(evaluator, edit, reason):
    old, new = changed(edit)
    decision = evaluator.admit(request(), old, new)
    assert decision.applies and not decision.allowed
    assert len(decision.messages) == 1 and reason in decision.messages[0], decision.messages


def test_agent_may_not_touch_another_node(evaluator):
    old, new = node("gpu-2"), node("gpu-2")
    add_own_taint(new)
    decision = evaluator.admit(request(node="gpu-1"), old, new)
    assert not decision.allowed
    assert decision.messages == ("healthagent on node gpu-1 may change only its own node, not gpu-2",)


@pytest.mark.parametrize("token", [
    pytest.param(request(node=None), id="token without extra (Kubernetes < 1.30)"),
    pytest.param({**request(), "userInfo": {**request()["userInfo"], "extra": {}}}, id="empty extra"),
    pytest.param({**request(), "userInfo": {**request()["userInfo"], "extra": {NODE_NAME_EXTRA: []}}},
                 id="node-name extra without a value"),
])
def test_a_token_without_a_node_changes_nothing(evaluator, token):
    old, new = changed(add_own_taint)
    decision = evaluator.admit(token, old, new)
    assert not decision.allowed
    assert "token names no node" in decision.messages[0]


def test_a_node_without_labels_taints_or_conditions(evaluator):
    """Absent maps and lists are handled (has()), not evaluation errors that would deny everything."""
    old = {"metadata": {"name": "gpu-1"}, "spec": {}, "status": {}}
    new = copy.deepcopy(old)
    new["spec"]["taints"] = [dict(OWN_TAINT)]
    new["metadata"]["labels"] = {"healthagent.io/health": "replace_node"}
    new["status"]["conditions"] = [{"type": "GpuHealthy", "status": "False", "reason": "r", "message": "m"}]
    assert evaluator.admit(request(), old, new) == Decision(applies=True, allowed=True)
    old_bare = {"metadata": {"name": "gpu-1"}, "spec": {}}
    assert evaluator.admit(request(), old_bare, copy.deepcopy(old_bare)) == Decision(applies=True, allowed=True)


def test_several_violations_are_all_reported(evaluator):
    old, new = changed(lambda n: (cordon(n), foreign_label_changed(n)))
    decision = evaluator.admit(request(), old, new)
    assert not decision.allowed and len(decision.messages) == 2


@pytest.mark.parametrize("user,applies", [
    (AGENT_USER, True),
    ("system:serviceaccount:gpu-health:healthagent", True),  # a renamed namespace keeps the policy
    ("system:node:gpu-1", False),  # the kubelet
    ("system:serviceaccount:kube-system:node-controller", False),
    ("system:serviceaccount:healthagent:healthagent-other", False),
    ("admin", False),
])
def test_policy_applies_to_agent_service_accounts_only(evaluator, user, applies):
    old, new = changed(cordon)
    decision = evaluator.admit(request(user=user), old, new)
    assert decision.applies is applies
    assert decision.allowed is (not applies)


def test_other_resources_and_operations_are_not_matched(evaluator):
    old, new = changed(cordon)
    assert evaluator.admit(request(), old, new, resource="pods").applies is False
    assert evaluator.admit(request(), old, new, operation="CREATE").applies is False


def test_the_documented_older_cluster_overlay_leaves_out_every_policy(kubectl, tmp_path):
    """docs/install.md's "Older clusters" patches, applied to the generic overlay, remove every
    ValidatingAdmissionPolicy and Binding (a policy added later must be added there too), with the
    test extra's kubectl and with kubectl 1.30 where it is installed (tests/support/oldest_kubectl.py)."""
    text = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
    section = text.split("### Older clusters", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [os.path.relpath(DEPLOY / "overlays" / "generic", tmp_path.resolve())],
                     **yaml.safe_load(block)}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization), encoding="utf-8")
    for binary in filter(None, (kubectl, oldest_kubectl_binary())):
        objects = render(tmp_path, binary)
        assert [o for o in objects if o["kind"].startswith("ValidatingAdmissionPolicy")] == [], binary
        assert find(objects, "ClusterRole", "healthagent")
