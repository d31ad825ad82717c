"""The ValidatingAdmissionPolicies' CEL, evaluated without an API server.

``PolicyEvaluator`` is a fake of kube-apiserver's admission step for one policy, with Google's CEL
implementation (``cel-expr-python``); ``tests/deploy/test_admission_policy.py`` says what it honours
and what it leaves out. Also here: the agent's identity as a request carries it (``request``), a
GPU node as the API server holds it (``node``), and the Kubernetes JSON schema's definitions, to
check the policies' field paths against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import pytest


NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
AGENT_USER = "system:serviceaccount:healthagent:healthagent"
NODE_POLICY = "healthagent-own-node-only"
EVENT_POLICY = "healthagent-own-node-events"
LEASE_POLICY = "healthagent-own-budget-slot"


def _definitions(version: str) -> dict[str, Any]:
    root = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
    return json.loads((root / "_definitions.json").read_text(encoding="utf-8"))["$defs"]


def _properties(defs: dict[str, Any], name: str) -> dict[str, Any]:
    return defs[name]["properties"]


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
            "cel_expr_python.cel", reason="cel-expr-python not installed (pip install cel-expr-python, a test extra): the CEL "
                                           "runtime for the policy test")
        dyn = cel.Type.DYN
        self.env = cel.NewEnv(variables={"object": dyn, "oldObject": dyn, "request": dyn,
                                         "variables": cel.Type.Map(cel.Type.STRING, dyn)})
        self.spec = policy["spec"]
        self.conditions = [self.env.compile(c["expression"]) for c in self.spec.get("matchConditions", [])]
        self.variables = [(v["name"], self.env.compile(v["expression"])) for v in self.spec.get("variables", [])]
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
