"""The cluster side of the least-privilege tests on a real kube-apiserver.

The rendered ``generic`` overlay's namespace, ServiceAccount, RBAC and ValidatingAdmissionPolicies,
applied for a test module (the ``access`` fixture); fresh Nodes A and B, each with an agent pod and
its pod-bound service-account token, plus a token that names no node (the ``world`` fixture); and
the writes the agent (or a bug, or an attacker with its token) would send. Test modules take the
fixtures by importing ``access`` and ``world``.
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest

from healthagent.effects.budget import (
    COUNT_LEASE,
    GPU_NODES_ANNOTATION,
    counted,
    held_lease,
    new_lease,
    released_lease,
    slot_name,
)
from healthagent.effects.events import EVENTS_NAMESPACE, EventSpec, event_body
from healthagent.effects.node_desired import GPU_CONDITION, HEALTH_LABEL
from healthagent.model import Action
from tests.effects.helpers import T0, TAINT_KEY
from tests.support.wait import wait_for


NAMESPACE = "healthagent"
ACCOUNT = "healthagent"
USER = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
NODE_POLICY = "healthagent-own-node-only"
EVENT_POLICY = "healthagent-own-node-events"
LEASE_POLICY = "healthagent-own-budget-slot"
COUNT_POLICY = "healthagent-budget-count"
COUNTER_ACCOUNT = "healthagent-budget-counter"
HEARTBEATS = "kube-node-lease"  # the kubelets' heartbeat Leases
_slots = itertools.count(1000)  # slot numbers no other test of the module uses
ACCESS_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
FIELD_MANAGER = "healthagent-access-test"
TOKEN_SECONDS = 3600
POLICY_TIMEOUT = 120.0  # a new policy or binding reaches the admission plugin through an informer

FOREIGN_TAINT = {"key": "dedicated", "value": "training", "effect": "NoSchedule"}
NOT_READY_TAINT_KEY = "node.kubernetes.io/not-ready"  # added by admission to every new Node
OWN_TAINT = {"key": TAINT_KEY, "value": Action.REPLACE_NODE.value, "effect": "NoSchedule"}
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
TTL_ANNOTATION = "node.alpha.kubernetes.io/ttl"


# -- the cluster side: manifests applied once, fresh nodes per test ------------------------------------

def apply_access_objects(api_client: Any, objects: list[dict[str, Any]]) -> None:
    """Server-side apply, forcing conflicts (another module may have applied the same objects)."""
    from kubernetes import dynamic

    resources = dynamic.DynamicClient(api_client).resources
    for obj in objects:
        resources.get(api_version=obj["apiVersion"], kind=obj["kind"]).server_side_apply(
            body=obj, namespace=obj["metadata"].get("namespace"), field_manager=FIELD_MANAGER,
            force_conflicts=True)


def delete_access_objects(api_client: Any, objects: list[dict[str, Any]]) -> None:
    """Delete what ``apply_access_objects`` applied, except the Namespace (with no controller-
    manager it would stay Terminating). Other modules apply the same objects with their own field
    manager; a policy's ``matchConstraints`` is an atomic field, so objects left owned by this
    module would make their server-side apply conflict."""
    from kubernetes import dynamic
    from kubernetes.client.exceptions import ApiException

    resources = dynamic.DynamicClient(api_client).resources
    for obj in reversed(objects):
        if obj["kind"] == "Namespace":
            continue
        try:
            resources.get(api_version=obj["apiVersion"], kind=obj["kind"]).delete(
                name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace"))
        except ApiException as exc:
            if exc.status != 404:
                raise
    if any(o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == COUNT_POLICY for o in objects):
        wait_until_the_count_policy_is_gone(api_client)


def wait_until_the_count_policy_is_gone(api_client: Any) -> None:
    """A deleted policy leaves the admission plugin through an informer, a moment after the delete.
    The count policy judges every user's writes, the admin's too, so until then it would refuse
    the GPU node counts other modules write as the admin: wait until a dry-run count write passes."""
    from kubernetes import client

    leases = client.CoordinationV1Api(api_client)
    body = counted(new_lease(COUNT_LEASE, "default", "count"), 2, "kubernetes.io/hostname", T0)

    def judged_by_the_policy() -> bool:
        outcome = attempt(lambda: leases.create_namespaced_lease("default", body, dry_run="All"))
        return outcome.status == 403 and f"ValidatingAdmissionPolicy '{COUNT_POLICY}'" in outcome.message

    wait_for(lambda: not judged_by_the_policy(), POLICY_TIMEOUT, f"the deleted {COUNT_POLICY} to leave admission")


@pytest.fixture(scope="module")
def access(control_plane, rendered) -> Iterator[list[dict[str, Any]]]:
    """The generic overlay's access objects, applied to the real server for this module."""
    objects = [o for o in rendered["generic"] if o["kind"] in ACCESS_KINDS]
    assert {o["kind"] for o in objects} == set(ACCESS_KINDS)
    apply_access_objects(control_plane.api_client(), objects)
    yield objects
    delete_access_objects(control_plane.api_client(), objects)


