"""The DRA component's RBAC and admission policy on a real kube-apiserver, with pod-bound tokens.

A node's agent token may write DeviceTaintRules only for its own pool's devices, with the agent's
label, a healthagent.io/ taint key and an allowed effect; another node's rule is a 403 from the
policy, a rule of another resource than RBAC grants is a 403 from RBAC; the agent's own
``DraEffects`` writes pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from healthagent.dra.effects import DraApi, DraEffects
from healthagent.dra.rules import GROUP, PLURAL, VERSION
from healthagent.effects.budget_reclaim import DEVICE_NO_EXECUTE_ANNOTATION
from healthagent.effects.kube import NodeEffects
from healthagent.effects.state import StateStore
from healthagent.model import Verdict
from healthagent.policy.scope import ScopePolicy
from tests.dra.slices import gpu_finding, node_body, resource_slice
from tests.effects.helpers import T0, TAINT_KEY, settings_for
from tests.support.access_cluster import (
    ACCOUNT, NAMESPACE, agent_pod, apply_access_objects, attempt, pod_token, Apis)
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration
COMPONENT = Path(__file__).resolve().parents[2] / "deploy" / "components" / "dra"
POLICY = "healthagent-own-device-taints"


def rule(node: str, device: str = "gpu-3", *, name: str = "", labelled: bool = True,
         key: str = TAINT_KEY, effect: str = "NoSchedule") -> dict:
    labels = {"app.kubernetes.io/managed-by": "healthagent"} if labelled else {}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DeviceTaintRule",
            "metadata": {"name": name or f"{node}.{device}.healthagent", "labels": labels},
            "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": node, **({"device": device} if device else {})},
                     "taint": {"key": key, "value": "GPU_XID", "effect": effect}}}


@pytest.fixture(scope="module")
def cluster(dra_plane):
    from kubernetes import client

    admin_client = dra_plane.api_client()
    objects = [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ACCOUNT, "namespace": NAMESPACE}}]
    base = COMPONENT.parents[1] / "base"
    for path in (COMPONENT / "rbac.yaml", COMPONENT / "admission-policy.yaml", base / "rbac.yaml",
                 base / "admission-policy.yaml"):
        objects += [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] != "ServiceAccount"]
    apply_access_objects(admin_client, objects)
    admin = Apis.of(admin_client)
    tokens = {}
    for node in ("acc-a", "acc-b"):
        admin.core.create_node(node_body(node))
        client.CustomObjectsApi(admin_client).create_cluster_custom_object(
            GROUP, "v1", "resourceslices", resource_slice(node, 8))
        pod = admin.core.create_namespaced_pod(NAMESPACE, agent_pod(f"healthagent-{node}", node))
        tokens[node] = pod_token(admin, pod)
    custom = client.CustomObjectsApi(dra_plane.api_client(tokens["acc-a"]))
    # the policy reaches the admission plugin through an informer: wait until it refuses
    wait_for(lambda: attempt(lambda: custom.create_cluster_custom_object(
        GROUP, VERSION, PLURAL, rule("acc-b", name="probe.healthagent"))).status == 403, 120.0,
        "the DRA admission policy to enforce")
    yield dra_plane, tokens, custom


def test_own_rule_passes_and_can_be_updated_and_deleted(cluster):
    _, _, custom = cluster
    body = rule("acc-a")
    assert attempt(lambda: custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)).status == 200
    patch = {"spec": {"taint": {"key": TAINT_KEY, "value": "GPU_XID", "effect": "NoExecute"}}}
    assert attempt(lambda: custom.patch_cluster_custom_object(GROUP, VERSION, PLURAL, body["metadata"]["name"],
                                                              patch)).status == 200
    assert attempt(lambda: custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL,
                                                               body["metadata"]["name"])).status == 200


@pytest.mark.parametrize("body", [
    rule("acc-b"),  # another node's pool
    rule("acc-a", labelled=False),  # without the agent's label
    rule("acc-a", key="example.com/other"),  # a taint key not the agent's
    rule("acc-a", device="", name="acc-a.all.healthagent"),  # every device of the pool
], ids=["other-node", "no-label", "foreign-key", "whole-pool"])
def test_a_node_token_cannot_write_what_is_not_its_own(cluster, body):
    _, _, custom = cluster
    outcome = attempt(lambda: custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, body))
    assert outcome.status == 403
    assert POLICY in outcome.message


def test_a_node_token_cannot_touch_another_nodes_rule(cluster):
    plane, tokens, custom = cluster
    from kubernetes import client

    theirs = rule("acc-b", device="gpu-1")
    other = client.CustomObjectsApi(plane.api_client(tokens["acc-b"]))
    assert attempt(lambda: other.create_cluster_custom_object(GROUP, VERSION, PLURAL, theirs)).status == 200
    name = theirs["metadata"]["name"]
    assert attempt(lambda: custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)).status == 403
    patch = {"spec": {"deviceSelector": {"pool": "acc-a"}}}
    assert attempt(lambda: custom.patch_cluster_custom_object(GROUP, VERSION, PLURAL, name, patch)).status == 403
    assert attempt(lambda: other.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)).status == 200


def test_rbac_grants_no_other_resource_class(cluster):
    _, _, custom = cluster
    outcome = attempt(lambda: custom.list_cluster_custom_object(GROUP, "v1", "deviceclasses"))
    assert outcome.status == 403 and "cannot list resource" in outcome.message


def test_the_agents_own_writes_pass(cluster, tmp_path):
    plane, tokens, _ = cluster
    settings = settings_for(tmp_path, "acc-a", kube="kubeconfig")
    store = StateStore(settings.state_file)
    store.load()
    api_client = plane.api_client(tokens["acc-a"])
    inner = NodeEffects(settings, api_client, store, watch=False, request_timeout=(2.0, 5.0))
    effects = DraEffects(inner, DraApi(api_client, "acc-a"), ScopePolicy(noexecute=True), TAINT_KEY, 120.0)
    effects.startup(T0 - 1, "boot-1")
    effects.reconcile(Verdict.of([gpu_finding(3)], T0), T0, "boot-1")
    assert effects.status()["quarantined"] == {"gpu.nvidia.com/acc-a/gpu-3": "NoSchedule"}
    effects.reconcile(Verdict.of([gpu_finding(3)], T0), T0 + 121, "boot-1")
    assert effects.status()["quarantined"] == {"gpu.nvidia.com/acc-a/gpu-3": "NoExecute"}
    assert _annotations(plane, "acc-a").get(DEVICE_NO_EXECUTE_ANNOTATION) == "gpu-3"  # the budget's evidence
    effects.reconcile(Verdict.of([], T0 + 122), T0 + 122, "boot-1")
    assert effects.status()["quarantined"] == {}
    assert DEVICE_NO_EXECUTE_ANNOTATION not in _annotations(plane, "acc-a")
    assert not {k for k in effects.errors if k.startswith("dra_")}


def _annotations(plane, node: str) -> dict:
    from kubernetes import client

    return client.CoreV1Api(plane.api_client()).read_node(node).metadata.annotations or {}
