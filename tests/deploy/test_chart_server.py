"""The Helm chart on a REAL kube-apiserver: every preset accepted, and a release's whole life.

``helm template`` of each preset (and of each component's values) goes through
``kubectl apply --server-side --dry-run=server`` against prometheus-operator's real CRDs, as
test_server_dry_run.py does for the overlays: CEL compiled, structural schemas, admission.

Then one release lives on the server: ``helm install`` (the dry run), ``helm upgrade`` with other
values (eks-node-repair, a budget), ``helm rollback`` to the dry run and ``helm uninstall``, with
the server's objects checked after each step: what the revision holds is there as rendered, what it
does not hold is gone (the Event and budget Roles and the budget counter after the rollback), and after the uninstall
nothing is left, the cluster-scoped admission policies and bindings included. The release uses
its own agent namespace, so it never meets the Namespace the dry runs create.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.test_server_dry_run import Kubectl, create_namespaces, dry_run_problems
from tests.support.helm import CHART, COMPONENT_VALUES, PRESETS
from tests.support.helm_cluster import (  # noqa: F401 (own_control_plane, helm_fixture, helm_on_server: fixtures)
    RELEASE,
    RELEASE_NAMESPACE,
    helm_fixture,
    helm_ok,
    helm_on_server,
    own_control_plane,
    identities,
    install,
    install_monitoring_crds,
    live,
    manifest,
)

pytestmark = pytest.mark.integration

AGENT_NAMESPACE = "healthagent-lifecycle"
WRITE_ROLES = {("Role", "default", "healthagent-events"), ("RoleBinding", "default", "healthagent-events"),
               ("Role", AGENT_NAMESPACE, "healthagent-budget"),
               ("RoleBinding", AGENT_NAMESPACE, "healthagent-budget")}
# The budget counter, which every preset but the dry run runs: its account, grants and Deployment.
COUNTER = {("ServiceAccount", AGENT_NAMESPACE, "healthagent-budget-counter"),
           ("ClusterRole", "", "healthagent-budget-counter"), ("ClusterRoleBinding", "", "healthagent-budget-counter"),
           ("Role", AGENT_NAMESPACE, "healthagent-budget-counter"),
           ("RoleBinding", AGENT_NAMESPACE, "healthagent-budget-counter"),
           ("Deployment", AGENT_NAMESPACE, "healthagent-budget-counter")}
CLUSTER_SCOPED_KINDS = ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                        "ValidatingAdmissionPolicyBinding", "FlowSchema", "PriorityLevelConfiguration")


@pytest.fixture(scope="module")
def crds(control_plane) -> list[str]:
    return install_monitoring_crds(control_plane)


@pytest.fixture(scope="module")
def kubectl_here(control_plane, kubectl, crds, tmp_path_factory) -> Kubectl:
    folder = tmp_path_factory.mktemp("chart-dry-run")
    return Kubectl(kubectl, control_plane.write_kubeconfig(folder / "kubeconfig"), folder / "cache")


# Every preset, and every component's values at once. Each component alone is the same objects as
# its Kustomize component (test_chart.py compares them object by object), and test_server_dry_run.py
# has the server accept each of those: one release with all of them here covers what only the chart
# renders (values wiring, the namespace, the policy ConfigMap) without a server round per component.
ALL_COMPONENTS = {"preset": "generic"}
for _values in COMPONENT_VALUES.values():
    for _key, _value in _values.items():
        ALL_COMPONENTS[_key] = ({**ALL_COMPONENTS.get(_key, {}), **_value}
                                if isinstance(_value, dict) and isinstance(ALL_COMPONENTS.get(_key), dict) else _value)
CASES = {**PRESETS, "generic+every-component": ALL_COMPONENTS,
         "hyperpod+dry-run": {"preset": "hyperpod", "dryRun": True}}


@pytest.mark.parametrize("case", CASES)
def test_the_server_accepts_every_preset(helm, kubectl_here, case):
    objects = helm.template(CASES[case])
    create_namespaces(kubectl_here, objects)
    problems = dry_run_problems(kubectl_here, objects)
    assert not problems, f"the API server refused or warned about preset {case}:\n" + "\n".join(problems)


# -- one release's life ----------------------------------------------------------------------------------


def env_of(daemonset: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]}


def the(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def node_policy_condition_types(api_client: Any, objects: list[dict[str, Any]]) -> str:
    policy = live(api_client, the(objects, "ValidatingAdmissionPolicy", "healthagent-own-node-only"))
    assert policy is not None
    return {v["name"]: v["expression"] for v in policy["spec"]["variables"]}["ownedConditionTypes"]


def assert_revision_is_live(api_client: Any, objects: list[dict[str, Any]]) -> None:
    """Every object of the revision is on the server, not being deleted."""
    missing = sorted(identities([o for o in objects if live(api_client, o) is None]))
    assert not missing, f"objects of the release missing on the server: {missing}"


def assert_gone(api_client: Any, objects: list[dict[str, Any]]) -> None:
    left = sorted(identities([o for o in objects if live(api_client, o) is not None]))
    assert not left, f"objects left on the server: {left}"


def verbs(api_client: Any, objects: list[dict[str, Any]]) -> set[str]:
    role = live(api_client, the(objects, "ClusterRole", "healthagent"))
    assert role is not None
    return {verb for rule in role["rules"] for verb in rule["verbs"]}


def test_install_upgrade_rollback_uninstall(helm_on_server, control_plane, crds):
    try:
        _install_upgrade_rollback_uninstall(helm_on_server, control_plane)
    finally:
        # A failure part-way must not leave the release's cluster-wide admission policies behind.
        helm_on_server.run("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--ignore-not-found")


def _install_upgrade_rollback_uninstall(helm_on_server, control_plane) -> None:
    api = control_plane.api_client()
    namespace = {"namespace": {"name": AGENT_NAMESPACE}}

    install(helm_on_server, {**namespace, "dryRun": True})
    first = manifest(helm_on_server)
    kinds = {o["kind"] for o in first}
    assert {"ServiceMonitor", "PrometheusRule", "ValidatingAdmissionPolicy", "DaemonSet"} <= kinds, \
        "the monitoring objects belong in an install where the server serves their CRDs"
    assert not identities(first) & (WRITE_ROLES | COUNTER)
    assert_revision_is_live(api, first)
    assert verbs(api, first) == {"get", "list"}
    assert env_of(live(api, the(first, "DaemonSet", "healthagent")))["HEALTHAGENT_KUBE"] == "dry-run"

    helm_ok(helm_on_server, "upgrade", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
            values={**namespace, "preset": "eks-node-repair", "budget": {"maxPercent": 5}})
    second = manifest(helm_on_server)
    assert identities(second) - identities(first) == WRITE_ROLES | COUNTER
    assert_revision_is_live(api, second)
    assert verbs(api, second) == {"get", "list", "watch", "patch"}
    env = env_of(live(api, the(second, "DaemonSet", "healthagent")))
    assert (env["HEALTHAGENT_KUBE"], env["HEALTHAGENT_CONDITION_VOCABULARY"]) == ("in-cluster", "eks")
    assert env["HEALTHAGENT_BUDGET_MAX_FRACTION"] == "0.05"
    assert "AcceleratedHardwareReady" in node_policy_condition_types(api, second)

    helm_ok(helm_on_server, "rollback", RELEASE, "1", "--namespace", RELEASE_NAMESPACE)
    assert identities(manifest(helm_on_server)) == identities(first)
    assert_revision_is_live(api, first)
    assert_gone(api, [o for o in second if (o["kind"], o["metadata"].get("namespace", ""),
                                             o["metadata"]["name"]) in WRITE_ROLES | COUNTER])
    assert verbs(api, first) == {"get", "list"}
    env = env_of(live(api, the(first, "DaemonSet", "healthagent")))
    assert env["HEALTHAGENT_KUBE"] == "dry-run" and "HEALTHAGENT_CONDITION_VOCABULARY" not in env
    assert "GpuHealthy" in node_policy_condition_types(api, first)

    helm_ok(helm_on_server, "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE)
    assert_gone(api, first + second)
    assert helm_ok(helm_on_server, "list", "--all", "--namespace", RELEASE_NAMESPACE, "--short").strip() == ""
    from kubernetes import dynamic

    resources = dynamic.DynamicClient(api).resources
    for kind in CLUSTER_SCOPED_KINDS:
        group_version = ("admissionregistration.k8s.io/v1" if kind.startswith("Validating")
                         else "flowcontrol.apiserver.k8s.io/v1" if kind in ("FlowSchema", "PriorityLevelConfiguration")
                         else "rbac.authorization.k8s.io/v1")
        left = resources.get(api_version=group_version, kind=kind).get(
            label_selector="app.kubernetes.io/part-of=healthagent").items
        assert not left, f"{kind} left after helm uninstall: {[o.metadata.name for o in left]}"
    secrets = resources.get(api_version="v1", kind="Secret").get(
        namespace=RELEASE_NAMESPACE, label_selector=f"owner=helm,name={RELEASE}").items
    assert not secrets, "helm uninstall left its release records"
