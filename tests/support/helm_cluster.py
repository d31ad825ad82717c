"""The chart on a real kube-apiserver: a control plane of the module's own, helm bound to it.

The chart owns cluster-scoped objects (ClusterRole, the admission policies) and the Namespace
``healthagent``, which other test modules apply to the session's server under their own field
managers; helm refuses to adopt objects it did not create. So a chart module takes a fresh etcd
and kube-apiserver (the ``control_plane`` fixture below replaces the session's for that module).
Without a controller-manager a deleted Namespace stays Terminating: the tests accept that state
(deletionTimestamp set) as gone.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import requests
import yaml

from tests.support import helm_binary
from tests.support.crds import crd_served
from tests.support.envtest import ControlPlane, find_assets, find_crds, missing_crds_reason, missing_reason
from tests.support.helm import CHART, Helm
from tests.support.wait import wait_for

RELEASE = "healthagent"
RELEASE_NAMESPACE = "default"  # the release record; the agent's objects go where the chart says
CRD_TIMEOUT_SECONDS = 120.0
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@pytest.fixture(scope="module", name="control_plane")
def own_control_plane(tmp_path_factory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver for this module alone."""
    assets = find_assets()
    if assets is None:
        pytest.skip(missing_reason())
    with ControlPlane(assets, tmp_path_factory.mktemp("envtest-chart")) as plane:
        yield plane


@pytest.fixture(scope="module", name="helm")
def helm_fixture(tmp_path_factory) -> Helm:
    binary = helm_binary.helm_path()
    if binary is None:
        pytest.skip(helm_binary.missing_reason())
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def helm_on_server(control_plane: ControlPlane, helm: Helm, tmp_path_factory) -> Helm:
    """helm with a kubeconfig for the module's server (the admin's client certificate)."""
    folder = tmp_path_factory.mktemp("helm-kubeconfig")
    return helm.with_kubeconfig(control_plane.write_kubeconfig(folder / "kubeconfig"))


def install_monitoring_crds(control_plane: ControlPlane) -> list[str]:
    """prometheus-operator's CRDs from ``find_crds()``, created and served; their names."""
    folder = find_crds()
    if folder is None:
        pytest.skip(missing_crds_reason("prometheus-operator's CRDs (ServiceMonitor, PodMonitor, PrometheusRule)"))
    session = control_plane.admin_session()
    names = []
    for path in sorted(folder.glob("*.y*ml")):
        for crd in yaml.load_all(path.read_text(encoding="utf-8"), Loader=_SAFE_LOADER):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            reply = session.post(f"{control_plane.url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                                 json=crd, timeout=30)
            assert reply.status_code in (201, 409), f"creating CRD {crd['metadata']['name']}: {reply.text}"
            names.append(crd["metadata"]["name"])
    for name in names:
        wait_for(lambda name=name: crd_served(control_plane.url, session, name), CRD_TIMEOUT_SECONDS,
                 f"CRD {name} served", retry_on=(requests.RequestException,), interval=0.1)
    return names


def helm_ok(helm: Helm, *args: str, values: dict[str, Any] | None = None) -> str:
    """``helm ARGS`` that must succeed; its stdout."""
    result = helm.run(*args, values=values)
    assert result.returncode == 0, f"helm {' '.join(args)} failed: {result.stderr.strip()}"
    return result.stdout


def install(helm: Helm, values: dict[str, Any]) -> None:
    """``helm install`` from the local chart: no repository, nothing fetched, no --wait (no kubelet
    runs on the test server, so no pod ever becomes ready)."""
    helm_ok(helm, "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, values=values)


def manifest(helm: Helm, revision: int | None = None) -> list[dict[str, Any]]:
    """The objects of the release (of ``revision``) as helm recorded them."""
    extra = ("--revision", str(revision)) if revision is not None else ()
    text = helm_ok(helm, "get", "manifest", RELEASE, "--namespace", RELEASE_NAMESPACE, *extra)
    return [doc for doc in yaml.load_all(text, Loader=_SAFE_LOADER) if doc]


def live(api_client: Any, obj: dict[str, Any]) -> dict[str, Any] | None:
    """The server's copy of ``obj`` (by apiVersion, kind, namespace, name), or None when it is gone:
    absent, or being deleted (a Namespace stays Terminating without a controller-manager)."""
    from kubernetes import dynamic
    from kubernetes.client.exceptions import ApiException

    resource = dynamic.DynamicClient(api_client).resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    try:
        found = resource.get(name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace")).to_dict()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return None if found["metadata"].get("deletionTimestamp") else found


def identities(objects: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objects}
