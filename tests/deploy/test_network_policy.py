"""The opt-in NetworkPolicy components, rendered with the real kubectl (and the oldest supported
one where installed): who may reach the metrics port and the training intake, by which labels.

``deploy/components/network-policy``: port 9410 only from Prometheus in the namespace whose
``kubernetes.io/metadata.name`` is ``monitoring`` (and the node itself, which NetworkPolicy always
allows: the kubelet's probes), port 9412 from anywhere. ``network-policy-training-pods``: the
same, with 9412 only from pods labelled ``healthagent.io/training-reporter=true``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.deploy import (
    DEPLOY,
    RenderError,
    agent_container,
    find,
    kubectl_binary,
    NO_KUBECTL,
    NO_OLDEST_KUBECTL,
    oldest_kubectl_binary,
    overlay_with_components,
    render,
)

pytestmark = pytest.mark.integration

KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
TRAINING_POD = {"healthagent.io/training-reporter": "true"}


@pytest.fixture(params=["current", "oldest"])
def any_kubectl(request) -> str:
    binary = kubectl_binary() if request.param == "current" else oldest_kubectl_binary()
    if binary is None:
        pytest.skip(NO_KUBECTL if request.param == "current" else NO_OLDEST_KUBECTL)
    return binary


def policy_of(tmp_path: Path, kubectl: str, component: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    objects = render(overlay_with_components(tmp_path, "generic", [component]), kubectl)
    return find(objects, "NetworkPolicy", "healthagent"), objects


def rules_by_port(policy: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rules = {}
    for rule in policy["spec"]["ingress"]:
        (port,) = rule["ports"]
        rules[port["port"]] = rule
    return rules


def assert_metrics_only_from_prometheus_in_monitoring(rules: dict[str, dict[str, Any]]) -> None:
    (source,) = rules["metrics"]["from"]
    assert source == {"namespaceSelector": {"matchLabels": MONITORING}, "podSelector": {"matchLabels": PROMETHEUS}}


@pytest.mark.parametrize("component", ["network-policy", "network-policy-training-pods"])
def test_the_policy_covers_the_agent_pods_and_each_of_their_ports(tmp_path, any_kubectl, component):
    policy, objects = policy_of(tmp_path, any_kubectl, component)
    pod_labels = find(objects, "DaemonSet", "healthagent")["spec"]["template"]["metadata"]["labels"]
    assert policy["metadata"]["namespace"] == "healthagent"
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = rules_by_port(policy)
    ports = {port["name"] for port in agent_container(objects)["ports"]}
    assert set(rules) == ports == {"metrics", "training"}
    assert_metrics_only_from_prometheus_in_monitoring(rules)
    # No ipBlock: the node itself (the kubelet's probes) is always allowed by NetworkPolicy, and a
    # block wide enough for every node would let in everything else on those addresses.
    assert "ipBlock" not in str(policy["spec"])


def test_the_kubelets_probes_use_the_port_the_node_reaches(tmp_path, any_kubectl):
    _, objects = policy_of(tmp_path, any_kubectl, "network-policy")
    container = agent_container(objects)
    probes = [container[kind] for kind in ("livenessProbe", "readinessProbe", "startupProbe") if kind in container]
    assert probes and {probe["httpGet"]["port"] for probe in probes} == {"metrics"}


def test_the_intake_is_open_to_every_source_by_default(tmp_path, any_kubectl):
    policy, _ = policy_of(tmp_path, any_kubectl, "network-policy")
    assert "from" not in rules_by_port(policy)["training"]


def test_the_training_pods_component_lets_only_labelled_pods_reach_the_intake(tmp_path, any_kubectl):
    policy, _ = policy_of(tmp_path, any_kubectl, "network-policy-training-pods")
    (source,) = rules_by_port(policy)["training"]["from"]
    assert source == {"namespaceSelector": {}, "podSelector": {"matchLabels": TRAINING_POD}}  # any namespace


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("component", ["network-policy", "network-policy-training-pods"])
def test_the_policy_is_valid_kubernetes(tmp_path, any_kubectl, component, version):
    policy, _ = policy_of(tmp_path, any_kubectl, component)
    kubernetes_validate.validate(policy, version, strict=True)


def test_the_two_components_are_one_or_the_other(tmp_path, any_kubectl):
    with pytest.raises(RenderError):
        render(overlay_with_components(tmp_path, "generic", ["network-policy", "network-policy-training-pods"]),
               any_kubectl)


def documented_patch() -> list[dict[str, Any]]:
    """The overlay patch that kustomization.yaml's comment shows for another namespace and scraper."""
    text = (DEPLOY / "components" / "network-policy" / "kustomization.yaml").read_text(encoding="utf-8")
    lines = text.split("#   patches:\n", 1)[1].split("\napiVersion:", 1)[0].splitlines()
    return yaml.safe_load("\n".join(line.removeprefix("#   ") for line in lines if line.startswith("#   ")))


def test_the_documented_patch_moves_the_metrics_port_to_another_namespace_and_scraper(tmp_path, any_kubectl):
    overlay = overlay_with_components(tmp_path / "base", "generic", ["network-policy"])
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [overlay.name], "patches": documented_patch()}), encoding="utf-8")
    policy = find(render(tmp_path, any_kubectl), "NetworkPolicy", "healthagent")
    (source,) = rules_by_port(policy)["metrics"]["from"]
    assert source == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
                      "podSelector": {"matchLabels": {"app.kubernetes.io/name": "alloy"}}}
    assert "from" not in rules_by_port(policy)["training"]
