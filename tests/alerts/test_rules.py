"""alerts/healthagent.rules.yaml: promtool checks it, its unit tests pass, and they can fail.

The promtool unit tests (alerts/tests/*.yaml) hold the behaviour; this module runs them and
checks what they must cover: every alert, at its ``for:`` boundary, with a case that must not
fire. The boundary is proven rather than trusted: each alert's ``for:`` is moved by one
evaluation interval in a copy of the rules and the unit tests must then fail.
"""

from __future__ import annotations

import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from tests.support.observability import (
    FINDING_CODES,
    REPO,
    RULE_TESTS_DIR,
    RULES_FILE,
    alert_rules,
    contract_metric_names,
    duration_seconds,
    format_duration,
    load_rules,
    metric_names_in,
    recording_rules,
    require_binary,
    run_tool,
)

ALERTS = alert_rules()
ALERT_NAMES = [a["alert"] for a in ALERTS]
TEST_FILES = sorted(RULE_TESTS_DIR.glob("*.yaml"))

# The alerts the rules must have (at least), by what they are about.
REQUIRED_ALERTS = {
    "HealthagentNodeNeedsReplacement", "HealthagentNodeNeedsReboot", "HealthagentGpuDoubleBitError",
    "HealthagentGpuRowRemapFailure", "HealthagentGpuRowRemapPending", "HealthagentGpuLost",
    "HealthagentGpuSbeStorm", "HealthagentEfaPortDown", "HealthagentEfaUnresponsiveRemote",
    "HealthagentBudgetExhausted", "HealthagentAgentDown", "HealthagentAgentAbsent",
    "HealthagentSourceFailing", "HealthagentTrainingStalled", "HealthagentTrainingThroughputDropped",
    "HealthagentTrainingWorldSizeBelowMax", "HealthagentBudgetSaturated", "HealthagentHandOffStuck",
    "HealthagentConditionOwnedElsewhere", "HealthagentRemediationFlapping",
}
# Alerts that are not about one node (fleet-wide, per budget scope or per training job): no `node` label.
NODELESS = {"HealthagentAgentAbsent", "HealthagentTrainingStalled", "HealthagentTrainingThroughputDropped",
            "HealthagentTrainingWorldSizeBelowMax", "HealthagentBudgetSaturated"}
PER_GPU = {"HealthagentGpuDoubleBitError", "HealthagentGpuRowRemapFailure", "HealthagentGpuRowRemapPending",
           "HealthagentGpuLost", "HealthagentGpuSbeStorm"}
# A runbook is a section of a file in docs/, by repository path: a finding code's section of
# findings.md (the code in lower case, or the alert's own `code` label), another section there, or
# one of operations.md. deploy/generate.py --runbook-base puts a served address in front.
RUNBOOK_RE = re.compile(r"(?P<file>docs/(?:findings|operations|remediation)\.md)#(?P<anchor>[a-z0-9_-]+|"
                        r"(?P<by_code>\{\{ \$labels\.code \| toLower \}\}))")


def _promtool() -> str:
    return require_binary("promtool")


# -- promtool ------------------------------------------------------------------------------------

@pytest.mark.integration
def test_promtool_check_rules():
    result = run_tool(_promtool(), "check", "rules", str(RULES_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS) + len(recording_rules())} rules found" in result.stdout


