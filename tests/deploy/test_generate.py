"""deploy/generate.py: the PrometheusRule and dashboard ConfigMaps come from alerts/ and dashboards/.

The committed deploy/base/generated/ must equal a fresh generation (a rule or dashboard edited
without regenerating fails here), the rendered objects must carry the source files unchanged,
and the rule groups must pass the real ``promtool check rules``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.deploy import DEPLOY, OVERLAYS, REPO, find, render

pytestmark = pytest.mark.integration

GENERATOR = DEPLOY / "generate.py"
RULES = REPO / "alerts" / "healthagent.rules.yaml"
DASHBOARDS = REPO / "dashboards"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("deploy_generate", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_generator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_committed_output_is_up_to_date(tmp_path):
    result = run_generator("--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    fresh = {p.name: p.read_text(encoding="utf-8") for p in tmp_path.iterdir()}
    committed = {p.name: p.read_text(encoding="utf-8") for p in (DEPLOY / "base" / "generated").iterdir()}
    assert committed == fresh, "deploy/base/generated is stale: run python deploy/generate.py"
    assert run_generator("--check").returncode == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_rule_equals_the_rule_file(rendered, overlay):
    rule = find(rendered[overlay], "PrometheusRule", "healthagent")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_configmaps_equal_the_dashboard_files(rendered, overlay):
    configmaps = {o["metadata"]["name"]: o for o in rendered[overlay] if o["kind"] == "ConfigMap"}
    files = sorted(DASHBOARDS.glob("*.json"))
    assert len(configmaps) == len(files)
    for path in files:
        matching = [c for c in configmaps.values() if path.name in c["data"]]
        assert len(matching) == 1, path.name
        (configmap,) = matching
        assert configmap["data"] == {path.name: path.read_text(encoding="utf-8")}
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_rules_pass_promtool(rendered, overlay, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    rule = find(rendered[overlay], "PrometheusRule", "healthagent")
    extracted = tmp_path / "rules.yaml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}), encoding="utf-8")
    result = subprocess.run([promtool, "check", "rules", str(extracted)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# -- the generator on sources of its own -----------------------------------------------------------

RULE_FILE = """\
groups:
  - name: example
    rules:
      - alert: Example
        expr: |
          up{job="healthagent"}   
            == 0
        for: 5m
        labels: {severity: warning}
        annotations:
          description: "tab\\there, {{ $labels.node }}: it's down"
