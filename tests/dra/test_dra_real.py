"""Per-GPU quarantine on a real kube-apiserver v1.36 with the DRA device-taint gates on.

ResourceSlices are shaped as NVIDIA's DRA driver (v0.4.1) publishes them (``tests/dra/slices.py``);
the agent's ``NodeEffects`` wrapped in ``DraEffects`` reconciles verdicts made of real findings.
Proven here: a reset-class XID on one GPU of eight gives exactly one DeviceTaintRule selecting
that device (NoSchedule at once, NoExecute after the grace when the policy allows eviction) and
no taint on the Node; the rule is gone once the finding clears; three GPUs at once make it a
node finding; a server without the gates gets the node's behaviour and the fallback is reported.
"""

from __future__ import annotations

import pytest

from healthagent.dra.effects import DraApi, DraEffects
from healthagent.dra.rules import GROUP, PLURAL, SELECTOR, VERSION
from healthagent.dra.split import NOT_SERVED, TOO_MANY
from healthagent.effects.kube import NodeEffects
from healthagent.effects.state import StateStore
from healthagent.model import Verdict
from healthagent.policy.scope import ScopePolicy
from tests.dra.slices import gpu_finding, uuid, node_body, resource_slice
from tests.effects.helpers import T0, settings_for

pytestmark = pytest.mark.integration
GRACE = 120.0


def _effects(plane, tmp_path, node: str, scope: ScopePolicy, budget: str = "") -> DraEffects:
    """The agent's effects for ``node`` over its state file (a second call is the agent restarted).
    Each node counts against a disruption budget of its own (namespace ``budget``, by default one
    named after the node), so one test's slot does not hold another test's node."""
    settings = settings_for(tmp_path, node, kube="kubeconfig", replace_noexecute_grace_seconds=GRACE,
                            budget_namespace=budget or f"budget-{node}")
    store = StateStore(settings.state_file)
    store.load()
    api_client = plane.api_client()
    inner = NodeEffects(settings, api_client, store, watch=False, request_timeout=(2.0, 5.0))
    return DraEffects(inner, DraApi(api_client, node), scope, settings.taint_key, GRACE)


def _agent(plane, tmp_path, node: str, scope: ScopePolicy, budget: str = "") -> DraEffects:
    from kubernetes import client

    api_client = plane.api_client()
    namespace = budget or f"budget-{node}"
    try:
        client.CoreV1Api(api_client).create_namespace({"metadata": {"name": namespace}})
    except client.exceptions.ApiException as exc:
        if exc.status != 409:  # the budget's namespace, shared by the nodes of one test
            raise
    effects = _effects(plane, tmp_path, node, scope, budget)
    client.CoreV1Api(api_client).create_node(node_body(node))
    client.CustomObjectsApi(api_client).create_cluster_custom_object(
        GROUP, "v1", "resourceslices", resource_slice(node, 8))
    effects.startup(T0 - 1, "boot-1")
    return effects


def _rules(plane, node: str) -> list[dict]:
    from kubernetes import client

    items = client.CustomObjectsApi(plane.api_client()).list_cluster_custom_object(
        GROUP, VERSION, PLURAL, label_selector=SELECTOR)["items"]
    return [r for r in items if r["spec"]["deviceSelector"]["pool"] == node]


def _device_events(plane, node: str) -> list[dict]:
    reply = plane.admin_session().get(f"{plane.url}/apis/events.k8s.io/v1/namespaces/default/events", timeout=10)
    reply.raise_for_status()
    return [e for e in reply.json()["items"]
            if e["regarding"]["name"] == node and e.get("action") == "DeviceQuarantined"]


def _taints(plane, node: str) -> list:
    from kubernetes import client

    taints = client.CoreV1Api(plane.api_client()).read_node(node).spec.taints or []
    return [t for t in taints if t.key.startswith("healthagent.io/")]  # the agent's, not the node controller's


def test_one_gpu_of_eight_gets_one_rule_then_noexecute_then_none(dra_plane, tmp_path):
    node = "dra-one"
    effects = _agent(dra_plane, tmp_path, node, ScopePolicy(noexecute=True))
    bad = Verdict.of([gpu_finding(3)], T0)
    effects.reconcile(bad, T0, "boot-1")
    rules = _rules(dra_plane, node)
    assert len(rules) == 1
    assert rules[0]["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": node, "device": "gpu-3"}
    assert rules[0]["spec"]["taint"]["effect"] == "NoSchedule"
    assert rules[0]["spec"]["taint"]["value"] == "GPU_XID"
    assert _taints(dra_plane, node) == []
    (event,) = _device_events(dra_plane, node)
    assert "gpu-3" in event["note"] and uuid(3) in event["note"] and event["reason"] == "GPU_XID"
    effects.reconcile(bad, T0 + GRACE + 1, "boot-1")
    assert [r["spec"]["taint"]["effect"] for r in _rules(dra_plane, node)] == ["NoExecute"]
    assert _taints(dra_plane, node) == []
    assert effects.status()["quarantined"] == {f"gpu.nvidia.com/{node}/gpu-3": "NoExecute"}
    effects.reconcile(Verdict.of([], T0 + GRACE + 2), T0 + GRACE + 2, "boot-1")  # the reset was seen
    assert _rules(dra_plane, node) == []
    assert effects.status()["quarantined"] == {}


