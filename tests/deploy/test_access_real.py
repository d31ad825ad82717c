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

import pytest

from healthagent.effects.events import EVENTS_NAMESPACE, REPORTING_CONTROLLER
from healthagent.effects.hyperpod import (
    HYPERPOD_FAULT_TYPES_LABEL,
    HYPERPOD_HEALTH_LABEL,
    HYPERPOD_PENDING_REPLACEMENT,
    HYPERPOD_SCHEDULABLE,
)
from healthagent.effects.kube import NodeEffects
from healthagent.effects.node_desired import (
    CLEAR_ANNOTATION,
    CLEAR_HANDLED_ANNOTATION,
    GPU_CONDITION,
    HEALTH_LABEL,
    REPLACE_REQUIRED,
)
from healthagent.effects.state import StateStore
from healthagent.model import KubeStatus
from tests.effects.helpers import T0, XID95, cleared_by, settings_for
from tests.support.access_cases import (
    ALLOWED,
    DENIED_BY_POLICY,
    DENIED_BY_RBAC,
    EVENT_OTHER_NODE,
    MATRIX,
    Allowed,
    ByPolicy,
    core_event,
)
from tests.support.access_cluster import (  # noqa: F401 (access, world: fixtures)
    ACCOUNT,
    EVENT_POLICY,
    FOREIGN_TAINT,
    INSTANCE_TYPE_LABEL,
    JSON_PATCH,
    NAMESPACE,
    NODE_POLICY,
    POLICY_TIMEOUT,
    STRATEGIC,
    Outcome,
    World,
    access,
    attempt,
    condition_status,
    labels,
    own_taints,
    pointer,
    world,
)
from tests.support.deploy import find
from tests.support.wait import wait_for


pytestmark = pytest.mark.integration


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