@dataclass
class Apis:
    """The typed client APIs for one credential."""

    core: Any
    events: Any
    leases: Any

    @classmethod
    def of(cls, api_client: Any) -> "Apis":
        from kubernetes import client

        return cls(client.CoreV1Api(api_client), client.EventsV1Api(api_client),
                   client.CoordinationV1Api(api_client))


@dataclass
class World:
    """Nodes A and B with foreign state, an agent pod on each, and three agent credentials."""

    plane: Any
    a: str
    b: str
    admin: Apis
    agent: Apis  # the token of the pod on A
    agent_b: Apis  # the token of the pod on B
    unbound: Apis  # a token of the same service account that names no node
    counter: Apis  # the budget counter's token (its own service account)
    uids: dict[str, str] = field(default_factory=dict)
    slot: int = field(default_factory=lambda: next(_slots))  # this test's budget slot number

    def node(self, name: str | None = None) -> dict[str, Any]:
        """The node as the API server stores it (plain JSON, through the admin)."""
        reply = self.plane.admin_session().get(f"{self.plane.url}/api/v1/nodes/{name or self.a}", timeout=10)
        reply.raise_for_status()
        return reply.json()

    def leases(self) -> dict[str, dict[str, Any]]:
        """The budget's Leases by name, as the API server stores them (through the admin)."""
        reply = self.plane.admin_session().get(
            f"{self.plane.url}/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases", timeout=10)
        reply.raise_for_status()
        return {i["metadata"]["name"]: i for i in reply.json()["items"]}

    def lease(self, name: str | None = None) -> dict[str, Any] | None:
        return self.leases().get(name or slot_name(self.slot))


def node_object(name: str) -> dict[str, Any]:
    """A GPU node as kubelet and other controllers leave it: foreign taints, labels, annotations,
    a Ready condition and capacity, plus the agent's own label and condition from earlier."""
    resources = {"cpu": "192", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": "8"}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name,
                     "labels": {"kubernetes.io/hostname": name, INSTANCE_TYPE_LABEL: "p5.48xlarge",
                                HEALTH_LABEL: "healthy"},
                     "annotations": {TTL_ANNOTATION: "0"}},
        "spec": {"taints": [dict(FOREIGN_TAINT)]},
        "status": {"capacity": dict(resources), "allocatable": {**resources, "cpu": "191"},
                   "conditions": [
                       {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is ready"},
                       {"type": GPU_CONDITION, "status": "True", "reason": "AllChecksPassed", "message": "ok"}]},
    }


