"""The access matrix of ``tests/deploy/test_access_real.py``: calls made with the agent's real
credential, each with what must come of it (allowed and landed, or denied by the right policy or
by RBAC, with the message that layer gives)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from healthagent.effects.budget import BUDGET_LABEL, COUNT_LEASE, slot_name
from healthagent.effects.events import EVENTS_NAMESPACE, REPORTING_CONTROLLER
from healthagent.effects.hyperpod import (
    HYPERPOD_FAULT_REASONS_LABEL,
    HYPERPOD_FAULT_TYPES_LABEL,
    HYPERPOD_HEALTH_LABEL,
    HYPERPOD_PENDING_REPLACEMENT,
)
from healthagent.effects.node_desired import CLEAR_HANDLED_ANNOTATION, HEALTH_LABEL, REPLACE_REQUIRED
from tests.effects.helpers import TAINT_KEY
from tests.support.access_cluster import (
    ACCOUNT,
    COUNT_POLICY,
    EVENT_POLICY,
    FOREIGN_TAINT,
    HEARTBEATS,
    INSTANCE_TYPE_LABEL,
    LEASE_POLICY,
    NAMESPACE,
    NODE_POLICY,
    NOT_READY_TAINT_KEY,
    OWN_TAINT,
    TTL_ANNOTATION,
    USER,
    Outcome,
    World,
    add_own_taint_as_admin,
    agent_event,
    at_condition,
    at_taint,
    condition_status,
    conditions,
    count_value,
    foreign_lease,
    forged_count,
    give_back,
    holder,
    json_patch,
    labels,
    own_taints,
    pointer,
    policy_denial,
    slot_as_admin,
    slot_lease,
    strategic,
    taints,
    take_slot,
    with_taints,
    write_count,
)


# -- the expectations ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Allowed:
    """Succeeds, and ``landed`` (read back as admin) says the write is on the node."""

    landed: Callable[[World], bool] = lambda world: True

    def check(self, world: World, outcome: Outcome) -> None:
        assert outcome.status == 200, outcome
        assert self.landed(world), world.node()


@dataclass(frozen=True)
class ByPolicy:
    """403 from a ValidatingAdmissionPolicy, with its message (``{a}``/``{b}``: the node names)."""

    policy: str
    message: str

    def check(self, world: World, outcome: Outcome) -> None:
        assert (outcome.status, outcome.reason) == (403, "Forbidden"), outcome
        message = self.message.format(a=world.a, b=world.b, slot=slot_name(world.slot), slot_number=world.slot)
        assert policy_denial(self.policy, message) in outcome.message, outcome


@dataclass(frozen=True)
class ByRbac:
    """403 from the RBAC authorizer (before admission: nothing was evaluated or written)."""

    verb: str
    resource: str
    group: str = ""

    def check(self, world: World, outcome: Outcome) -> None:
        assert (outcome.status, outcome.reason) == (403, "Forbidden"), outcome
        expected = f'User "{USER}" cannot {self.verb} resource "{self.resource}" in API group "{self.group}"'
        assert expected in outcome.message, outcome


@dataclass(frozen=True)
class Case:
    call: Callable[[World], Any]
    expect: Allowed | ByPolicy | ByRbac
    prepare: Callable[[World], None] | None = None


OTHER_NODE = "healthagent on node {a} may change only its own node, not {b}"
NO_NODE = ("healthagent: the service-account token names no node (Kubernetes 1.30+ with "
           "ServiceAccountTokenPodNodeInfo is required); refusing to change node {a}")
TAINTS = "healthagent may add, change or remove only taints whose key is under healthagent.io/"
CORDON = "healthagent may not cordon or uncordon a node (spec.unschedulable)"
LABELS = ("healthagent may change only labels under healthagent.io/ and HyperPod's node-health-status, "
          "fault-types and fault-reasons")
ANNOTATIONS = "healthagent may change only annotations under healthagent.io/ and HyperPod's fault-details"
CONDITIONS = "healthagent may change only the GpuHealthy and NetworkHealthy node conditions"
CAPACITY = "healthagent may not change a node's capacity or allocatable resources"
SPEC = ("healthagent may change only its own taints in a node's spec (not providerID, podCIDR(s), externalID "
        "or configSource)")
STATUS = ("healthagent may change only its own conditions in a node's status (not addresses, nodeInfo, "
          "daemonEndpoints, images, volumes, phase or config)")
EVENT_OTHER_NODE = "healthagent on node {a} may write Events only about its own node, not about Node {b}"
EVENT_NO_NODE = ("healthagent: the service-account token names no node (Kubernetes 1.30+ with "
                 "ServiceAccountTokenPodNodeInfo is required); refusing to write an Event about Node {a}")
HOLD_ONLY = "healthagent on node {a} may hold a budget Lease only in its own name or give back its own, "
LEASE_NO_NODE = ("healthagent: the service-account token names no node (Kubernetes 1.30+ with "
                 "ServiceAccountTokenPodNodeInfo is required); refusing to write Lease {slot}")
LEASE = "coordination.k8s.io"


def hyperpod_labels() -> dict[str, str]:
    return {HYPERPOD_HEALTH_LABEL: HYPERPOD_PENDING_REPLACEMENT, HYPERPOD_FAULT_TYPES_LABEL: "GpuXid",
            HYPERPOD_FAULT_REASONS_LABEL: "Xid95"}


def event_in(namespace: str) -> Callable[[World], Any]:
    return lambda w: w.agent.events.create_namespaced_event(namespace, agent_event(w.a, w.uids[w.a]))


ALLOWED = {
    # the reads the agent makes
    "get its own node": Case(lambda w: w.agent.core.read_node(w.a), Allowed()),
    "list GPU nodes by label from the watch cache (the budget count)": Case(
        lambda w: w.agent.core.list_node(label_selector=f"kubernetes.io/hostname={w.a}", resource_version="0"),
        Allowed()),
    "list its own node by field selector (the watch's list)": Case(
        lambda w: w.agent.core.list_node(field_selector=f"metadata.name={w.a}"), Allowed()),
    "watch its own node": Case(
        lambda w: w.agent.core.list_node(field_selector=f"metadata.name={w.a}", watch=True, timeout_seconds=1,
                                         _preload_content=False).data, Allowed()),
    # its taint
    "strategic merge: add its NoSchedule taint": Case(
        lambda w: with_taints(w, w.a, lambda ts: ts + [dict(OWN_TAINT)]),
        Allowed(lambda w: own_taints(w) == [OWN_TAINT])),
    "strategic merge: change its taint to NoExecute": Case(
        lambda w: with_taints(w, w.a, lambda ts: [{**t, "effect": "NoExecute"} if t["key"] == TAINT_KEY else t
                                                  for t in ts]),
        Allowed(lambda w: [t["effect"] for t in own_taints(w)] == ["NoExecute"]), prepare=add_own_taint_as_admin),
    "strategic merge: remove its taint": Case(
        lambda w: with_taints(w, w.a, lambda ts: [t for t in ts if t["key"] != TAINT_KEY]),
        Allowed(lambda w: own_taints(w) == []), prepare=add_own_taint_as_admin),
    "json patch: add its taint (test: version and the taint list)": Case(
        lambda w: json_patch(w, w.a, [{"op": "test", "path": "/spec/taints", "value": taints(w, w.a)},
                                      {"op": "add", "path": "/spec/taints/-", "value": dict(OWN_TAINT)}]),
        Allowed(lambda w: own_taints(w) == [OWN_TAINT])),
    "json patch: remove its taint (test: its key at that index)": Case(
        lambda w: json_patch(w, w.a, at_taint(w, TAINT_KEY, {"op": "remove"})),
        Allowed(lambda w: own_taints(w) == []), prepare=add_own_taint_as_admin),
    # its labels and annotation
    "strategic merge: set its health label": Case(
        lambda w: strategic(w, w.a, {"metadata": {"labels": {HEALTH_LABEL: REPLACE_REQUIRED}}}),
        Allowed(lambda w: labels(w)[HEALTH_LABEL] == REPLACE_REQUIRED)),
    "strategic merge: remove its health label": Case(
        lambda w: strategic(w, w.a, {"metadata": {"labels": {HEALTH_LABEL: None}}}),
        Allowed(lambda w: HEALTH_LABEL not in labels(w))),
    "json patch: replace its health label (test: old value)": Case(
        lambda w: json_patch(w, w.a, [
            {"op": "test", "path": pointer("metadata", "labels", HEALTH_LABEL), "value": "healthy"},
            {"op": "replace", "path": pointer("metadata", "labels", HEALTH_LABEL), "value": REPLACE_REQUIRED}]),
        Allowed(lambda w: labels(w)[HEALTH_LABEL] == REPLACE_REQUIRED)),
    "strategic merge: set HyperPod's three labels": Case(
        lambda w: strategic(w, w.a, {"metadata": {"labels": hyperpod_labels()}}),
        Allowed(lambda w: hyperpod_labels().items() <= labels(w).items())),
    "json patch: add HyperPod's node-health-status label": Case(
        lambda w: json_patch(w, w.a, [{"op": "add", "path": pointer("metadata", "labels", HYPERPOD_HEALTH_LABEL),
                                       "value": HYPERPOD_PENDING_REPLACEMENT}]),
        Allowed(lambda w: labels(w)[HYPERPOD_HEALTH_LABEL] == HYPERPOD_PENDING_REPLACEMENT)),
    "strategic merge: set its clear-handled annotation": Case(
        lambda w: strategic(w, w.a, {"metadata": {"annotations": {CLEAR_HANDLED_ANNOTATION: "ticket-1"}}}),
        Allowed(lambda w: w.node()["metadata"]["annotations"][CLEAR_HANDLED_ANNOTATION] == "ticket-1")),
    "json patch: add its clear-handled annotation": Case(
        lambda w: json_patch(w, w.a, [{"op": "add", "value": "ticket-2",
                                       "path": pointer("metadata", "annotations", CLEAR_HANDLED_ANNOTATION)}]),
        Allowed(lambda w: w.node()["metadata"]["annotations"][CLEAR_HANDLED_ANNOTATION] == "ticket-2")),
    # its conditions
    "strategic merge on /status: GpuHealthy False, NetworkHealthy added": Case(
        lambda w: strategic(w, w.a, conditions(("GpuHealthy", "False"), ("NetworkHealthy", "True")), status=True),
        Allowed(lambda w: [condition_status(w, c) for c in ("GpuHealthy", "NetworkHealthy")] == ["False", "True"])),
    "json patch on /status: GpuHealthy False (test: its type at that index)": Case(
        lambda w: json_patch(w, w.a, at_condition(w, "GpuHealthy", {"op": "replace", "path": "/status",
                                                                    "value": "False"}), status=True),
        Allowed(lambda w: condition_status(w, "GpuHealthy") == "False")),
    # its Events
    "create an Event about its node, as the agent builds it": Case(
        event_in(EVENTS_NAMESPACE), Allowed()),
    "create an Event naming its node as the related object": Case(
        lambda w: w.agent.events.create_namespaced_event(EVENTS_NAMESPACE, agent_event(
            w.a, w.uids[w.a], related={"apiVersion": "v1", "kind": "Node", "name": w.a})), Allowed()),
    # node B's agent on node B: the rule is "your own node", not "node A"
    "node B's agent taints node B": Case(
        lambda w: strategic(w, w.b, {"spec": {"taints": taints(w, w.b) + [dict(OWN_TAINT)]}}, apis=w.agent_b),
        Allowed(lambda w: own_taints(w, w.b) == [OWN_TAINT])),
    # the disruption budget's Leases, in its own namespace
    "list the budget's Leases from the watch cache": Case(
        lambda w: w.agent.leases.list_namespaced_lease(NAMESPACE, label_selector=BUDGET_LABEL, resource_version="0"),
        Allowed()),
    "watch the budget's Leases (a held node)": Case(
        lambda w: w.agent.leases.list_namespaced_lease(NAMESPACE, label_selector=BUDGET_LABEL, resource_version="0",
                                                       watch=True, timeout_seconds=1, _preload_content=False).data,
        Allowed()),
    "get a budget slot": Case(
        lambda w: w.agent.leases.read_namespaced_lease(slot_name(w.slot), NAMESPACE), Allowed(),
        prepare=slot_as_admin()),
    "create a budget slot in its own name (the first to take it)": Case(
        lambda w: take_slot(w, w.a), Allowed(lambda w: holder(w) == w.a)),
    "take a free slot (an update with the version read)": Case(
        lambda w: take_slot(w, w.a), Allowed(lambda w: holder(w) == w.a), prepare=slot_as_admin()),
    "reclaim node B's (stale) slot": Case(
        lambda w: take_slot(w, w.a), Allowed(lambda w: holder(w) == w.a), prepare=slot_as_admin("b")),
    "re-write its own slot after tainting": Case(
        lambda w: take_slot(w, w.a, acquired=False), Allowed(lambda w: holder(w) == w.a), prepare=slot_as_admin("a")),
    "give back its own slot": Case(
        lambda w: give_back(w), Allowed(lambda w: w.lease() is not None and holder(w) == ""),
        prepare=slot_as_admin("a")),
    "the budget counter's token records the fleet's GPU node count": Case(
        lambda w: write_count(w, w.counter, "2"), Allowed(lambda w: count_value(w) == "2")),
    "node B's agent takes a free slot": Case(
        lambda w: take_slot(w, w.b, apis=w.agent_b), Allowed(lambda w: holder(w) == w.b), prepare=slot_as_admin()),
}

DENIED_BY_POLICY = {
    # another node, whatever is written
    "strategic merge: its taint on node B": Case(
        lambda w: with_taints(w, w.b, lambda ts: ts + [dict(OWN_TAINT)]), ByPolicy(NODE_POLICY, OTHER_NODE)),
    "strategic merge: its label on node B": Case(
        lambda w: strategic(w, w.b, {"metadata": {"labels": {HEALTH_LABEL: REPLACE_REQUIRED}}}),
        ByPolicy(NODE_POLICY, OTHER_NODE)),
    "strategic merge on /status: GpuHealthy on node B": Case(
        lambda w: strategic(w, w.b, conditions(("GpuHealthy", "False")), status=True),
        ByPolicy(NODE_POLICY, OTHER_NODE)),
    "json patch: its annotation on node B": Case(
        lambda w: json_patch(w, w.b, [{"op": "add", "value": "x",
                                       "path": pointer("metadata", "annotations", CLEAR_HANDLED_ANNOTATION)}]),
        ByPolicy(NODE_POLICY, OTHER_NODE)),
    "json patch on /status: a condition on node B": Case(
        lambda w: json_patch(w, w.b, [{"op": "add", "path": "/status/conditions/-", "value": {
            "type": "NetworkHealthy", "status": "False", "reason": "Test", "message": "m"}}], status=True),
        ByPolicy(NODE_POLICY, OTHER_NODE)),
    # foreign taints
    "strategic merge: remove a foreign taint": Case(
        lambda w: with_taints(w, w.a, lambda ts: [t for t in ts if t["key"] != FOREIGN_TAINT["key"]]),
        ByPolicy(NODE_POLICY, TAINTS)),
    "strategic merge: remove the not-ready taint": Case(
        lambda w: with_taints(w, w.a, lambda ts: [t for t in ts if t["key"] != NOT_READY_TAINT_KEY]),
        ByPolicy(NODE_POLICY, TAINTS)),
    "strategic merge: add a foreign taint": Case(
        lambda w: with_taints(w, w.a, lambda ts: ts + [{"key": "nvidia.com/gpu", "effect": "NoExecute"}]),
        ByPolicy(NODE_POLICY, TAINTS)),
    "strategic merge: change a foreign taint's effect": Case(
        lambda w: with_taints(w, w.a, lambda ts: [{**t, "effect": "NoExecute"} if t["key"] == FOREIGN_TAINT["key"]
                                                  else t for t in ts]),
        ByPolicy(NODE_POLICY, TAINTS)),
    "strategic merge: a taint key that only contains healthagent.io/": Case(
        lambda w: with_taints(w, w.a, lambda ts: ts + [{"key": "evil.healthagent.io/x", "effect": "NoExecute"}]),
        ByPolicy(NODE_POLICY, TAINTS)),
    "json patch: remove a foreign taint (test: its key)": Case(
        lambda w: json_patch(w, w.a, at_taint(w, FOREIGN_TAINT["key"], {"op": "remove"})),
        ByPolicy(NODE_POLICY, TAINTS)),
    # cordon
    "strategic merge: cordon": Case(
        lambda w: strategic(w, w.a, {"spec": {"unschedulable": True}}), ByPolicy(NODE_POLICY, CORDON)),
    "json patch: cordon": Case(
        lambda w: json_patch(w, w.a, [{"op": "add", "path": "/spec/unschedulable", "value": True}]),
        ByPolicy(NODE_POLICY, CORDON)),
    # foreign labels and annotations
    "strategic merge: change a foreign label": Case(
        lambda w: strategic(w, w.a, {"metadata": {"labels": {INSTANCE_TYPE_LABEL: "p4d.24xlarge"}}}),
        ByPolicy(NODE_POLICY, LABELS)),
    "strategic merge: remove a foreign label": Case(
        lambda w: strategic(w, w.a, {"metadata": {"labels": {"kubernetes.io/hostname": None}}}),
        ByPolicy(NODE_POLICY, LABELS)),
    "strategic merge: add a foreign label": Case(
        lambda w: strategic(w, w.a, {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}}),
        ByPolicy(NODE_POLICY, LABELS)),
    "json patch: a label key that only starts like healthagent.io": Case(
        lambda w: json_patch(w, w.a, [{"op": "add", "value": "1",
                                       "path": pointer("metadata", "labels", "healthagent.io.example.com/x")}]),
        ByPolicy(NODE_POLICY, LABELS)),
    "strategic merge: change a foreign annotation": Case(
        lambda w: strategic(w, w.a, {"metadata": {"annotations": {TTL_ANNOTATION: "30"}}}),
        ByPolicy(NODE_POLICY, ANNOTATIONS)),
    "json patch: add a foreign annotation": Case(
        lambda w: json_patch(w, w.a, [{"op": "add", "value": "true",
                                       "path": pointer("metadata", "annotations", "example.com/drain")}]),
        ByPolicy(NODE_POLICY, ANNOTATIONS)),
    # foreign conditions
    "strategic merge on /status: Ready False": Case(
        lambda w: strategic(w, w.a, conditions(("Ready", "False")), status=True), ByPolicy(NODE_POLICY, CONDITIONS)),
    "strategic merge on /status: add a foreign condition": Case(
        lambda w: strategic(w, w.a, conditions(("KernelDeadlock", "True")), status=True),
        ByPolicy(NODE_POLICY, CONDITIONS)),
    "json patch on /status: remove Ready (test: its type)": Case(
        lambda w: json_patch(w, w.a, at_condition(w, "Ready", {"op": "remove"}), status=True),
        ByPolicy(NODE_POLICY, CONDITIONS)),
    # capacity and allocatable
    "strategic merge on /status: capacity GPUs to 0": Case(
        lambda w: strategic(w, w.a, {"status": {"capacity": {"nvidia.com/gpu": "0"}}}, status=True),
        ByPolicy(NODE_POLICY, CAPACITY)),
    "strategic merge on /status: allocatable GPUs to 0": Case(
        lambda w: strategic(w, w.a, {"status": {"allocatable": {"nvidia.com/gpu": "0"}}}, status=True),
        ByPolicy(NODE_POLICY, CAPACITY)),
    "json patch on /status: remove the GPU capacity": Case(
        lambda w: json_patch(w, w.a, [{"op": "remove", "path": pointer("status", "capacity", "nvidia.com/gpu")}],
                             status=True),
        ByPolicy(NODE_POLICY, CAPACITY)),
    # the rest of the node's own spec and status
    "strategic merge: set providerID": Case(
        lambda w: strategic(w, w.a, {"spec": {"providerID": "aws:///us-east-1a/i-0fff"}}), ByPolicy(NODE_POLICY, SPEC)),
    "strategic merge: set podCIDR": Case(
        lambda w: strategic(w, w.a, {"spec": {"podCIDR": "10.0.0.0/24", "podCIDRs": ["10.0.0.0/24"]}}),
        ByPolicy(NODE_POLICY, SPEC)),
    "strategic merge on /status: addresses": Case(
        lambda w: strategic(w, w.a, {"status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}},
                            status=True), ByPolicy(NODE_POLICY, STATUS)),
    "strategic merge on /status: forge nodeInfo.bootID (ends a reboot taint)": Case(
        lambda w: strategic(w, w.a, {"status": {"nodeInfo": {"bootID": "forged-boot"}}}, status=True),
        ByPolicy(NODE_POLICY, STATUS)),
    "strategic merge on /status: kubelet port 1": Case(
        lambda w: strategic(w, w.a, {"status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": 1}}}}, status=True),
        ByPolicy(NODE_POLICY, STATUS)),
    "strategic merge on /status: images": Case(
        lambda w: strategic(w, w.a, {"status": {"images": [{"names": ["registry.example/evil:latest"],
                                                            "sizeBytes": 1}]}}, status=True),
        ByPolicy(NODE_POLICY, STATUS)),
    # Events about anything but its own node
    "an Event about node B": Case(
        lambda w: w.agent.events.create_namespaced_event(EVENTS_NAMESPACE, agent_event(w.b, w.uids[w.b])),
        ByPolicy(EVENT_POLICY, EVENT_OTHER_NODE)),
    "an Event about its node, reported as node B": Case(
        lambda w: w.agent.events.create_namespaced_event(EVENTS_NAMESPACE, agent_event(
            w.a, w.uids[w.a], reportingInstance=w.b)),
        ByPolicy(EVENT_POLICY, "healthagent on node {a} must report Events as reportingInstance {a}, not {b}")),
    "an Event about its node with node B related": Case(
        lambda w: w.agent.events.create_namespaced_event(EVENTS_NAMESPACE, agent_event(
            w.a, w.uids[w.a], related={"apiVersion": "v1", "kind": "Node", "name": w.b})),
        ByPolicy(EVENT_POLICY, "healthagent on node {a} may name only its own node as the related object of an Event")),
    "an Event about its node posing as the kubelet": Case(
        lambda w: w.agent.events.create_namespaced_event(EVENTS_NAMESPACE, agent_event(
            w.a, w.uids[w.a], reportingController="kubelet")),
        ByPolicy(EVENT_POLICY, f"healthagent must report Events as reportingController {REPORTING_CONTROLLER}")),
    "an Event about a Pod named like its node": Case(
        lambda w: w.agent.events.create_namespaced_event(EVENTS_NAMESPACE, agent_event(
            w.a, w.uids[w.a], regarding={"apiVersion": "v1", "kind": "Pod", "namespace": EVENTS_NAMESPACE,
                                         "name": w.a})),
        ByPolicy(EVENT_POLICY, "healthagent on node {a} may write Events only about its own node, not about Pod {a}")),
    # a token of the right service account that names no node
    "no node in the token: its label on node A": Case(
        lambda w: strategic(w, w.a, {"metadata": {"labels": {HEALTH_LABEL: REPLACE_REQUIRED}}}, apis=w.unbound),
        ByPolicy(NODE_POLICY, NO_NODE)),
    "no node in the token: an Event about node A": Case(
        lambda w: w.unbound.events.create_namespaced_event(EVENTS_NAMESPACE, agent_event(w.a, w.uids[w.a])),
        ByPolicy(EVENT_POLICY, EVENT_NO_NODE)),
    # budget slots in another node's name, or another node's given back
    "create a budget slot in node B's name": Case(
        lambda w: take_slot(w, w.b), ByPolicy(LEASE_POLICY, HOLD_ONLY + "not hold {slot} as {b}")),
    "take a free slot for node B": Case(
        lambda w: take_slot(w, w.b), ByPolicy(LEASE_POLICY, HOLD_ONLY + "not hold {slot} as {b}"),
        prepare=slot_as_admin()),
    "give back node B's slot": Case(
        lambda w: give_back(w), ByPolicy(LEASE_POLICY, HOLD_ONLY + "not give back {slot} held by {b}"),
        prepare=slot_as_admin("b")),
    "a Lease in its namespace that is not the budget's": Case(
        lambda w: w.agent.leases.create_namespaced_lease(NAMESPACE, foreign_lease("healthagent-leader", NAMESPACE, w.a)),
        ByPolicy(LEASE_POLICY, "healthagent may write only the budget Leases healthagent-budget-*, not Lease "
                               "healthagent-leader")),
    "record the fleet's GPU node count (the limit), even an honest one": Case(
        lambda w: write_count(w, w.agent, "2", holder=w.a),
        ByPolicy(COUNT_POLICY, "only the budget counter (service account healthagent-budget-counter in namespace "
                               f"{NAMESPACE}) may write the GPU node count {COUNT_LEASE}, not {USER}")),
    "a GPU node count of its own under another name": Case(
        lambda w: w.agent.leases.create_namespaced_lease(NAMESPACE, forged_count(w, "100000")),
        ByPolicy(COUNT_POLICY, "only the budget counter (service account healthagent-budget-counter in namespace "
                               f"{NAMESPACE}) may write the GPU node count healthagent-budget-t{{slot_number}}-count, "
                               f"not {USER}")),
    "the counter's token: a GPU node count no fleet has": Case(
        lambda w: w.counter.leases.create_namespaced_lease(NAMESPACE, forged_count(w, "9" * 401)),
        ByPolicy(COUNT_POLICY, "a GPU node count is a whole number from 0 to 100000 (healthagent.io/gpu-nodes)")),
    "the counter's token: a GPU node count that is not ASCII digits": Case(
        lambda w: w.counter.leases.create_namespaced_lease(NAMESPACE, forged_count(w, "\u00b2")),
        ByPolicy(COUNT_POLICY, "a GPU node count is a whole number from 0 to 100000 (healthagent.io/gpu-nodes)")),
    "no node in the token: take a free slot": Case(
        lambda w: take_slot(w, w.a, apis=w.unbound), ByPolicy(LEASE_POLICY, LEASE_NO_NODE), prepare=slot_as_admin()),
}


def core_event(w: World) -> dict:
    return {"metadata": {"generateName": "healthagent-"}, "type": "Warning", "reason": "GPU_XID",
            "message": "m", "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": w.a}}


DENIED_BY_RBAC = {
    "PUT (update) its node": Case(lambda w: w.agent.core.replace_node(w.a, w.node()), ByRbac("update", "nodes")),
    "PUT (update) its node's status": Case(
        lambda w: w.agent.core.replace_node_status(w.a, w.node()), ByRbac("update", "nodes/status")),
    "read its node's status subresource": Case(
        lambda w: w.agent.core.read_node_status(w.a), ByRbac("get", "nodes/status")),
    "delete its node": Case(lambda w: w.agent.core.delete_node(w.a), ByRbac("delete", "nodes")),
    "create a node": Case(
        lambda w: w.agent.core.create_node({"metadata": {"name": f"{w.a}-twin"}}), ByRbac("create", "nodes")),
    "get a secret": Case(
        lambda w: w.agent.core.read_namespaced_secret("anything", NAMESPACE), ByRbac("get", "secrets")),
    "list secrets everywhere": Case(
        lambda w: w.agent.core.list_secret_for_all_namespaces(), ByRbac("list", "secrets")),
    "list pods": Case(lambda w: w.agent.core.list_namespaced_pod(NAMESPACE), ByRbac("list", "pods")),
    "list configmaps": Case(
        lambda w: w.agent.core.list_namespaced_config_map(NAMESPACE), ByRbac("list", "configmaps")),
    "create a configmap": Case(
        lambda w: w.agent.core.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": "x"}}),
        ByRbac("create", "configmaps")),
    "mint another token for its service account": Case(
        lambda w: w.agent.core.create_namespaced_service_account_token(ACCOUNT, NAMESPACE, {"spec": {}}),
        ByRbac("create", "serviceaccounts/token")),
    "an Event in another namespace": Case(event_in(NAMESPACE), ByRbac("create", "events", "events.k8s.io")),
    "a core/v1 Event": Case(
        lambda w: w.agent.core.create_namespaced_event(EVENTS_NAMESPACE, core_event(w)), ByRbac("create", "events")),
    "patch an Event": Case(
        lambda w: w.agent.events.patch_namespaced_event("anything", EVENTS_NAMESPACE, {"note": "x"},
                                                        _content_type="application/merge-patch+json"),
        ByRbac("patch", "events", "events.k8s.io")),
    "renew node B's heartbeat Lease in kube-node-lease": Case(
        lambda w: w.agent.leases.replace_namespaced_lease(w.b, HEARTBEATS, foreign_lease(w.b, HEARTBEATS, w.b)),
        ByRbac("update", "leases", LEASE)),
    "create a Lease in another namespace": Case(
        lambda w: w.agent.leases.create_namespaced_lease(EVENTS_NAMESPACE, slot_lease(w, w.a)),
        ByRbac("create", "leases", LEASE)),
    "delete a budget slot": Case(
        lambda w: w.agent.leases.delete_namespaced_lease(slot_name(w.slot), NAMESPACE), ByRbac("delete", "leases", LEASE),
        prepare=slot_as_admin("b")),
    "patch a budget slot": Case(
        lambda w: w.agent.leases.patch_namespaced_lease(slot_name(w.slot), NAMESPACE, {"spec": {"holderIdentity": w.a}},
                                                        _content_type="application/merge-patch+json"),
        ByRbac("patch", "leases", LEASE), prepare=slot_as_admin("b")),
    "watch Leases in another namespace": Case(
        lambda w: w.agent.leases.list_namespaced_lease(HEARTBEATS, watch=True, timeout_seconds=1,
                                                       _preload_content=False).data,
        ByRbac("watch", "leases", LEASE)),
    "list Leases in every namespace": Case(
        lambda w: w.agent.leases.list_lease_for_all_namespaces(), ByRbac("list", "leases", LEASE)),
}

MATRIX = {**ALLOWED, **DENIED_BY_POLICY, **DENIED_BY_RBAC}
