"""The ValidatingAdmissionPolicies: an agent may change only its own node, and only what it owns
(``healthagent-own-node-only``), may write Events only about its own node
(``healthagent-own-node-events``), and may hold the disruption budget's Leases only in its own
name or give back its own (``healthagent-own-budget-slot``).

Here, with no API server at all, the policies' CEL is evaluated by ``PolicyEvaluator`` below
(``test_access_real.py`` runs the same policies in a real kube-apiserver where its binaries are
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
from dataclasses import dataclass
from importlib import resources
from typing import Any

import pytest
import yaml

from healthagent.effects.budget import (
    COUNT_LEASE,
    GPU_NODES_ANNOTATION,
    claimed_count,
    counted,
    held_lease,
    new_lease,
    released_lease,
    slot_name,
)
from healthagent.effects.events import REPORTING_CONTROLLER, EventSpec, event_body
from tests.support.deploy import DEPLOY, REPO, find, oldest_kubectl_binary, render

pytestmark = pytest.mark.integration

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
AGENT_USER = "system:serviceaccount:healthagent:healthagent"
NODE_POLICY = "healthagent-own-node-only"
EVENT_POLICY = "healthagent-own-node-events"
LEASE_POLICY = "healthagent-own-budget-slot"


@pytest.fixture(scope="module")
def policy(rendered) -> dict[str, Any]:
    return find(rendered["generic"], "ValidatingAdmissionPolicy", NODE_POLICY)


@pytest.fixture(scope="module")
def event_policy(rendered) -> dict[str, Any]:
    return find(rendered["generic"], "ValidatingAdmissionPolicy", EVENT_POLICY)


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


def _definitions(version: str) -> dict[str, Any]:
    root = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
    return json.loads((root / "_definitions.json").read_text(encoding="utf-8"))["$defs"]


def _properties(defs: dict[str, Any], name: str) -> dict[str, Any]:
    return defs[name]["properties"]


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


# -- behaviour ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    applies: bool
    allowed: bool
    messages: tuple[str, ...] = ()


class PolicyEvaluator:
    """A fake of kube-apiserver's admission step for one ValidatingAdmissionPolicy (see the module
    docstring for what it honours and leaves out)."""

    def __init__(self, policy: dict[str, Any]) -> None:
        cel = pytest.importorskip(
            "cel_expr_python.cel", reason="cel-expr-python not installed (CEL runtime for the policy test)")
        dyn = cel.Type.DYN
        self.env = cel.NewEnv(variables={"object": dyn, "oldObject": dyn, "request": dyn,
                                         "variables": cel.Type.Map(cel.Type.STRING, dyn)})
        self.spec = policy["spec"]
        self.conditions = [self.env.compile(c["expression"]) for c in self.spec.get("matchConditions", [])]
        self.variables = [(v["name"], self.env.compile(v["expression"])) for v in self.spec["variables"]]
        self.validations = [
            (self.env.compile(v["expression"]),
             self.env.compile(v["messageExpression"]) if "messageExpression" in v else None,
             v.get("message", ""))
            for v in self.spec["validations"]]
        self.error_type = cel.Type.ERROR

    def _eval(self, expression, data: dict[str, Any]) -> Any:
        result = expression.eval(data=data)
        if result.type() == self.error_type:
            raise RuntimeError(str(result.value()))
        return result.plain_value()

    def matches(self, resource: str, operation: str, group: str = "") -> bool:
        return any(group in rule["apiGroups"] and resource in rule["resources"] and operation in rule["operations"]
                   for rule in self.spec["matchConstraints"]["resourceRules"])

    def admit(self, request: dict[str, Any], old: dict[str, Any] | None, new: dict[str, Any],
              resource: str = "nodes", operation: str = "UPDATE", group: str = "") -> Decision:
        data: dict[str, Any] = {"request": request, "oldObject": old, "object": new, "variables": {}}
        if not self.matches(resource, operation, group):
            return Decision(applies=False, allowed=True)
        try:
            if not all(self._eval(c, data) is True for c in self.conditions):
                return Decision(applies=False, allowed=True)
            for name, expression in self.variables:
                data["variables"] = {**data["variables"], name: self._eval(expression, data)}
            messages = []
            for expression, message_expression, message in self.validations:
                if self._eval(expression, data) is not True:
                    messages.append(self._eval(message_expression, data) if message_expression else message)
        except RuntimeError as exc:  # failurePolicy: Fail
            return Decision(applies=True, allowed=False, messages=(f"evaluation error: {exc}",))
        return Decision(applies=True, allowed=not messages, messages=tuple(messages))


@pytest.fixture(scope="module")
def evaluator(policy) -> PolicyEvaluator:
    return PolicyEvaluator(policy)


def request(user: str = AGENT_USER, node: str | None = "gpu-1") -> dict[str, Any]:
    info: dict[str, Any] = {"username": user, "uid": "1234", "groups": ["system:serviceaccounts"]}
    if node is not None:
        info["extra"] = {NODE_NAME_EXTRA: [node], "authentication.kubernetes.io/pod-name": ["healthagent-x"]}
    return {"userInfo": info, "operation": "UPDATE"}


def node(name: str = "gpu-1") -> dict[str, Any]:
    """A GPU node as the API server holds it, with other controllers' taints, labels and conditions."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name, "resourceVersion": "100",
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true",
                       "healthagent.io/health": "healthy"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"providerID": "aws:///us-east-1a/i-0123",
                 "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                            {"key": "dedicated", "value": "training", "effect": "NoSchedule"}]},
        "status": {
            "capacity": {"cpu": "192", "nvidia.com/gpu": "8"},
            "allocatable": {"cpu": "191", "nvidia.com/gpu": "8"},
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is ready"},
                {"type": "GpuHealthy", "status": "True", "reason": "NoFindings", "message": "ok"},
            ],
        },
    }


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
    n["status"]["conditions"].append({"type": "EfaHealthy", "status": "True", "reason": "NoFindings",
                                      "message": "ok"})