@pytest.mark.integration
def test_the_documented_rule_files_config_loads_the_rules(tmp_path):
    """docs/alerts.md's prometheus.yml, beside a copy of the rule file, passes ``promtool check
    config``, which loads every rule file the configuration names."""
    doc = (REPO / "docs" / "alerts.md").read_text(encoding="utf-8")
    section = doc.split("## Loading the rules without prometheus-operator", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    assert yaml.safe_load(block)["rule_files"] == [RULES_FILE.name]
    (tmp_path / "prometheus.yml").write_text(block, encoding="utf-8")
    shutil.copy(RULES_FILE, tmp_path / RULES_FILE.name)
    result = run_tool(_promtool(), "check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS) + len(recording_rules())} rules found" in result.stdout, result.stdout


@pytest.mark.integration
def test_promtool_unit_tests_pass():
    result = run_tool(_promtool(), "test", "rules", *map(str, TEST_FILES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(TEST_FILES)


def _copy_with_rules(tmp_path: Path, rules: dict, alertname: str) -> list[Path]:
    """The unit tests of ``alertname`` alone, against a (changed) rule file holding that alert and
    every recording rule, copied to tmp_path.

    promtool evaluates every rule of the file at every step of every test group, so the copy
    keeps only what can decide this alert's cases: its own rule, the recording rules it may read,
    and the test groups (and in them the cases) about it. A failure can then only be this alert's.
    """
    kept_rules = {"groups": [
        {**group, "rules": [r for r in group["rules"] if "record" in r or r.get("alert") == alertname]}
        for group in rules["groups"]]}
    kept_rules["groups"] = [g for g in kept_rules["groups"] if g["rules"]]
    (tmp_path / RULES_FILE.name).write_text(yaml.safe_dump(kept_rules, sort_keys=False), encoding="utf-8")
    tests = tmp_path / "tests"
    tests.mkdir()
    copies = []
    for source in TEST_FILES:
        document = yaml.safe_load(source.read_text(encoding="utf-8"))
        groups = []
        for group in document["tests"]:
            cases = [c for c in group.get("alert_rule_test", []) if c["alertname"] == alertname]
            if cases:
                groups.append({key: value for key, value in group.items() if key != "promql_expr_test"}
                              | {"alert_rule_test": cases})
        if groups:
            copy = tests / source.name
            copy.write_text(yaml.safe_dump(document | {"tests": groups}, sort_keys=False), encoding="utf-8")
            copies.append(copy)
    assert copies, f"no unit test names {alertname}"
    return copies


@pytest.mark.integration
@pytest.mark.parametrize("alertname", ALERT_NAMES)
@pytest.mark.parametrize("shift", [-1, +1], ids=["for-shorter", "for-longer"])
def test_unit_tests_pin_the_for_boundary(tmp_path, alertname, shift):
    """One evaluation interval less and the "not yet" case fires; one more and the boundary case
    does not: either way promtool must report a failure for this very alert."""
    rules = load_rules()
    rule = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alertname)
    interval = min(duration_seconds(yaml.safe_load(f.read_text())["evaluation_interval"]) for f in TEST_FILES)
    rule["for"] = format_duration(duration_seconds(rule["for"]) + shift * interval)
    result = run_tool(_promtool(), "test", "rules", *map(str, _copy_with_rules(tmp_path, rules, alertname)))
    assert result.returncode != 0, f"{alertname} with for={rule['for']} still passes its unit tests"
    assert f"alertname: {alertname}," in result.stdout + result.stderr


@pytest.mark.integration
def test_unit_tests_fail_when_an_alert_never_fires(tmp_path):
    rules = load_rules()
    rule = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "HealthagentGpuLost")
    rule["expr"] = "vector(1) == 0"
    result = run_tool(_promtool(), "test", "rules",
                      *map(str, _copy_with_rules(tmp_path, rules, "HealthagentGpuLost")))
    assert result.returncode != 0
    assert "alertname: HealthagentGpuLost," in result.stdout + result.stderr


# -- what the unit tests cover -----------------------------------------------------------------

def _cases() -> dict[str, list[tuple[str, float, list]]]:
    """alertname -> [(test group name, eval time in s, expected alerts)] over all test files."""
    cases = defaultdict(list)
    for f in TEST_FILES:
        for group in yaml.safe_load(f.read_text())["tests"]:
            for case in group.get("alert_rule_test", []):
                cases[case["alertname"]].append(
                    (f"{f.name}:{group['name']}", duration_seconds(case["eval_time"]), case.get("exp_alerts") or []))
    return cases


CASES = _cases()


def test_required_alerts_exist():
    assert REQUIRED_ALERTS <= set(ALERT_NAMES)
    assert len(ALERT_NAMES) == len(set(ALERT_NAMES))


@pytest.mark.parametrize("alertname", ALERT_NAMES)
def test_every_alert_has_a_boundary_case(alertname):
    """A firing case at time T and, in the same test group, an empty case one interval before T."""
    cases = CASES[alertname]
    firing = [(group, t) for group, t, exp in cases if exp]
    quiet = {(group, t) for group, t, exp in cases if not exp}
    assert firing, f"no unit test expects {alertname} to fire"
    assert any((group, t - 60) in quiet for group, t in firing), f"no 'one evaluation before' case for {alertname}"


@pytest.mark.parametrize("alertname", ALERT_NAMES)
def test_firing_cases_carry_node_and_gpu_labels(alertname):
    """Inhibition and grouping match on `node`; GPU alerts also say which GPU."""
    rule = next(a for a in ALERTS if a["alert"] == alertname)
    for _, _, expected in CASES[alertname]:
        for alert in expected:
            labels = alert["exp_labels"]
            assert labels["severity"] == rule["labels"]["severity"]
            assert ("node" in labels) == (alertname not in NODELESS), labels
            if alertname in PER_GPU:
                assert {"gpu", "uuid"} <= set(labels), labels


# -- rule hygiene ------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_alert_labels_and_annotations(rule):
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    assert rule["labels"]["team"] in {"hardware", "platform", "training"}
    assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
    assert duration_seconds(rule["for"]) > 0
    if rule["labels"]["severity"] == "critical" and rule["labels"]["team"] == "hardware":
        assert duration_seconds(rule["for"]) <= 300, "hardware-critical alerts must not wait long"


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_runbook_is_a_section_of_the_docs(rule):
    """Each runbook_url names a docs file of this repository and an anchor that file has."""
    url = rule["annotations"]["runbook_url"]
    match = RUNBOOK_RE.fullmatch(url)
    assert match, f"{rule['alert']}: runbook_url {url!r} is not a section of docs/findings.md, operations.md or remediation.md"
    anchors = _github_anchors(REPO / match.group("file"))
    if match.group("by_code"):  # one alert for every code: every code's section must be there
        missing = sorted(code for code in FINDING_CODES if code.lower() not in anchors)
        assert not missing, f"{match.group('file')} has no section for {missing}"
    else:
        assert match.group("anchor") in anchors, f"{match.group('file')} has no section #{match.group('anchor')}"


def test_runbook_anchors_follow_githubs_rule():
    """The anchor rule used above, on headings of the kinds the docs have."""
    assert _anchors_of("## GPU_ECC_DBE\n## Actions, verdict and exit codes\n### Agent down\n") == {
        "gpu_ecc_dbe", "actions-verdict-and-exit-codes", "agent-down"}


def _github_anchors(path: Path) -> set[str]:
    return _anchors_of(path.read_text(encoding="utf-8"))


def _anchors_of(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ +(.+?)\s*$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


@pytest.mark.parametrize("rule", alert_rules() + recording_rules(), ids=lambda r: r.get("alert") or r["record"])
def test_rules_name_only_contract_metrics(rule):
    assert metric_names_in(rule["expr"]) <= contract_metric_names()