"""

DASHBOARD = '{\n  "title": "Fleet",\n  "panels": [],\t\n  "note": "trailing spaces   "\n}\n'


@pytest.fixture
def sources(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULE_FILE, encoding="utf-8")
    dashboards = tmp_path / "dashboards"
    dashboards.mkdir()
    (dashboards / "Fleet_GPU.health.json").write_text(DASHBOARD, encoding="utf-8")
    (dashboards / "efa.json").write_text('{"title": "EFA"}', encoding="utf-8")
    (dashboards / "efa.dashboard.py").write_text("not a dashboard", encoding="utf-8")
    return rules, dashboards


def test_generated_files_round_trip_exactly(generator, sources):
    rules, dashboards = sources
    files = generator.build(rules, dashboards)
    assert sorted(files) == ["dashboard-efa.yaml", "dashboard-fleet-gpu-health.yaml",
                             "kustomization.yaml", "prometheusrule.yaml"]
    rule = yaml.safe_load(files["prometheusrule.yaml"])
    assert rule["spec"]["groups"] == yaml.safe_load(RULE_FILE)["groups"]
    fleet = yaml.safe_load(files["dashboard-fleet-gpu-health.yaml"])
    assert fleet["metadata"]["name"] == "healthagent-dashboard-fleet-gpu-health"
    assert fleet["data"] == {"Fleet_GPU.health.json": DASHBOARD}
    assert fleet["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert yaml.safe_load(files["kustomization.yaml"])["resources"] == [
        "dashboard-efa.yaml", "dashboard-fleet-gpu-health.yaml", "prometheusrule.yaml"]
    assert all(text.startswith("# Generated by deploy/generate.py") for text in files.values())


def test_generated_directory_renders_with_kubectl(generator, sources, tmp_path, kubectl):
    rules, dashboards = sources
    out = tmp_path / "generated"
    generator.write(generator.build(rules, dashboards), out)
    objects = render(out, kubectl)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("ConfigMap", "healthagent-dashboard-efa"), ("ConfigMap", "healthagent-dashboard-fleet-gpu-health"),
        ("PrometheusRule", "healthagent")]
    assert find(objects, "ConfigMap", "healthagent-dashboard-fleet-gpu-health")["data"][
        "Fleet_GPU.health.json"] == DASHBOARD


def test_check_names_stale_and_leftover_files_and_write_fixes_them(generator, sources, tmp_path):
    rules, dashboards = sources
    out = tmp_path / "generated"
    args = ["--rules", str(rules), "--dashboards", str(dashboards), "--out", str(out)]
    assert run_generator(*args).returncode == 0
    assert run_generator(*args, "--check").returncode == 0
    (dashboards / "efa.json").unlink()
    (dashboards / "new.json").write_text('{"title": "New"}', encoding="utf-8")
    stale = run_generator(*args, "--check")
    assert stale.returncode == 1
    assert "dashboard-efa.yaml" in stale.stderr and "dashboard-new.yaml" in stale.stderr
    assert "kustomization.yaml" in stale.stderr
    assert run_generator(*args).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "dashboard-fleet-gpu-health.yaml", "dashboard-new.yaml", "kustomization.yaml", "prometheusrule.yaml"]


@pytest.mark.parametrize("content,fragment", [
    ("", "no `groups:` list"),
    ("groups: []\n", "no `groups:` list"),
    ("rules: [a]\n", "no `groups:` list"),
    ("groups: [\n", "not valid YAML"),
])
def test_a_bad_rule_file_is_one_clear_error(generator, tmp_path, content, fragment):
    rules = tmp_path / "rules.yaml"
    rules.write_text(content, encoding="utf-8")
    with pytest.raises(generator.GenerateError, match=fragment):
        generator.build(rules, tmp_path)
    result = run_generator("--rules", str(rules), "--dashboards", str(tmp_path), "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and fragment in result.stderr
    assert not (tmp_path / "o").exists()


def test_a_missing_rule_file_is_one_clear_error(generator, tmp_path):
    with pytest.raises(generator.GenerateError, match="cannot read"):
        generator.build(tmp_path / "absent.yaml", tmp_path)


def test_bad_dashboards_are_clear_errors(generator, sources):
    rules, dashboards = sources
    (dashboards / "broken.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(generator.GenerateError, match="broken.json: not valid JSON"):
        generator.build(rules, dashboards)
    (dashboards / "broken.json").unlink()
    (dashboards / "EFA.json").write_text("{}", encoding="utf-8")
    with pytest.raises(generator.GenerateError, match="same ConfigMap name"):
        generator.build(rules, dashboards)
    (dashboards / "EFA.json").unlink()
    (dashboards / "huge.json").write_text(json.dumps({"x": "y" * (1024 * 1024)}), encoding="utf-8")
    with pytest.raises(generator.GenerateError, match="does not fit a ConfigMap"):
        generator.build(rules, dashboards)


@pytest.mark.parametrize("file_name,expected", [
    ("fleet.json", "fleet"),
    ("Fleet_GPU.health.json", "fleet-gpu-health"),
    ("--x--.json", "x"),
])
def test_dashboard_names_are_dns_labels(generator, file_name, expected):
    assert generator.dashboard_name(Path(file_name)) == expected


def test_a_dashboard_name_without_letters_is_refused(generator):
    with pytest.raises(generator.GenerateError, match="rename it"):
        generator.dashboard_name(Path("__.json"))


def test_runbook_base_prefixes_every_runbook_path_and_nothing_else(tmp_path):
    base = "https://git.example.com/you/healthagent/blob/v0.1.0/"
    result = run_generator("--runbook-base", base, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    written = yaml.safe_load((tmp_path / "prometheusrule.yaml").read_text(encoding="utf-8"))["spec"]["groups"]
    source = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    for group, original in zip(written, source, strict=True):
        for rule, before in zip(group["rules"], original["rules"], strict=True):
            if "runbook_url" in before.get("annotations", {}):
                assert before["annotations"]["runbook_url"].startswith("docs/")
                rule["annotations"]["runbook_url"] = rule["annotations"]["runbook_url"].removeprefix(base)
            assert rule == before
    assert run_generator("--check", "--runbook-base", base, "--out", str(tmp_path)).returncode == 0
    assert run_generator("--check", "--out", str(tmp_path)).returncode == 1  # the committed paths differ


@pytest.mark.parametrize("base", ["docs", "https://git.example.com/you/healthagent", "file:///srv/docs/"])
def test_runbook_base_must_be_an_http_url_ending_in_a_slash(base, tmp_path):
    result = run_generator("--runbook-base", base, "--out", str(tmp_path))
    assert result.returncode == 2
    assert "give an http(s) URL ending in '/'" in result.stderr
    assert not (tmp_path / "prometheusrule.yaml").exists()
