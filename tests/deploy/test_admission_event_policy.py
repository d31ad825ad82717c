"""The Event policy (``healthagent-own-node-events``): the agent may write Events only about its own
node, as its reporting controller; its CEL evaluated by ``PolicyEvaluator``
(``tests/support/admission_cel.py``, see ``test_admission_policy.py`` for what that fake honours)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from healthagent.effects.events import REPORTING_CONTROLLER, EventSpec, event_body
from tests.support.admission_cel import (AGENT_USER, NODE_NAME_EXTRA, Decision, PolicyEvaluator, _definitions,
                                         _properties, request)

pytestmark = pytest.mark.integration


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