def agent_pod(name: str, node: str) -> dict[str, Any]:
    """The agent's pod as the DaemonSet would place it (no scheduler or kubelet here: it stays
    Pending, which the TokenRequest API does not mind)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"nodeName": node, "serviceAccountName": ACCOUNT,
                     "containers": [{"name": "healthagent", "image": "healthagent:test"}]}}


def pod_token(admin: Apis, pod: Any) -> str:
    """A token bound to ``pod``, as the kubelet mints for the pod's projected volume: the API
    server adds the pod's node name to it (KEP-4193)."""
    request = {"spec": {"expirationSeconds": TOKEN_SECONDS, "boundObjectRef": {
        "kind": "Pod", "apiVersion": "v1", "name": pod.metadata.name, "uid": pod.metadata.uid}}}
    return admin.core.create_namespaced_service_account_token(ACCOUNT, NAMESPACE, request).status.token


def unbound_token(admin: Apis, account: str = ACCOUNT) -> str:
    """A plain TokenRequest (no bound object): the same service account, but no node claim."""
    request = {"spec": {"expirationSeconds": TOKEN_SECONDS}}
    return admin.core.create_namespaced_service_account_token(account, NAMESPACE, request).status.token


@dataclass(frozen=True)
class Outcome:
    """What the API server answered: status 200 for success, else the error Status."""

    status: int
    reason: str = ""
    message: str = ""
    value: Any = None


def attempt(call: Callable[[], Any]) -> Outcome:
    from kubernetes.client.exceptions import ApiException

    try:
        return Outcome(200, value=call())
    except ApiException as exc:
        try:
            body = json.loads(exc.body or "")
        except (TypeError, ValueError):
            body = {}
        return Outcome(int(exc.status or 0), str(body.get("reason", exc.reason)), str(body.get("message", "")))


def policy_denial(policy: str, message: str) -> str:
    """The text the API server puts into a 403 from a ValidatingAdmissionPolicy's validation."""
    return f"ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request: {message}"


def wait_until_policies_enforce(world: World) -> None:
    """A new policy or binding (or RBAC, or the pod behind a token) reaches the API server's caches
    a moment after it is written: wait until known-bad writes are refused by the policies
    themselves. Dry runs, so an early success changes nothing."""
    def refused_by(policy: str, call: Callable[[], Any]) -> bool:
        outcome = attempt(call)
        return outcome.status == 403 and f"ValidatingAdmissionPolicy '{policy}'" in outcome.message

    wait_for(lambda: refused_by(NODE_POLICY, lambda: world.agent.core.patch_node(
        world.b, {"metadata": {"labels": {HEALTH_LABEL: "healthy"}}}, _content_type=STRATEGIC, dry_run="All")),
        POLICY_TIMEOUT, f"{NODE_POLICY} to refuse a write to another node")
    wait_for(lambda: refused_by(EVENT_POLICY, lambda: world.agent.events.create_namespaced_event(
        EVENTS_NAMESPACE, agent_event(world.b, world.uids[world.b]), dry_run="All")),
        POLICY_TIMEOUT, f"{EVENT_POLICY} to refuse an Event about another node")
    wait_for(lambda: refused_by(LEASE_POLICY, lambda: world.agent.leases.create_namespaced_lease(
        NAMESPACE, slot_lease(world, world.b), dry_run="All")),
        POLICY_TIMEOUT, f"{LEASE_POLICY} to refuse a budget slot in another node's name")


@pytest.fixture
def world(control_plane, access, unique_name) -> Iterator[World]:
    """Fresh nodes A and B, an agent pod bound to each, their tokens; removed afterwards."""
    admin = Apis.of(control_plane.api_client())
    a, b = unique_name("access-a"), unique_name("access-b")
    uids, pods = {}, []
    try:
        for name in (a, b):
            uids[name] = admin.core.create_node(node_object(name)).metadata.uid
            pods.append(admin.core.create_namespaced_pod(NAMESPACE, agent_pod(f"healthagent-{name}", name)))
        world = World(
            plane=control_plane, a=a, b=b, admin=admin, uids=uids,
            agent=Apis.of(control_plane.api_client(pod_token(admin, pods[0]))),
            agent_b=Apis.of(control_plane.api_client(pod_token(admin, pods[1]))),
            unbound=Apis.of(control_plane.api_client(unbound_token(admin))),
            counter=Apis.of(control_plane.api_client(unbound_token(admin, COUNTER_ACCOUNT))))
        wait_until_policies_enforce(world)
        yield world
    finally:
        for pod in pods:
            attempt(lambda: admin.core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0))
        for name in uids:
            attempt(lambda: admin.core.delete_node(name))
        if "world" in locals():  # this test's slot, so no later agent finds it held by a deleted node
            attempt(lambda: admin.leases.delete_namespaced_lease(slot_name(world.slot), NAMESPACE))