ALLOWED = {
    "nothing changes": lambda n: None,
    "add its own NoSchedule taint": add_own_taint,
    "add its own NoExecute taint": own_taint_to_noexecute,
    "reorder foreign taints while adding its own": reorder_foreign_taints,
    "set its own and HyperPod's labels": set_labels,
    "remove its own label": remove_own_label,
    "set its own and HyperPod's annotations": set_annotations,
    "set GpuHealthy and add EfaHealthy": set_own_conditions,
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
    "change the Ready condition": (ready_condition_changed, "GpuHealthy and EfaHealthy"),
    "add a foreign condition": (foreign_condition_added, "GpuHealthy and EfaHealthy"),
    "remove a foreign condition": (foreign_condition_removed, "GpuHealthy and EfaHealthy"),
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


# -- the Event policy ----------------------------------------------------------------------------------

def test_event_policy_fails_closed_on_event_writes_only(event_policy):
    """CREATE and UPDATE of events.k8s.io/v1 Events; Equivalent also sends core/v1 Events here."""
    constraints = event_policy["spec"]["matchConstraints"]
    assert event_policy["spec"]["failurePolicy"] == "Fail" and "paramKind" not in event_policy["spec"]
    assert constraints["matchPolicy"] == "Equivalent"
    assert constraints["resourceRules"] == [{
        "apiGroups": ["events.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
        "resources": ["events"]}]


def test_both_policies_agree_on_who_the_agent_is_and_which_node_is_its_own(policy, event_policy):
    """The same matchConditions and the same boundNode: one definition of "the agent's node"."""
    def bound_node(spec):
        return next(v for v in spec["variables"] if v["name"] == "boundNode")

    assert event_policy["spec"]["matchConditions"] == policy["spec"]["matchConditions"]
    assert bound_node(event_policy["spec"]) == bound_node(policy["spec"])


def test_event_policy_names_the_agents_reporting_controller(event_policy):
    assert f"'{REPORTING_CONTROLLER}'" in json.dumps(event_policy["spec"]["validations"])


def test_event_policy_paths_exist_in_the_event_schema(event_policy):
    """As for the node policy: every ``object.<field>`` must exist in events.k8s.io/v1 Event (1.30)."""
    defs = _definitions("1.30.0")
    event = _properties(defs, "io.k8s.api.events.v1.Event")
    reference = _properties(defs, "io.k8s.api.core.v1.ObjectReference")
    text = json.dumps(event_policy["spec"])
    paths = set(re.findall(r"\bobject\.(\w+)(?:\.(\w+))?", text))
    assert {field for field, _ in paths} == {"regarding", "related", "reportingInstance", "reportingController"}
    assert [field for field, _ in paths if field not in event] == []
    assert [sub for _, sub in paths if sub and sub not in reference] == []
    assert "oldObject" not in text  # CREATE has none


@pytest.fixture(scope="module")
def event_evaluator(event_policy) -> PolicyEvaluator:
    return PolicyEvaluator(event_policy)


def agent_event(node_name: str = "gpu-1", **changes: Any) -> dict[str, Any]:
    """An Event exactly as the agent builds it (healthagent/effects/events.py), optionally altered."""
    spec = EventSpec(key="finding/GPU_XID/0000:53:00.0", type="Warning", reason="GPU_XID", action="Detected",
                     note="[replace_node] XID 95", at=1_700_000_000.0)
    return {**event_body(spec, node_name, "5f0c-uid"), **changes}


def create_event(evaluator: PolicyEvaluator, event: dict[str, Any], token: dict[str, Any] | None = None,
                 operation: str = "CREATE") -> Decision:
    return evaluator.admit(token or request(), None if operation == "CREATE" else event, event,
                           resource="events", operation=operation, group="events.k8s.io")


LONG_NODE = "ip-10-0-0-1." + "a" * 180 + ".compute.internal"  # a legal node name, over 128 characters

EVENTS_ALLOWED = {
    "the agent's own Event": lambda: (request(), agent_event()),
    "its node as the related object": lambda: (request(), agent_event(related={"apiVersion": "v1", "kind": "Node",
                                                                                "name": "gpu-1"})),
    "a node name over 128 characters (reportingInstance cut to 128)": lambda: (
        request(node=LONG_NODE), agent_event(LONG_NODE)),
}


@pytest.mark.parametrize("make", list(EVENTS_ALLOWED.values()), ids=list(EVENTS_ALLOWED))
@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_agent_may_write_events_about_its_own_node(event_evaluator, make, operation):
    token, event = make()
    assert create_event(event_evaluator, event, token, operation) == Decision(applies=True, allowed=True)


def without(key: str) -> dict[str, Any]:
    event = agent_event()
    del event[key]
    return event


OTHER_NODE_EVENT = "healthagent on node gpu-1 may write Events only about its own node, not about "
EVENTS_DENIED = {
    "about another node": (agent_event("gpu-2", reportingInstance="gpu-1"), OTHER_NODE_EVENT + "Node gpu-2"),
    "about a Pod named like its node": (
        agent_event(regarding={"apiVersion": "v1", "kind": "Pod", "namespace": "default", "name": "gpu-1"}),
        OTHER_NODE_EVENT + "Pod gpu-1"),
    "about a Node of another API": (
        agent_event(regarding={"apiVersion": "example.com/v1", "kind": "Node", "name": "gpu-1"}),
        OTHER_NODE_EVENT + "Node gpu-1"),
    "about nothing": (without("regarding"), OTHER_NODE_EVENT + " "),
    "reported as another node": (agent_event(reportingInstance="gpu-2"),
                                 "must report Events as reportingInstance gpu-1, not gpu-2"),
    "without a reportingInstance": (without("reportingInstance"), "as reportingInstance gpu-1, not "),
    "another node related": (agent_event(related={"apiVersion": "v1", "kind": "Node", "name": "gpu-2"}),
                             "may name only its own node as the related object of an Event"),
    "a Pod related": (agent_event(related={"apiVersion": "v1", "kind": "Pod", "name": "gpu-1"}),
                      "may name only its own node as the related object of an Event"),
    "posing as the kubelet": (agent_event(reportingController="kubelet"),
                              f"as reportingController {REPORTING_CONTROLLER}"),
    "without a reportingController": (without("reportingController"), f"as reportingController {REPORTING_CONTROLLER}"),
}


@pytest.mark.parametrize("event,reason", list(EVENTS_DENIED.values()), ids=list(EVENTS_DENIED))
def test_agent_may_not_write_events_about_anything_else(event_evaluator, event, reason):
    decision = create_event(event_evaluator, event)
    assert decision.applies and not decision.allowed
    assert len(decision.messages) == 1 and reason in decision.messages[0], decision.messages


def test_a_long_node_name_must_be_cut_exactly_at_128(event_evaluator):
    """The cut-off name is accepted only as the first 128 characters, not any prefix of it."""
    token = request(node=LONG_NODE)
    assert not create_event(event_evaluator, agent_event(LONG_NODE, reportingInstance=LONG_NODE[:20]), token).allowed
    assert not create_event(event_evaluator, agent_event(LONG_NODE, reportingInstance=LONG_NODE[:127]), token).allowed


@pytest.mark.parametrize("token", [
    pytest.param(request(node=None), id="token without extra"),
    pytest.param({**request(), "userInfo": {**request()["userInfo"], "extra": {NODE_NAME_EXTRA: []}}},
                 id="node-name extra without a value"),
])
def test_a_token_without_a_node_writes_no_event(event_evaluator, token):
    decision = create_event(event_evaluator, agent_event(), token)
    assert not decision.allowed
    assert decision.messages == (
        "healthagent: the service-account token names no node (Kubernetes 1.30+ with "
        "ServiceAccountTokenPodNodeInfo is required); refusing to write an Event about Node gpu-1",)


@pytest.mark.parametrize("user,applies", [
    (AGENT_USER, True),
    ("system:serviceaccount:gpu-health:healthagent", True),
    ("system:node:gpu-1", False),  # the kubelet reports about its node itself
    ("system:serviceaccount:kube-system:node-controller", False),
    ("admin", False),
])
def test_event_policy_applies_to_agent_service_accounts_only(event_evaluator, user, applies):
    decision = create_event(event_evaluator, agent_event("gpu-2"), request(user=user))
    assert (decision.applies, decision.allowed) == (applies, not applies)


def test_event_policy_leaves_other_resources_alone(event_evaluator):
    event = agent_event("gpu-2")
    assert event_evaluator.admit(request(), None, event, resource="events", operation="DELETE",
                                 group="events.k8s.io").applies is False
    assert event_evaluator.admit(request(), None, event, resource="nodes", operation="CREATE").applies is False


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


# -- the budget's Leases ---------------------------------------------------------------------------

T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def lease_policy(rendered) -> dict[str, Any]:
    return find(rendered["generic"], "ValidatingAdmissionPolicy", LEASE_POLICY)


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


def _count(holder: str) -> dict[str, Any]:
    lease = new_lease(COUNT_LEASE, "healthagent", "count")
    return claimed_count(lease, holder, T0) if holder else lease


def _counted_as(holder: str, nodes: str) -> dict[str, Any]:
    """The count Lease as ``holder`` records it, with ``nodes`` as its count (any text)."""
    lease = counted(claimed_count(_count("gpu-2"), holder, T0), 0, "nvidia.com/gpu.present=true", T0)
    lease["metadata"]["annotations"][GPU_NODES_ANNOTATION] = nodes
    return lease


LEASES_ALLOWED = {
    "create a slot in its own name": lambda: (None, held_lease(new_lease(slot_name(0), "healthagent", "slot"),
                                                               "gpu-1", T0, acquired=True)),
    "take a free slot": lambda: (slot(), held_lease(slot(), "gpu-1", T0, acquired=True)),
    "reclaim another node's (stale) slot": lambda: (slot("gpu-2"), held_lease(slot("gpu-2"), "gpu-1", T0,
                                                                               acquired=True)),
    "re-write its own slot": lambda: (slot("gpu-1"), held_lease(slot("gpu-1"), "gpu-1", T0, acquired=False)),
    "give back its own slot": lambda: (slot("gpu-1"), released_lease(slot("gpu-1"))),
    "create the count in its own name": lambda: (None, _count("gpu-1")),
    "claim the count from another node": lambda: (_count("gpu-2"), claimed_count(_count("gpu-2"), "gpu-1", T0)),
    "record a count of 0": lambda: (_count("gpu-1"), _counted_as("gpu-1", "0")),
    "record a count of 100000": lambda: (_count("gpu-1"), _counted_as("gpu-1", "100000")),
    "record a count of 2048": lambda: (_count("gpu-1"), _counted_as("gpu-1", "2048")),
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
    **{f"record a count of {nodes!r}": (
        _count("gpu-2"), _counted_as("gpu-1", nodes),
        "healthagent may record a GPU node count only as a whole number from 0 to 100000 (healthagent.io/gpu-nodes)")
       for nodes in ("\u00b2", "9" * 401, "100001", "-1", "007", " 12", "")},
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
