"""The Helm chart deploy/helm/healthagent, offline: lint, schema, README, and one truth with Kustomize.

The Kustomize overlays are the source (docs/design.md, "One truth"): what the access, RBAC and
admission tests prove is proven on them. The chart's alerts, dashboards and admission policies are
the base's own files (copied into files/ by deploy/generate.py); every other object is written as a
template, and here each overlay (and each component) must give exactly the objects its preset
(and values) give, so a change to one that the other lacks fails.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from healthagent.config import load_settings
from healthagent.model import Action
from healthagent.policy.settings import load_policy

from tests.support.deploy import DEPLOY, OVERLAY_COMPONENTS, REPO, overlay_with_components, render
from tests.support.helm import CHART, COMPONENT_VALUES, PRESETS, by_identity
from tests.support.helm_cluster import helm_fixture  # noqa: F401 (helm: a fixture)

pytestmark = pytest.mark.integration

WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*"}


def test_the_chart_lints_strict(helm):
    result = helm.run("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", [*PRESETS.values(), {"preset": "hyperpod", "dryRun": True},
                                    {"preset": "eks-node-repair", "dryRun": True}],
                         ids=[*PRESETS, "hyperpod+dry-run", "eks-node-repair+dry-run"])
def test_every_preset_lints_strict(helm, values):
    result = helm.run("lint", "--strict", str(CHART), values=values)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overlay", PRESETS)
def test_each_overlay_and_its_preset_give_the_same_objects(helm, kubectl, rendered, overlay):
    from_kustomize = by_identity(rendered[overlay])
    from_helm = by_identity(helm.template(PRESETS[overlay]))
    assert sorted(from_helm) == sorted(from_kustomize), "the chart and the overlay install different objects"
    for key, obj in from_kustomize.items():
        assert from_helm[key] == obj, f"{overlay}: {key} differs between the overlay and the chart"


@pytest.mark.parametrize("component", COMPONENT_VALUES)
def test_each_component_and_its_values_give_the_same_objects(helm, kubectl, tmp_path, component):
    from_kustomize = by_identity(render(overlay_with_components(tmp_path, "generic", [component]), kubectl))
    from_helm = by_identity(helm.template(COMPONENT_VALUES[component]))
    assert sorted(from_helm) == sorted(from_kustomize)
    for key, obj in from_kustomize.items():
        assert from_helm[key] == obj, f"{component}: {key} differs between the component and the chart"


def test_every_component_has_its_values():
    folders = {path.name for path in (DEPLOY / "components").iterdir() if path.is_dir()}
    # The overlays include the budget counter themselves: the presets carry it (compared above).
    assert folders - set(OVERLAY_COMPONENTS) == set(COMPONENT_VALUES)


@pytest.mark.parametrize("preset", ["generic", "eks-node-repair", "hyperpod"])
def test_dry_run_grants_no_write_with_any_preset(helm, preset):
    objects = helm.template({"preset": preset, "dryRun": True})
    roles = [o for o in objects if o["kind"] in ("Role", "ClusterRole")]
    assert [r["metadata"]["name"] for r in roles] == ["healthagent"]
    granted = {verb for role in roles for rule in role["rules"] for verb in rule["verbs"]}
    assert granted == {"get", "list"} and not granted & WRITE_VERBS
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    env = {e["name"]: e.get("value") for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HEALTHAGENT_KUBE"] == "dry-run"


def test_without_the_crds_the_monitoring_objects_are_left_out(helm):
    kinds = {o["kind"] for o in helm.template(api_versions=())}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    assert {"DaemonSet", "ValidatingAdmissionPolicy", "ConfigMap"} <= kinds


def test_the_hyperpod_instance_types_are_one_list_for_affinity_and_budget(helm):
    types = ["ml.p5.48xlarge", "ml.g6e.48xlarge"]
    (daemonset,) = [o for o in helm.template({"preset": "hyperpod", "hyperpod": {"instanceTypes": types}})
                    if o["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[1]["matchExpressions"][1]["values"] == types
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["HEALTHAGENT_BUDGET_NODE_SELECTOR"].endswith("in (ml.p5.48xlarge,ml.g6e.48xlarge)")


def test_settings_values_reach_the_agent_and_are_valid_config(helm, tmp_path):
    policy = {"xid": {"79": "replace_node"}, "disabled_rules": ["GPU_POWER_THROTTLE"]}
    values = {"budget": {"maxPercent": 2.5, "maxNodes": 4, "scopeLabel": "karpenter.sh/nodepool"},
              "taint": {"noExecuteGraceSeconds": 0}, "policy": policy}
    objects = helm.template(values)
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HEALTHAGENT_BUDGET_MAX_FRACTION"] == "0.025"
    assert env["HEALTHAGENT_BUDGET_MAX_NODES"] == "4"
    assert env["HEALTHAGENT_BUDGET_SCOPE_LABEL"] == "karpenter.sh/nodepool"
    assert env["HEALTHAGENT_REPLACE_NOEXECUTE_GRACE_SECONDS"] == "0"
    assert env["HEALTHAGENT_POLICY_FILE"] == "/etc/healthagent/policy.yaml"
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "healthagent-policy"]
    (tmp_path / "policy.yaml").write_text(configmap["data"]["policy.yaml"], encoding="utf-8")
    loaded = load_policy(str(tmp_path / "policy.yaml"))  # the agent's own parsers take every value
    assert loaded.xid_actions == {79: Action.REPLACE_NODE} and not loaded.enabled("GPU_POWER_THROTTLE")
    settings = load_settings(env={k: v for k, v in env.items() if k.startswith("HEALTHAGENT_BUDGET")})
    assert settings.budget_max_fraction == 0.025 and settings.budget_max_nodes == 4
    for version in ("1.30.0", kubernetes_validate.latest_version()):
        for obj in objects:
            if not obj["apiVersion"].startswith("monitoring.coreos.com"):
                kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("values, key, says", [
    ({"budget": {"maxPercent": 150}}, "budget.maxPercent", "less than or equal to 100"),
    ({"budget": {"maxPercent": -1}}, "budget.maxPercent", "greater than or equal to 0"),
    ({"conditionVocabulary": "aws"}, "conditionVocabulary", "must be one of the following"),
    ({"preset": "karpenter"}, "preset", "must be one of the following"),
    ({"taint": {"noExecuteGraceSeconds": -5}}, "taint.noExecuteGraceSeconds", "greater than or equal to 0"),
    ({"budget": {"maxNodes": 1.5}}, "budget.maxNodes", "Invalid type"),
    ({"namespace": {"name": "Health_Agent"}}, "namespace.name", "pattern"),
    ({"budget": {"maxFraction": 0.1}}, "budget", "maxFraction"),
])
def test_the_schema_refuses_bad_values_naming_the_key(helm, values, key, says):
    result = helm.run("template", "healthagent", str(CHART), values=values)
    assert result.returncode != 0
    problems = [line for line in result.stderr.splitlines() if line.startswith("- ")]
    assert len(problems) == 1, result.stderr
    assert problems[0].startswith(f"- {key}") and says in problems[0], result.stderr


def test_the_readme_values_table_is_the_schemas():
    result = subprocess.run([sys.executable, str(DEPLOY / "chart_readme.py"), "--check"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_every_value_is_in_the_schema_with_its_default(helm):
    """values.yaml and the schema's defaults say the same, so the README's table is true."""
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))

    def defaults(node: dict[str, Any]) -> dict[str, Any]:
        return {name: defaults(spec) if spec.get("type") == "object" and "properties" in spec else spec["default"]
                for name, spec in node["properties"].items()}

    assert defaults(schema) == values


def test_the_chart_files_are_the_bases(tmp_path: Path):
    """files/ holds deploy/generate.py's output and the base's admission policies byte for byte."""
    result = subprocess.run([sys.executable, str(DEPLOY / "generate.py"), "--check"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert ((CHART / "files" / "admission-policy.yaml").read_bytes()
            == (DEPLOY / "base" / "admission-policy.yaml").read_bytes())
    assert (REPO / "deploy" / "helm" / "healthagent" / "Chart.yaml").is_file()


def helm_commands(markdown: Path) -> list[list[str]]:
    """The ``helm`` lines of the first bash block holding one, split as a shell would."""
    blocks = re.findall(r"```bash\n(.*?)```", markdown.read_text(encoding="utf-8"), flags=re.S)
    (block,) = [b for b in blocks if "\nhelm " in "\n" + b][:1]
    return [shlex.split(line.replace("$REGISTRY", "registry.example.com"))
            for line in block.splitlines() if line.startswith("helm ")]


@pytest.mark.parametrize("markdown", [REPO / "README.md", CHART / "README.md"], ids=["README", "chart-README"])
def test_the_readmes_install_in_two_helm_commands_dry_run_first(helm, markdown):
    install, upgrade = helm_commands(markdown)
    assert install[:4] == ["helm", "install", "healthagent", "deploy/helm/healthagent"]
    assert upgrade[:4] == ["helm", "upgrade", "healthagent", "deploy/helm/healthagent"] and "--reuse-values" in upgrade

    def rendered(flags: list[str]) -> dict[str, str]:
        result = helm.run("template", "healthagent", str(CHART), *flags)
        assert result.returncode == 0, result.stderr
        (daemonset,) = [o for o in yaml.safe_load_all(result.stdout) if o and o["kind"] == "DaemonSet"]
        container = daemonset["spec"]["template"]["spec"]["containers"][0]
        return {"image": container["image"], **{e["name"]: e.get("value") for e in container["env"]}}

    first = rendered(install[4:])
    assert first["image"] == "registry.example.com/healthagent:0.1.0" and first["HEALTHAGENT_KUBE"] == "dry-run"
    second = rendered(install[4:] + [f for f in upgrade[4:] if f != "--reuse-values"])
    assert second["image"] == first["image"] and second["HEALTHAGENT_KUBE"] == "in-cluster"
