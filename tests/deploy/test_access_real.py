"""Least privilege, proven against a real kube-apiserver: RBAC plus the three admission policies.

``test_rbac.py`` and ``test_admission_policy.py`` check the manifests offline (the grants against
the calls in healthagent/effects/backend.py, the policies' CEL in Google's CEL runtime). Here the
rendered ``generic`` overlay's namespace, ServiceAccount, RBAC and ValidatingAdmissionPolicies are
applied to the session's real API server (``tests/support/envtest.py``), and the agent's real
credential is used: a token from the TokenRequest API bound to a Pod on node A, which the API
server turns into ``request.userInfo.extra["authentication.kubernetes.io/node-name"]``, exactly
as for the DaemonSet's pods. Then a matrix of calls made with that token must be allowed or denied
as designed, each denial by the layer that should deny it (RBAC: 403 ``cannot <verb> resource``;
a policy: 403 naming the policy and its message), and the agent's own ``NodeEffects`` must get a
whole XID 95 reaction onto its node with nothing refused (the privileges are sufficient),
holding a budget slot while tainted and giving it back after the clear.

Every test gets fresh Nodes A and B (unique names on the shared server) and budget slot Leases of
its own (unique slot numbers), so no case depends on another's writes. Skips without the binaries (the ``control_plane`` fixture) or kubectl.
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest

from healthagent.effects.backend import ApiBackend
from healthagent.effects.budget import (
    BUDGET_LABEL,
    COUNT_LEASE,
    GPU_NODES_ANNOTATION,
    claimed_count,
    held_lease,
    new_lease,
    released_lease,
    slot_name,
)
from healthagent.effects.budget_leases import LeaseStore
from healthagent.effects.events import EVENTS_NAMESPACE, REPORTING_CONTROLLER, EventSpec, event_body
from healthagent.effects.hyperpod import (
    HYPERPOD_FAULT_REASONS_LABEL,
    HYPERPOD_FAULT_TYPES_LABEL,
    HYPERPOD_HEALTH_LABEL,
    HYPERPOD_PENDING_REPLACEMENT,
    HYPERPOD_SCHEDULABLE,
)
from healthagent.effects.kube import NodeEffects
from healthagent.effects.node_desired import CLEAR_ANNOTATION, CLEAR_HANDLED_ANNOTATION, GPU_CONDITION, HEALTH_LABEL, REPLACE_REQUIRED
from healthagent.effects.state import StateStore
from healthagent.model import Action, KubeStatus
from tests.effects.helpers import T0, TAINT_KEY, XID95, cleared_by, settings_for
from tests.support.deploy import find
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

NAMESPACE = "healthagent"
ACCOUNT = "healthagent"
USER = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
NODE_POLICY = "healthagent-own-node-only"
EVENT_POLICY = "healthagent-own-node-events"
LEASE_POLICY = "healthagent-own-budget-slot"
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


def unbound_token(admin: Apis) -> str:
    """A plain TokenRequest (no bound object): the same service account, but no node claim."""
    request = {"spec": {"expirationSeconds": TOKEN_SECONDS}}
    return admin.core.create_namespaced_service_account_token(ACCOUNT, NAMESPACE, request).status.token


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
            unbound=Apis.of(control_plane.api_client(unbound_token(admin))))
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


def claim_count(world: World) -> Any:
    """The agent claims the fleet's count (the shared count Lease, created if absent)."""
    current = world.lease(COUNT_LEASE)
    body = claimed_count(current or new_lease(COUNT_LEASE, NAMESPACE, "count"), world.a, T0)
    if current is None:
        return world.agent.leases.create_namespaced_lease(NAMESPACE, body)
    return world.agent.leases.replace_namespaced_lease(COUNT_LEASE, NAMESPACE, body)


def count_own_node(world: World) -> int:
    """The budget's GPU node count (a Table without objects) with the agent's token; exactly 1."""
    counted = LeaseStore(ApiBackend(world.agent.core.api_client, world.a), NAMESPACE).count_nodes(
        f"kubernetes.io/hostname={world.a}")
    assert counted == 1, counted
    return counted


