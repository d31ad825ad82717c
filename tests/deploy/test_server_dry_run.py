"""Every render of deploy/ is accepted by a REAL kube-apiserver: a server-side apply dry run.

The OpenAPI checks in test_render.py cannot see what only the server decides: CEL in the
ValidatingAdmissionPolicy compiled for real, the CRDs' structural schemas (with their own
validation rules), defaulting, field ownership, immutable or cross-field constraints, admission.
So each render goes through the README's own command, ``kubectl apply --server-side``, with
``--dry-run=server`` added: the server runs every stage (admission included) and persists nothing.

As an install on a fresh cluster would, the render's own Namespace is applied for real first (in a
single real apply it is created before the objects inside it; in a dry run it would not exist).
The prometheus-operator CRDs come from ``find_crds()`` (``HEALTHAGENT_TEST_CRDS``, or ``crds/``
beside ``KUBEBUILDER_ASSETS``) and are installed for real once. Each
component is composed onto the generic overlay, as docs/install.md tells an operator to do.

A rejection names the object (kind, namespace/name) and the server's message; a warning the
server returns (a deprecated API, a Pod Security "would violate") fails the test as well, since an
operator would see it on every apply.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.support.deploy import COMPONENTS, DEPLOY, OVERLAYS, overlay_with_components, render
from tests.support.crds import crd_served
from tests.support.envtest import ControlPlane, find_crds, missing_crds_reason
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

KUBECTL_TIMEOUT_SECONDS = 120
CRD_ESTABLISHED_TIMEOUT_SECONDS = 120.0
APPLY = ("apply", "--server-side")  # the README's command (docs/install.md, quick start)
# --force-conflicts: other tests on the same server apply some of these objects under another
# field manager; who owns a field is not what this test is about, whether the server accepts the
# object is.
DRY_RUN = (*APPLY, "--force-conflicts", "--dry-run=server")


@dataclass(frozen=True)
class Render:
    """One thing an operator may apply: ``deploy/base``, an overlay, or generic plus a component."""

    name: str
    overlay: str | None = None
    component: str | None = None

    def directory(self, tmp: Path) -> Path:
        if self.component is not None:
            return overlay_with_components(tmp / self.name, self.overlay or "generic", [self.component])
        return DEPLOY / "overlays" / self.overlay if self.overlay else DEPLOY / "base"


RENDERS = ([Render("base")] + [Render(f"overlay-{name}", overlay=name) for name in OVERLAYS]
           + [Render(f"generic+{name}", overlay="generic", component=name) for name in COMPONENTS])


@dataclass(frozen=True)
class Kubectl:
    """kubectl bound to the test server's kubeconfig and a private discovery cache (the cache is
    fresh for this module, so it is filled after the CRDs are served, never stale before)."""

    binary: str
    kubeconfig: Path
    cache_dir: Path

    def run(self, args: tuple[str, ...], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.binary, "--kubeconfig", str(self.kubeconfig), "--cache-dir", str(self.cache_dir), *args],
            input=stdin, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_SECONDS, check=False)


def identity(obj: dict[str, Any]) -> str:
    """``Kind namespace/name`` (or ``Kind name`` when cluster-scoped): how a rejection is named."""
    meta = obj.get("metadata", {})
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind')} {where}{meta.get('name')}"


def key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    """What the server echoes back unchanged: apiVersion, kind, namespace and name."""
    meta = obj.get("metadata", {})
    return obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", "")


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False)


def server_warnings(stderr: str) -> list[str]:
    """kubectl prints each ``Warning`` header of a response as a ``Warning: ...`` line."""
    return [line for line in stderr.splitlines() if line.startswith("Warning:")]


# -- the CRDs ----------------------------------------------------------------------------------------


def crd_names(folder: Path) -> list[str]:
    """The CustomResourceDefinitions in ``folder``'s YAML files, by name (plural.group)."""
    names = []
    for path in sorted(folder.glob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                names.append(doc["metadata"]["name"])
    return names


@pytest.fixture(scope="module")
def kubectl_on_server(control_plane: ControlPlane, kubectl: str, tmp_path_factory) -> Kubectl:
    """kubectl for the real server, with prometheus-operator's CRDs installed and served."""
    crds = find_crds()
    if crds is None:
        pytest.skip(missing_crds_reason("prometheus-operator's CRDs (ServiceMonitor, PodMonitor, PrometheusRule)"))
    names = crd_names(crds)
    if not names:
        pytest.skip(f"no CustomResourceDefinition in {crds}: put their YAML there (the release assets of each project)")
    folder = tmp_path_factory.mktemp("server-dry-run")
    client = Kubectl(kubectl, control_plane.write_kubeconfig(folder / "kubeconfig"), folder / "cache")
    installed = client.run((*APPLY, "--force-conflicts", "-f", str(crds)))
    assert installed.returncode == 0, f"installing the CRDs from {crds} failed: {installed.stderr}"
    session = control_plane.admin_session()
    for name in names:
        wait_for(lambda name=name: crd_served(control_plane.url, session, name), CRD_ESTABLISHED_TIMEOUT_SECONDS,
                 f"CRD {name} Established and in discovery", retry_on=(requests.RequestException,),
                 interval=0.1)
    return client


# -- the dry run ---------------------------------------------------------------------------------------


def create_namespaces(client: Kubectl, objects: list[dict[str, Any]]) -> None:
    """Apply the render's own Namespaces for real, as the first objects of a real install."""
    namespaces = [obj for obj in objects if obj.get("kind") == "Namespace" and obj.get("apiVersion") == "v1"]
    if not namespaces:
        return
    result = client.run((*APPLY, "--force-conflicts", "-f", "-"), to_yaml(namespaces))
    assert result.returncode == 0, f"creating the namespaces for real failed: {result.stderr}"


def rejection(client: Kubectl, obj: dict[str, Any]) -> str | None:
    """The server's answer to ``obj`` dry-run alone: None when accepted, else its message.

    Used only after the whole render failed: kubectl's message for a missing namespace, say, does
    not name the object it was about, so each object is asked about on its own."""
    result = client.run((*DRY_RUN, "-f", "-", "-o", "json"), to_yaml([obj]))
    if result.returncode == 0:
        return None
    return result.stderr.strip() or f"kubectl exited {result.returncode} with no message"


def dry_run_problems(client: Kubectl, objects: list[dict[str, Any]]) -> list[str]:
    """Every rejection (``Kind ns/name: message``) and every server warning for the render."""
    whole = client.run((*DRY_RUN, "-f", "-", "-o", "json"), to_yaml(objects))
    problems = [f"server warning: {line}" for line in server_warnings(whole.stderr)]
    if whole.returncode != 0:  # with an error kubectl prints no List: ask object by object
        refused = [f"{identity(obj)}: {message}" for obj in objects
                   if (message := rejection(client, obj)) is not None]
        return problems + (refused or [f"kubectl exited {whole.returncode}: {whole.stderr.strip()}"])
    echoed = json.loads(whole.stdout)
    returned = {key(item) for item in echoed.get("items", [echoed])}
    problems += [f"{identity(obj)}: not returned by the server's dry run (a namespaced object "
                 f"without metadata.namespace lands in whatever namespace the kubeconfig names)"
                 for obj in objects if key(obj) not in returned]
    return problems


@pytest.mark.parametrize("target", RENDERS, ids=[r.name for r in RENDERS])
def test_server_accepts_every_object(target: Render, kubectl_on_server: Kubectl, tmp_path: Path) -> None:
    objects = render(target.directory(tmp_path), kubectl_on_server.binary)
    assert objects, f"{target.name} rendered nothing"
    create_namespaces(kubectl_on_server, objects)
    problems = dry_run_problems(kubectl_on_server, objects)
    assert not problems, (f"the API server refused or warned about {target.name} "
                          f"({len(objects)} objects):\n" + "\n".join(problems))