# -- the writes, as the agent (or a bug, or an attacker with its token) would send them ------------------

def pointer(*parts: str) -> str:
    """A JSON pointer (RFC 6901): ``/`` and ``~`` inside a key escaped."""
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def strategic(world: World, name: str, patch: dict, *, status: bool = False, apis: Apis | None = None) -> Any:
    """A strategic-merge PATCH with the node's resourceVersion, as the agent's read-modify-write."""
    apis = apis or world.agent
    body = {**patch, "metadata": {**patch.get("metadata", {}),
                                  "resourceVersion": world.node(name)["metadata"]["resourceVersion"]}}
    send = apis.core.patch_node_status if status else apis.core.patch_node
    return send(name, body, _content_type=STRATEGIC)


def json_patch(world: World, name: str, ops: list[dict], *, status: bool = False, apis: Apis | None = None) -> Any:
    """A JSON patch whose ``test`` ops make it conditional on the node as just read (the
    resourceVersion first), so admission judges a patch that applied."""
    apis = apis or world.agent
    version = world.node(name)["metadata"]["resourceVersion"]
    body = [{"op": "test", "path": "/metadata/resourceVersion", "value": version}, *ops]
    send = apis.core.patch_node_status if status else apis.core.patch_node
    return send(name, body, _content_type=JSON_PATCH)


def taints(world: World, name: str) -> list[dict]:
    return list(world.node(name)["spec"].get("taints") or [])


def with_taints(world: World, name: str, edit: Callable[[list[dict]], list[dict]], apis: Apis | None = None) -> Any:
    """The agent's taint write: the whole list (Node taints have no merge key), edited."""
    return strategic(world, name, {"spec": {"taints": edit(taints(world, name))}}, apis=apis)


def at_taint(world: World, key: str, op: dict) -> list[dict]:
    """JSON patch ops on node A's taint ``key``: a ``test`` that it is at the index the ``op`` (its
    path relative to that taint) addresses, as a JSON-patch writer must guard a list index."""
    index = next(i for i, t in enumerate(taints(world, world.a)) if t["key"] == key)
    return [{"op": "test", "path": f"/spec/taints/{index}/key", "value": key},
            {**op, "path": f"/spec/taints/{index}{op.get('path', '')}"}]


def at_condition(world: World, ctype: str, op: dict) -> list[dict]:
    """As ``at_taint``, for node A's condition ``ctype``."""
    index = next(i for i, c in enumerate(world.node()["status"]["conditions"]) if c["type"] == ctype)
    return [{"op": "test", "path": f"/status/conditions/{index}/type", "value": ctype},
            {**op, "path": f"/status/conditions/{index}{op.get('path', '')}"}]


def conditions(*items: tuple[str, str]) -> dict:
    return {"status": {"conditions": [{"type": t, "status": s, "reason": "Test", "message": "set by the test"}
                                      for t, s in items]}}


def agent_event(node: str, uid: str, **changes: Any) -> dict:
    """An Event exactly as the agent builds it (healthagent/effects/events.py), optionally altered."""
    spec = EventSpec(key=f"finding/test-{uuid.uuid4().hex}", type="Warning", reason="GPU_XID",
                     action="Detected", note="[replace_node] XID 95 on 0000:53:00.0", at=T0)
    return {**event_body(spec, node, uid), **changes}


def add_own_taint_as_admin(world: World) -> None:
    """Setup for the change/remove cases: the agent's taint already on node A."""
    strategic(world, world.a, {"spec": {"taints": taints(world, world.a) + [dict(OWN_TAINT)]}}, apis=world.admin)