def forged_count(world: World, nodes: str) -> dict:
    """A count Lease of this test's own (its slot number in the name) in node A's name, counting ``nodes``."""
    lease = held_lease(new_lease(f"healthagent-budget-count-{world.slot}", NAMESPACE, "count"), world.a, T0,
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
        message = self.message.format(a=world.a, b=world.b, slot=slot_name(world.slot))
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
CONDITIONS = "healthagent may change only the GpuHealthy and EfaHealthy node conditions"
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
    "strategic merge on /status: GpuHealthy False, EfaHealthy added": Case(
        lambda w: strategic(w, w.a, conditions(("GpuHealthy", "False"), ("EfaHealthy", "True")), status=True),
        Allowed(lambda w: [condition_status(w, c) for c in ("GpuHealthy", "EfaHealthy")] == ["False", "True"])),
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
    "claim the fleet's GPU node count in its own name": Case(
        claim_count, Allowed(lambda w: holder(w, COUNT_LEASE) == w.a)),
    "count the GPU nodes as a Table without the objects": Case(count_own_node, Allowed()),
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
            "type": "EfaHealthy", "status": "False", "reason": "Test", "message": "m"}}], status=True),
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
    "a GPU node count no fleet has": Case(
        lambda w: w.agent.leases.create_namespaced_lease(NAMESPACE, forged_count(w, "9" * 401)),
        ByPolicy(LEASE_POLICY, "healthagent may record a GPU node count only as a whole number from 0 to 100000 "
                               "(healthagent.io/gpu-nodes)")),
    "a GPU node count that is not ASCII digits": Case(
        lambda w: w.agent.leases.create_namespaced_lease(NAMESPACE, forged_count(w, "\u00b2")),
        ByPolicy(LEASE_POLICY, "healthagent may record a GPU node count only as a whole number from 0 to 100000 "
                               "(healthagent.io/gpu-nodes)")),
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
    "watch the budget's Leases": Case(
        lambda w: w.agent.leases.list_namespaced_lease(NAMESPACE, watch=True, timeout_seconds=1,
                                                       _preload_content=False).data,
        ByRbac("watch", "leases", LEASE)),
    "list Leases in every namespace": Case(
        lambda w: w.agent.leases.list_lease_for_all_namespaces(), ByRbac("list", "leases", LEASE)),
}

MATRIX = {**ALLOWED, **DENIED_BY_POLICY, **DENIED_BY_RBAC}


@pytest.mark.parametrize("node", ["a", "b"])
def test_a_stale_json_patch_fails_before_admission_with_422(world, node):
    """A JSON patch whose ``test`` op no longer holds is refused while the patch is applied, before
    admission, on any node: 422 Invalid with a generic message and no causes - not a 409
    Conflict, unlike a strategic-merge patch with a stale resourceVersion. A JSON-patch writer
    must read this 422 as "the node changed: re-read and re-plan"."""
    name = getattr(world, node)
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
             {"op": "add", "path": pointer("metadata", "labels", HEALTH_LABEL), "value": REPLACE_REQUIRED}]
    outcome = attempt(lambda: world.agent.core.patch_node(name, stale, _content_type=JSON_PATCH))
    assert (outcome.status, outcome.reason) == (422, "Invalid"), outcome
    assert outcome.message == "the server rejected our request due to an error in our request", outcome
    conflict = attempt(lambda: world.agent.core.patch_node(world.a, {"metadata": {
        "resourceVersion": "1", "labels": {HEALTH_LABEL: REPLACE_REQUIRED}}}, _content_type=STRATEGIC))
    assert (conflict.status, conflict.reason) == (409, "Conflict"), conflict


def test_the_matrix_is_wide_enough():
    assert len(ALLOWED) >= 15 and len(DENIED_BY_POLICY) >= 25 and len(DENIED_BY_RBAC) >= 10


@pytest.mark.parametrize("case", list(MATRIX.values()), ids=list(MATRIX))
def test_access_matrix(world, case):
    """One call with the agent's real credential: allowed and landed, or denied by the right layer."""
    if case.prepare is not None:
        case.prepare(world)
    before = ({name: world.node(name) for name in (world.a, world.b)}, world.leases())
    outcome = attempt(lambda: case.call(world))
    case.expect.check(world, outcome)
    if not isinstance(case.expect, Allowed):  # a denial leaves both nodes and the Leases as they were
        assert ({name: world.node(name) for name in (world.a, world.b)}, world.leases()) == before


# -- the agent itself, with nothing but its own privileges --------------------------------------------------

def agent_events(world: World) -> list[dict]:
    """The Events in "default" about node A (admin list, filtered by the regarding object)."""
    reply = world.plane.admin_session().get(
        f"{world.plane.url}/apis/events.k8s.io/v1/namespaces/{EVENTS_NAMESPACE}/events", timeout=10)
    reply.raise_for_status()
    return [e for e in reply.json()["items"] if (e.get("regarding") or {}).get("name") == world.a]


def budget_slots_held_by(world: World, node: str) -> int:
    return sum(1 for name, lease in world.leases().items()
               if name.startswith("healthagent-budget-slot-") and (lease.get("spec") or {}).get("holderIdentity") == node)


def refused(effects: NodeEffects) -> dict[str, int]:
    return {kind: n for kind, n in effects.errors.items() if "rejected" in kind}


