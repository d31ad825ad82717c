"""``healthagent check`` says once what the GPU-scope findings do on this node, asking the real
kube-apiserver v1.36 (with and without the DRA gates): quarantined alone where the NVIDIA DRA
driver publishes the GPU and DeviceTaintRules are served; otherwise, that they act on the node
and why; without cluster access, that it asked none."""

from __future__ import annotations

import pytest

from healthagent.check_report import NOT_SERVED_WORDS, gpu_scope_report, render_check
from healthagent.dra.rules import GROUP
from healthagent.model import Action, Collection, Verdict
from healthagent.policy.scope import ScopePolicy
from tests.dra.slices import gpu_finding, node_body, resource_slice
from tests.effects.helpers import settings_for

BAD = Verdict.of([gpu_finding(3)], 1.0)


def _settings(plane, tmp_path, node: str, gpus: int | None):
    from kubernetes import client

    api_client = plane.api_client()
    client.CoreV1Api(api_client).create_node(node_body(node))
    if gpus is not None:
        client.CustomObjectsApi(api_client).create_cluster_custom_object(
            GROUP, "v1", "resourceslices", resource_slice(node, gpus))
    kubeconfig = plane.write_kubeconfig(tmp_path / "kubeconfig")
    return settings_for(tmp_path, node, kube="kubeconfig", kubeconfig=str(kubeconfig))


@pytest.mark.integration
def test_a_published_gpu_on_a_serving_cluster_is_quarantined_alone(dra_plane, tmp_path):
    settings = _settings(dra_plane, tmp_path, "check-published", gpus=8)
    line = gpu_scope_report(settings, BAD, ScopePolicy())
    assert line == ("the agent quarantines GPU 3 alone with a DeviceTaintRule on gpu.nvidia.com/check-published/gpu-3 "
                    "(NoSchedule, then NoExecute after the grace while the node holds a disruption-budget slot); "
                    "the node stays in service")
    assert "(NoSchedule); the node" in gpu_scope_report(settings, BAD, ScopePolicy(noexecute=False))


@pytest.mark.integration
def test_a_gpu_the_driver_does_not_publish_acts_on_the_node(dra_plane, tmp_path):
    settings = _settings(dra_plane, tmp_path, "check-unpublished", gpus=3)
    line = gpu_scope_report(settings, BAD, ScopePolicy())
    assert line.startswith("GPU-scope findings act on the node: the NVIDIA DRA driver (gpu.nvidia.com) publishes "
                           "no ResourceSlice device of node check-unpublished for GPU 3 (GPU-00000003")


@pytest.mark.integration
def test_a_cluster_without_device_taint_rules_acts_on_the_node(control_plane, tmp_path):
    settings = _settings(control_plane, tmp_path, "check-not-served", gpus=None)
    line = gpu_scope_report(settings, BAD, ScopePolicy())
    assert line == f"GPU-scope findings act on the node: {NOT_SERVED_WORDS}"
    text = render_check(Collection(timestamp=1.0), Verdict.of([gpu_finding(3), gpu_finding(5)], 1.0),
                        scope=ScopePolicy(), gpu_scope=line)
    assert text.count("GPU-scope findings act on the node") == 1  # said once, for both findings
    assert text.count("  scope: gpu (one GPU, not the node") == 2


def test_without_cluster_access_check_says_it_asked_none(tmp_path):
    settings = settings_for(tmp_path, "check-dry", kube="dry-run")
    line = gpu_scope_report(settings, BAD, ScopePolicy())
    assert "the agent quarantines this one GPU with a DRA DeviceTaintRule where" in line
    assert line.endswith("(check asked no cluster: kube=dry-run)")


def test_no_gpu_scope_finding_no_line(tmp_path):
    settings = settings_for(tmp_path, "check-none", kube="dry-run")
    node_scope = Verdict.of([gpu_finding(3, action=Action.REPLACE_NODE)], 1.0)
    assert gpu_scope_report(settings, node_scope, ScopePolicy()) == ""
    assert "GPU scope:" not in render_check(Collection(timestamp=1.0), node_scope, scope=ScopePolicy())