def test_without_noexecute_the_device_stays_at_noschedule(dra_plane, tmp_path):
    node = "dra-held"
    effects = _agent(dra_plane, tmp_path, node, ScopePolicy(noexecute=False))
    effects.reconcile(Verdict.of([gpu_finding(3)], T0), T0 + GRACE + 1, "boot-1")
    effects.reconcile(Verdict.of([gpu_finding(3)], T0), T0 + 2 * GRACE, "boot-1")
    assert [r["spec"]["taint"]["effect"] for r in _rules(dra_plane, node)] == ["NoSchedule"]


def test_three_gpus_make_it_a_node_finding(dra_plane, tmp_path):
    node = "dra-three"
    effects = _agent(dra_plane, tmp_path, node, ScopePolicy(noexecute=True))
    effects.reconcile(Verdict.of([gpu_finding(i) for i in (1, 3, 5)], T0), T0, "boot-1")
    assert _rules(dra_plane, node) == []
    assert [t.effect for t in _taints(dra_plane, node)] == ["NoSchedule"]
    assert effects.status()["fallbacks"] == [TOO_MANY]


def test_a_gpu_the_driver_does_not_publish_stays_with_the_node(dra_plane, tmp_path):
    node = "dra-unpublished"
    effects = _agent(dra_plane, tmp_path, node, ScopePolicy(noexecute=True))
    finding = gpu_finding(3, pci="0000:ee:00.0", uuid="GPU-not-published")
    effects.reconcile(Verdict.of([finding], T0), T0, "boot-1")
    assert _rules(dra_plane, node) == []
    assert effects.status()["fallbacks"] == ["gpu_not_published"]


def test_without_the_gates_the_node_behaves_as_before_and_says_so(control_plane, tmp_path):
    """The suite's plain server (no DRA gates) serves no DeviceTaintRules."""
    from kubernetes import client

    node = "dra-not-served"
    settings = settings_for(tmp_path, node, kube="kubeconfig")
    store = StateStore(settings.state_file)
    store.load()
    api_client = control_plane.api_client()
    inner = NodeEffects(settings, api_client, store, watch=False, request_timeout=(2.0, 5.0))
    effects = DraEffects(inner, DraApi(api_client, node), ScopePolicy(noexecute=True), settings.taint_key, GRACE)
    client.CoreV1Api(api_client).create_node(node_body(node))
    effects.startup(T0 - 1, "boot-1")
    effects.reconcile(Verdict.of([gpu_finding(3)], T0), T0, "boot-1")
    assert effects.status()["served"] is False
    assert effects.status()["fallbacks"] == [NOT_SERVED]
    assert _taints(control_plane, node) == []  # reset_gpu never taints the node: as without DRA


def test_a_restarted_agent_keeps_the_eviction_and_removes_what_cleared(dra_plane, tmp_path):
    node = "dra-restart"
    effects = _agent(dra_plane, tmp_path, node, ScopePolicy(noexecute=True))
    effects.reconcile(Verdict.of([gpu_finding(3), gpu_finding(5)], T0), T0, "boot-1")
    effects.reconcile(Verdict.of([gpu_finding(3), gpu_finding(5)], T0), T0 + GRACE + 1, "boot-1")
    assert sorted(r["spec"]["taint"]["effect"] for r in _rules(dra_plane, node)) == ["NoExecute", "NoExecute"]
    again = _effects(dra_plane, tmp_path, node, ScopePolicy(noexecute=True))  # a restart: no memory of either
    again.startup(T0 + 200, "boot-1")
    again.reconcile(Verdict.of([gpu_finding(3)], T0 + 201), T0 + 201, "boot-1")  # GPU 5's finding closed meanwhile
    rules = _rules(dra_plane, node)
    assert [(r["spec"]["deviceSelector"]["device"], r["spec"]["taint"]["effect"]) for r in rules] == [
        ("gpu-3", "NoExecute")]  # an eviction is never taken back; the cleared GPU's rule is gone


class _CountingApi(DraApi):
    """The real DraApi, counting the requests it makes."""

    calls = 0

    def _call(self, fn, *args, **kwargs):
        type(self).calls += 1
        return super()._call(fn, *args, **kwargs)


def test_a_healthy_node_asks_the_cluster_nothing_for_dra_after_its_first_pass(dra_plane, tmp_path):
    """Steady state costs nothing: once the first pass found no rule left by an earlier run, a
    node without GPU-scope findings makes no DRA request, however often it reconciles; a GPU
    finding makes it ask again."""
    node = "dra-quiet"
    effects = _agent(dra_plane, tmp_path, node, ScopePolicy())
    effects.api = _CountingApi(effects.api.custom.api_client, node)
    healthy = Verdict.of([], T0)
    for step in range(0, 600, 5):  # ten minutes of reconciles, past several refresh intervals
        effects.reconcile(healthy, T0 + step, "boot-1")
    first_pass = _CountingApi.calls
    assert first_pass > 0  # the first pass looked for leftovers
    for step in range(600, 1800, 5):
        effects.reconcile(healthy, T0 + step, "boot-1")
    assert _CountingApi.calls == first_pass
    effects.reconcile(Verdict.of([gpu_finding(3)], T0 + 1800), T0 + 1800, "boot-1")
    assert _CountingApi.calls > first_pass and len(_rules(dra_plane, node)) == 1
