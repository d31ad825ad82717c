"""Helpers for the chart tests: run the real helm on deploy/helm/healthagent, compare its objects
with the Kustomize overlays'.

helm comes from ``tests/support/helm_binary.py`` (``.venv/helm-3.17/helm``) or PATH; without it the
``helm`` fixture skips and names the command that installs it. helm runs with its own empty
config, cache and data folders, so it reads no user repositories and fetches nothing.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.deploy import DEPLOY

CHART = DEPLOY / "helm" / "healthagent"
HELM_TIMEOUT_SECONDS = 180
# The CRDs the chart's prometheus-operator objects need, as `helm template --api-versions` names
# them (an install reads them from the server's discovery instead).
MONITORING_APIS = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor",
                   "monitoring.coreos.com/v1/PrometheusRule")
# Each overlay and the values that make the chart give the same objects.
PRESETS: dict[str, dict[str, Any]] = {
    "generic": {},
    "eks-node-repair": {"preset": "eks-node-repair"},
    "hyperpod": {"preset": "hyperpod"},
    "dry-run": {"dryRun": True},
}
# Each component (added to the generic overlay) and the values that do the same.
COMPONENT_VALUES: dict[str, dict[str, Any]] = {
    "nvidia-runtime-class": {"runtimeClassName": "nvidia"},
    "podmonitor": {"monitoring": {"podMonitor": True}},
    "privileged-kernel-log": {"privilegedKernelLog": True},
    "network-policy": {"networkPolicy": {"enabled": True}},
    "network-policy-training-pods": {"networkPolicy": {"trainingPodsOnly": True}},
    "dra": {"dra": {"enabled": True}},
}
# Labels Helm's objects carry and Kustomize's do not: who manages them, not what they do.
HELM_LABELS = ("app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "app.kubernetes.io/version",
               "helm.sh/chart")
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class Helm:
    """The helm binary with private, empty config/cache/data folders and, for a server, a kubeconfig."""

    binary: str
    home: Path
    kubeconfig: Path | None = None

    def env(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("HELM_")}
        env.update(HELM_CONFIG_HOME=str(self.home / "config"), HELM_CACHE_HOME=str(self.home / "cache"),
                   HELM_DATA_HOME=str(self.home / "data"))
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        return env

    def run(self, *args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        """``helm ARGS``, with ``values`` (if any) passed as a values file on stdin."""
        extra = ("--values", "-") if values is not None else ()
        return subprocess.run([self.binary, *args, *extra], input=yaml.safe_dump(values) if values else "{}",
                              capture_output=True, text=True, env=self.env(),
                              timeout=HELM_TIMEOUT_SECONDS, check=False)

    def template(self, values: dict[str, Any] | None = None, api_versions: tuple[str, ...] = MONITORING_APIS,
                 ) -> list[dict[str, Any]]:
        """``helm template`` of the chart: its objects; an AssertionError carries helm's stderr."""
        flags = [arg for api in api_versions for arg in ("--api-versions", api)]
        result = self.run("template", "healthagent", str(CHART), *flags, values=values or {})
        assert result.returncode == 0, f"helm template failed: {result.stderr.strip()}"
        return [doc for doc in yaml.load_all(result.stdout, Loader=_SAFE_LOADER) if doc]

    def with_kubeconfig(self, kubeconfig: Path) -> "Helm":
        return Helm(self.binary, self.home, kubeconfig)


def identity(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def _cel_spaced(node: Any) -> Any:
    """CEL ``expression``/``messageExpression`` text with each run of white space as one space.

    The policies' CEL is written as folded YAML scalars with indented continuation lines, and YAML
    parsers keep different line breaks before those (Kustomize's kyaml doubles them, helm's
    go-yaml does not); CEL reads every run of white space alike, and no string literal in the
    policies holds two spaces or a line break."""
    if isinstance(node, dict):
        return {key: re.sub(r"\s+", " ", value).strip()
                if key in ("expression", "messageExpression") and isinstance(value, str) else _cel_spaced(value)
                for key, value in node.items()}
    if isinstance(node, list):
        return [_cel_spaced(item) for item in node]
    return node


def comparable(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without Helm's bookkeeping labels, its CEL white space as one space each, and its
    container env in name order (Kustomize puts the entries a patch adds first; the order carries
    no meaning: no entry refers to another)."""
    obj = _cel_spaced(copy.deepcopy(obj))
    labels = obj["metadata"].get("labels", {})
    for label in HELM_LABELS:
        labels.pop(label, None)
    if obj["kind"] == "DaemonSet":
        for container in obj["spec"]["template"]["spec"]["containers"]:
            container["env"] = sorted(container.get("env", []), key=lambda entry: entry["name"])
    return obj


def by_identity(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {identity(obj): comparable(obj) for obj in objects}