@pytest.mark.parametrize("hyperpod", [False, True], ids=["generic", "hyperpod-labels"])
def test_the_agent_reacts_to_xid95_with_only_its_privileges(world, tmp_path, hyperpod):
    """NodeEffects with the pod-bound token of node A, watch on, through a whole XID 95: the
    NoSchedule taint (holding a budget slot in its namespace), health label, GpuHealthy False and
    the Event; after the grace NoExecute (and HyperPod's labels); then an operator's clear (taint
    removed, slot given back, clear-handled annotation, a Cleared Event, HyperPod's label given
    back). Nothing is refused at any step: least privilege is enough for everything the agent does."""
    settings = settings_for(tmp_path, world.a, budget_node_selector=f"kubernetes.io/hostname={world.a}",
                            hyperpod_labels=hyperpod)
    store = StateStore(settings.state_file)
    store.load()
    effects = NodeEffects(settings, world.agent.core.api_client, store, request_timeout=(5.0, 30.0))

    def nothing_pending_nor_refused(status: KubeStatus) -> None:
        assert status.pending_writes == 0 and refused(effects) == {}, (status, effects.errors)

    try:
        effects.startup(T0 - 1, "boot-1")
        wait_for(lambda: effects.watching, 60, "the agent's watch on its own node")
        nothing_pending_nor_refused(effects.reconcile(XID95, T0, "boot-1"))
        assert [(t["value"], t["effect"]) for t in own_taints(world)] == [("replace_node", "NoSchedule")]
        assert budget_slots_held_by(world, world.a) == 1
        assert labels(world)[HEALTH_LABEL] == REPLACE_REQUIRED
        assert HYPERPOD_HEALTH_LABEL not in labels(world)  # not before the grace
        assert condition_status(world, GPU_CONDITION) == "False"
        assert [e["reason"] for e in agent_events(world)] == ["GPU_XID"]

        after_grace = T0 + settings.replace_noexecute_grace_seconds + 1
        nothing_pending_nor_refused(effects.reconcile(XID95, after_grace, "boot-1"))
        assert [(t["value"], t["effect"]) for t in own_taints(world)] == [("replace_node", "NoExecute")]
        assert (labels(world).get(HYPERPOD_HEALTH_LABEL) == HYPERPOD_PENDING_REPLACEMENT) is hyperpod

        world.admin.core.patch_node(world.a, {"metadata": {"annotations": {CLEAR_ANNOTATION: "ticket-7"}}},
                                    _content_type=STRATEGIC)
        wait_for(lambda: CLEAR_ANNOTATION in ((effects.node or {}).get("metadata", {}).get("annotations") or {}),
                 60, "the watch to bring the operator's clear")
        assert effects.pending_clear() == "ticket-7"  # what the loop hands to policy
        # policy's verdict for the clear (it closed the finding): with it, the clear is carried out
        nothing_pending_nor_refused(effects.reconcile(cleared_by("ticket-7"), after_grace + 10, "boot-1"))
        node = world.node()
        assert own_taints(world) == [] and budget_slots_held_by(world, world.a) == 0
        assert node["metadata"]["annotations"][CLEAR_HANDLED_ANNOTATION] == "ticket-7"
        assert sorted(e["reason"] for e in agent_events(world)) == ["Cleared", "GPU_XID"]
        assert (labels(world).get(HYPERPOD_HEALTH_LABEL) == HYPERPOD_SCHEDULABLE) is hyperpod
        assert HYPERPOD_FAULT_TYPES_LABEL not in labels(world)
        # what other controllers own is untouched
        assert FOREIGN_TAINT in node["spec"]["taints"] and condition_status(world, "Ready") == "True"
        assert node["metadata"]["labels"][INSTANCE_TYPE_LABEL] == "p5.48xlarge"
    finally:
        effects.close()


def test_the_dry_run_overlay_keeps_both_policies(rendered):
    """The dry-run overlay drops the Event Role but not the policies: they stay when it goes live."""
    for name in (NODE_POLICY, EVENT_POLICY):
        find(rendered["dry-run"], "ValidatingAdmissionPolicy", name)
        find(rendered["dry-run"], "ValidatingAdmissionPolicyBinding", name)


def test_core_events_are_confined_too_should_someone_grant_them(world, unique_name):
    """RBAC grants no core/v1 Events; were a Role to grant them, the Event policy would still
    hold: ``matchPolicy: Equivalent`` sends a core Event through it, converted to events.k8s.io/v1
    (involvedObject -> regarding). The grant is this test's own and is gone when it ends; the
    test waits until RBAC refuses core Events again, so later cases see the real grants."""
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(world.admin.core.api_client)
    name = unique_name("healthagent-core-events")
    rbac.create_namespaced_role(EVENTS_NAMESPACE, {"metadata": {"name": name}, "rules": [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]})
    rbac.create_namespaced_role_binding(EVENTS_NAMESPACE, {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}]})

    def core_event_about(node: str) -> Outcome:
        body = {**core_event(world), "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node},
                "reportingComponent": REPORTING_CONTROLLER, "reportingInstance": world.a}
        return attempt(lambda: world.agent.core.create_namespaced_event(EVENTS_NAMESPACE, body, dry_run="All"))

    try:
        wait_for(lambda: core_event_about(world.a).status == 200, POLICY_TIMEOUT, "the core Events grant")
        ByPolicy(EVENT_POLICY, EVENT_OTHER_NODE).check(world, core_event_about(world.b))
    finally:
        attempt(lambda: rbac.delete_namespaced_role_binding(name, EVENTS_NAMESPACE))
        attempt(lambda: rbac.delete_namespaced_role(name, EVENTS_NAMESPACE))
    wait_for(lambda: 'cannot create resource "events"' in core_event_about(world.a).message, POLICY_TIMEOUT,
             "RBAC to refuse core Events again")