# -- the budget's Leases, as the agent writes them (healthagent/effects/budget.py) -------------------------

def slot_lease(world: World, holder: str = "") -> dict:
    """This test's slot Lease held by ``holder``, or free."""
    lease = new_lease(slot_name(world.slot), NAMESPACE, "slot")
    return held_lease(lease, holder, T0, acquired=True) if holder else lease


def slot_as_admin(holder: str = "") -> Callable[[World], None]:
    """Setup: this test's slot exists, held by node ``holder`` ("a", "b") or free."""
    def prepare(world: World) -> None:
        world.admin.leases.create_namespaced_lease(NAMESPACE, slot_lease(world, getattr(world, holder) if holder else ""))
    return prepare


def take_slot(world: World, holder: str, apis: Apis | None = None, acquired: bool = True) -> Any:
    """Hold this test's slot in ``holder``'s name: a create when it does not exist, else an
    update with the version read (as the agent's take, reclaim and re-write)."""
    apis = apis or world.agent
    current = world.lease()
    body = held_lease(current or new_lease(slot_name(world.slot), NAMESPACE, "slot"), holder, T0 + 1,
                      acquired=acquired)
    if current is None:
        return apis.leases.create_namespaced_lease(NAMESPACE, body)
    return apis.leases.replace_namespaced_lease(body["metadata"]["name"], NAMESPACE, body)


def give_back(world: World, apis: Apis | None = None) -> Any:
    body = released_lease(world.lease() or {})
    return (apis or world.agent).leases.replace_namespaced_lease(body["metadata"]["name"], NAMESPACE, body)


def holder(world: World, name: str | None = None) -> str:
    return ((world.lease(name) or {}).get("spec") or {}).get("holderIdentity") or ""


def write_count(world: World, apis: Apis, nodes: str, holder: str = COUNTER_ACCOUNT) -> Any:
    """``apis`` writes the fleet's GPU node count (the count Lease, created if absent): ``nodes``,
    in ``holder``'s name (an agent's own node passes the slot policy: only the count policy judges)."""
    current = world.lease(COUNT_LEASE)
    body = counted(current or new_lease(COUNT_LEASE, NAMESPACE, "count"), 2, "kubernetes.io/hostname", T0)
    body["metadata"]["annotations"][GPU_NODES_ANNOTATION] = nodes
    body["spec"]["holderIdentity"] = holder
    body["metadata"].pop("managedFields", None)
    if current is None:
        return apis.leases.create_namespaced_lease(NAMESPACE, body)
    return apis.leases.replace_namespaced_lease(COUNT_LEASE, NAMESPACE, body)


def count_value(world: World) -> str | None:
    lease = world.lease(COUNT_LEASE) or {}
    return ((lease.get("metadata") or {}).get("annotations") or {}).get(GPU_NODES_ANNOTATION)


def forged_count(world: World, nodes: str) -> dict:
    """A count Lease of this test's own (its slot number in the name), counting ``nodes``."""
    lease = held_lease(new_lease(f"healthagent-budget-t{world.slot}-count", NAMESPACE, "count"), world.a, T0,
                       acquired=True)
    lease["metadata"]["annotations"] = {GPU_NODES_ANNOTATION: nodes}
    return lease


def foreign_lease(name: str, namespace: str, node: str) -> dict:
    lease = held_lease(new_lease(name, namespace, "slot"), node, T0, acquired=True)
    lease["metadata"]["labels"] = {}
    return lease


def own_taints(world: World, name: str | None = None) -> list[dict]:
    return [t for t in taints(world, name or world.a) if t["key"] == TAINT_KEY]


def labels(world: World) -> dict[str, str]:
    return world.node()["metadata"].get("labels") or {}


def condition_status(world: World, ctype: str) -> str | None:
    return next((c["status"] for c in world.node()["status"]["conditions"] if c["type"] == ctype), None)
