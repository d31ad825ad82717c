"""Every overlay renders with the real kubectl and every object is valid Kubernetes.

Built-in kinds are checked against the OpenAPI schemas of ``kubernetes-validate`` in strict mode
(an unknown field is an error) for the oldest supported Kubernetes (1.30: ValidatingAdmissionPolicy
v1 and node-bound service-account tokens) and the newest the package knows. prometheus-operator
kinds have no schema there, so their shape is checked here field by field.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import kubernetes_validate
import pytest
import yaml

from healthagent import __version__
from tests.support.deploy import (
    COMPONENTS,
    OVERLAY_COMPONENTS,
    compatible_components,
    DEPLOY,
    OVERLAYS,
    REPO,
    find,
    kinds,
    overlay_with_components,
    render,
    render_text,
)

pytestmark = pytest.mark.integration

MIN_KUBERNETES = "1.30.0"
KUBERNETES_VERSIONS = (MIN_KUBERNETES, kubernetes_validate.latest_version())
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
IMAGE = f"healthagent:{__version__}"

BASE_OBJECTS = [
    ("ClusterRole", "healthagent"),
    ("ClusterRoleBinding", "healthagent"),
    ("DaemonSet", "healthagent"),
    ("Namespace", "healthagent"),
    ("PrometheusRule", "healthagent"),
    ("Role", "healthagent-budget"),
    ("Role", "healthagent-events"),
    ("RoleBinding", "healthagent-budget"),
    ("RoleBinding", "healthagent-events"),
    ("Service", "healthagent"),
    ("ServiceAccount", "healthagent"),
    ("ServiceMonitor", "healthagent"),
    ("ValidatingAdmissionPolicy", "healthagent-budget-count"),
    ("ValidatingAdmissionPolicy", "healthagent-own-budget-slot"),
    ("ValidatingAdmissionPolicy", "healthagent-own-node-events"),
    ("ValidatingAdmissionPolicy", "healthagent-own-node-only"),
    ("ValidatingAdmissionPolicyBinding", "healthagent-budget-count"),
    ("ValidatingAdmissionPolicyBinding", "healthagent-own-budget-slot"),
    ("ValidatingAdmissionPolicyBinding", "healthagent-own-node-events"),
    ("ValidatingAdmissionPolicyBinding", "healthagent-own-node-only"),
]
PRIORITY_KINDS = ("FlowSchema", "PriorityLevelConfiguration")
COUNTER_KINDS = ("ClusterRole", "ClusterRoleBinding", "Deployment", "Role", "RoleBinding", "ServiceAccount")
EVENT_ROLE = "healthagent-events"  # the one Role (and binding) in "default", where node Events live


def schema_errors(objects: list[dict[str, Any]], version: str) -> list[str]:
    errors = []
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        error = _object_error(json.dumps(obj, sort_keys=True), version)
        if error:
            errors.append(error)
    return errors


@functools.lru_cache(maxsize=None)
def _object_error(text: str, version: str) -> str | None:
    """One object's schema error, by its exact content: every overlay and component renders the
    same base objects again, and validating one takes tens of milliseconds."""
    obj = json.loads(text)
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}"
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_expected_objects(rendered, overlay):
    objects = rendered[overlay]
    dashboards = [o for o in objects if o["kind"] == "ConfigMap"]
    expected = [k for k in BASE_OBJECTS if overlay != "dry-run" or k[0] not in ("Role", "RoleBinding")]
    if overlay != "dry-run":  # the budget counter (component budget-counter): no budget in a dry run
        expected = expected + [(kind, "healthagent-budget-counter") for kind in COUNTER_KINDS]
    expected = sorted(expected + [(kind, "healthagent") for kind in PRIORITY_KINDS])  # component api-priority
    assert [k for k in kinds(objects) if k[0] != "ConfigMap"] == expected
    assert all(o["metadata"]["labels"]["grafana_dashboard"] == "1" for o in dashboards)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_builtin_object_is_valid_kubernetes(rendered, overlay, version):
    assert schema_errors(rendered[overlay], version) == []


@pytest.mark.parametrize("components", [[c] for c in COMPONENTS] + [compatible_components()])
def test_components_render_valid_on_every_overlay(kubectl, tmp_path, components):
    for overlay in OVERLAYS:
        objects = render(overlay_with_components(tmp_path / overlay, overlay, components), kubectl)
        for version in KUBERNETES_VERSIONS:
            assert schema_errors(objects, version) == [], (overlay, components)


def test_the_validator_rejects_an_unknown_field(rendered):
    """The schema check can fail: a misspelt field in the DaemonSet is reported."""
    daemonset = copy.deepcopy(find(rendered["generic"], "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["tolerationz"] = []
    assert len(schema_errors([daemonset], MIN_KUBERNETES)) == 1


def test_every_namespaced_object_is_in_the_healthagent_namespace(rendered):
    """...except the Event Role: Events about nodes live in "default" (healthagent/effects/events.py)."""
    from healthagent.effects.events import EVENTS_NAMESPACE

    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                      "ValidatingAdmissionPolicyBinding", *PRIORITY_KINDS}
    for overlay, objects in rendered.items():
        for obj in objects:
            expected = None if obj["kind"] in cluster_scoped else "healthagent"
            if obj["kind"] in ("Role", "RoleBinding") and obj["metadata"]["name"] == EVENT_ROLE:
                expected = EVENTS_NAMESPACE
            assert obj["metadata"].get("namespace") == expected, (overlay, obj["kind"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_image_is_the_package_version_once(kubectl, overlay):
    """docs/install.md's quick start rewrites exactly this string to the operator's registry."""
    text = render_text(DEPLOY / "overlays" / overlay, kubectl)
    assert text.count(f"image: {IMAGE}\n") == (1 if overlay == "dry-run" else 2)  # the agent, the budget counter


# -- prometheus-operator objects (no schema in kubernetes-validate) ---------------------------------

def assert_scrape_endpoint(endpoint: dict[str, Any]) -> None:
    assert endpoint["port"] == "metrics"
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True
    assert endpoint["relabelings"] == [{"action": "replace",
                                        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                        "targetLabel": "node"}]
    assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                             "relabelings"}


def test_service_monitor_scrapes_the_agent_service(rendered):
    objects = rendered["generic"]
    monitor = find(objects, "ServiceMonitor")
    service = find(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) == {"jobLabel", "selector", "endpoints"}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    # The scrape job is the Service's app.kubernetes.io/name: "healthagent", as the alerts expect.
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "healthagent"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert_scrape_endpoint(endpoint)


def test_service_is_headless_and_selects_the_agent_pods(rendered):
    objects = rendered["generic"]
    service = find(objects, "Service")
    pod_labels = find(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9410, "targetPort": "metrics",
                                         "protocol": "TCP"}]


def test_podmonitor_component_replaces_the_service_monitor(kubectl, tmp_path):
    objects = render(overlay_with_components(tmp_path, "generic", ["podmonitor"]), kubectl)
    assert [o for o in objects if o["kind"] == "ServiceMonitor"] == []
    monitor = find(objects, "PodMonitor")
    pod_labels = find(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_labels[monitor["spec"]["jobLabel"]] == "healthagent"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert_scrape_endpoint(endpoint)


def test_prometheus_rule_has_the_operator_shape(rendered):
    rule = find(rendered["generic"], "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert isinstance(group["name"], str) and group["rules"]
        for item in group["rules"]:
            assert ("alert" in item) != ("record" in item)
            assert isinstance(item["expr"], str)


def container_ports(objects) -> dict[str, dict[str, Any]]:
    container = find(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    return {port["name"]: port for port in container["ports"]}


@pytest.mark.parametrize("monitor_kind", ["ServiceMonitor", "PodMonitor"])
def test_prometheus_scrapes_the_pods_own_port_never_the_nodes(kubectl, tmp_path, rendered, monitor_kind):
    """What Prometheus reads names every tenant's jobs: it is on the pod's IP only, not a hostPort
    every pod on the node can reach, and never on the intake's port."""
    objects = rendered["generic"] if monitor_kind == "ServiceMonitor" else render(
        overlay_with_components(tmp_path, "generic", ["podmonitor"]), kubectl)
    monitor = find(objects, monitor_kind)
    (endpoint,) = monitor["spec"]["endpoints" if monitor_kind == "ServiceMonitor" else "podMetricsEndpoints"]
    scraped = container_ports(objects)[endpoint["port"]]
    assert "hostPort" not in scraped and scraped["containerPort"] == 9410
    assert [p for p in container_ports(objects).values() if "hostPort" in p] == [
        {"name": "training", "containerPort": 9412, "hostPort": 9412, "protocol": "TCP"}]


def test_network_policy_component_opens_the_intake_and_keeps_metrics_for_prometheus(kubectl, tmp_path):
    objects = render(overlay_with_components(tmp_path, "generic", ["network-policy"]), kubectl)
    policy = find(objects, "NetworkPolicy")
    pod_labels = find(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert policy["metadata"]["namespace"] == "healthagent"
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert set(by_port) == set(container_ports(objects))  # every port the container names, no other
    assert "from" not in by_port["training"]  # any source: job tokens decide who may write
    (source,) = by_port["metrics"]["from"]  # one source: the Prometheus pods
    assert source["podSelector"]["matchLabels"] and source["namespaceSelector"]["matchLabels"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_example_training_pod_is_valid_kubernetes(version):
    pod = yaml.safe_load((REPO / "examples" / "training-pod.yaml").read_text(encoding="utf-8"))
    assert schema_errors([pod], version) == []


def test_every_component_folder_is_rendered_by_the_tests():
    """A new folder under deploy/components/ is in COMPONENTS, so every render test covers it."""
    folders = {d.name for d in (DEPLOY / "components").iterdir() if (d / "kustomization.yaml").exists()}
    assert folders == set(COMPONENTS) | set(OVERLAY_COMPONENTS)
