"""Every alert's words agree with what the agent does (``tests/support/alert_claims.py``).

The summary, the description and the docs/alerts.md row of each alert are read as claims about
the taint, its effect, its timing and the findings behind a verdict, and each claim is checked
against the behaviour the code has under the default settings and policy. The rule file, the
PrometheusRule generated from it and the docs are all read. The mutation cases prove the check
bites: the same words fail once the settings, the policy or the catalogs say otherwise, and the
words this project once shipped ("NoSchedule only" for reboot_node) fail as they are.
"""

from __future__ import annotations

import copy
import re

import yaml

from healthagent.config import Settings
from healthagent.model import Action
from healthagent.policy.mlx5_catalog import load_mlx5_catalog
from healthagent.policy.settings import parse_policy
from tests.support.alert_claims import ALERTS_DOC, Behaviour, contradictions
from tests.support.observability import REPO, alert_rules, load_rules, recording_rules

GENERATED = REPO / "deploy" / "base" / "generated" / "prometheusrule.yaml"
METRICS_DOC = REPO / "docs" / "reference" / "metrics.md"
ALERTS = alert_rules()


def _alert(alerts: list[dict], name: str) -> dict:
    return next(a for a in alerts if a["alert"] == name)


def _named(found: list[str], alert: str) -> list[str]:
    return [line for line in found if line.startswith(alert + " ")]


def test_every_alert_tells_the_truth_under_the_default_settings():
    assert contradictions(ALERTS, Behaviour()) == []


def test_the_generated_prometheus_rule_tells_the_same_truth():
    groups = yaml.safe_load(GENERATED.read_text(encoding="utf-8"))["spec"]["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert [a["alert"] for a in alerts] == [a["alert"] for a in ALERTS]
    assert contradictions(alerts, Behaviour()) == []


def test_the_claims_read_what_the_reboot_alert_says_about_eviction():
    """The claims are not vacuous: the reboot alert's texts each carry a checked taint claim."""
    found = contradictions([_alert(ALERTS, "HealthagentNodeNeedsReboot")],
                           Behaviour(Settings(reboot_node_noexecute=False)))
    assert {line.split(" (")[1].split(")")[0] for line in found} == {"description", "docs/alerts.md"}


# -- mutations: the words stay, the behaviour changes (or the other way round) ------------------------

def test_reboot_without_noexecute_contradicts_the_reboot_alert():
    found = contradictions(ALERTS, Behaviour(Settings(reboot_node_noexecute=False)))
    assert _named(found, "HealthagentNodeNeedsReboot"), found
    assert not _named(found, "HealthagentNodeNeedsReplacement"), found
    assert all("NoSchedule, then NoExecute" in line for line in found), found


def test_the_words_once_shipped_for_reboot_fail():
    alerts = copy.deepcopy(ALERTS)
    _alert(alerts, "HealthagentNodeNeedsReboot")["annotations"]["description"] = (
        "The healthagent verdict for node {{ $labels.node }} is reboot_node. The agent's taint is NoSchedule "
        "only: pods already on the node keep running on the faulty hardware until the node is drained and "
        "rebooted.")
    found = _named(contradictions(alerts, Behaviour()), "HealthagentNodeNeedsReboot")
    assert found and all("the pods stay on the node" in line for line in found), found


def test_the_row_once_shipped_in_the_docs_fails():
    doc = ALERTS_DOC.read_text(encoding="utf-8")
    row = next(line for line in doc.splitlines() if line.startswith("| `HealthagentNodeNeedsReboot`"))
    old = ("| `HealthagentNodeNeedsReboot` | critical / hardware | the verdict is `reboot_node` (2m). Critical because "
           "the agent's taint for a reboot is NoSchedule only: the pods already on the node keep running on the "
           "faulty hardware | [findings.md](findings.md#actions-verdict-and-exit-codes) |")
    found = contradictions([_alert(ALERTS, "HealthagentNodeNeedsReboot")], Behaviour(), doc.replace(row, old))
    assert [line for line in found if "(docs/alerts.md)" in line], found


def test_another_grace_contradicts_both_node_alerts():
    found = contradictions(ALERTS, Behaviour(Settings(replace_noexecute_grace_seconds=300)))
    for alert in ("HealthagentNodeNeedsReboot", "HealthagentNodeNeedsReplacement"):
        assert any("says the grace is 120 s; it is 300 s" in line for line in _named(found, alert)), found


def test_an_xid_given_as_an_example_must_lead_to_the_verdict():
    found = contradictions(ALERTS, Behaviour(policy=parse_policy({"xid": {94: "restart_app"}})))
    assert _named(found, "HealthagentNodeNeedsReplacement") == [
        "HealthagentNodeNeedsReplacement (description): XIDs that lead to the verdict: gives XID 94 as an "
        "example; its catalog action is restart_app",
        "HealthagentNodeNeedsReplacement (docs/alerts.md): XIDs that lead to the verdict: gives XID 94 as an "
        "example; its catalog action is restart_app"]


def test_a_slower_port_down_rule_contradicts_the_port_alert():
    found = contradictions(ALERTS, Behaviour(policy=parse_policy({"findings": {"RDMA_PORT_DOWN": {"sustain": "60s"}}})))
    assert any("RDMA_PORT_DOWN opens after 30 s; its rule's sustain is 60 s" in line
               for line in _named(found, "HealthagentInfinibandPortDown")), found


def test_an_adapter_event_overridden_below_a_node_action_contradicts_the_adapter_alert():
    found = contradictions(ALERTS, Behaviour(policy=parse_policy({"mlx5": {"cmd_timeout": "monitor"}})))
    assert any("RDMA_ADAPTER_EVENT takes the node out; its action is monitor" in line
               for line in _named(found, "HealthagentRdmaAdapterFatal")), found


def test_a_repeat_rule_turned_off_contradicts_the_adapter_alert():
    found = contradictions(ALERTS, Behaviour(policy=parse_policy({"thresholds": {"mlx5_repeat_seconds": 0}})))
    assert any("mlx5_repeat_seconds is 0" in line for line in _named(found, "HealthagentRdmaAdapterFatal")), found


def test_another_storm_threshold_contradicts_the_storm_alert():
    found = contradictions(ALERTS, Behaviour(policy=parse_policy({"thresholds": {"sbe_storm_per_minute": 20}})))
    assert _named(found, "HealthagentGpuSbeStorm") == [
        "HealthagentGpuSbeStorm (docs/alerts.md): the expression is a policy default: says it is GPU_SBE_STORM's "
        "default; the expression's rate is not > 20 per minute"]


def test_a_budget_that_evicts_held_nodes_would_contradict_the_budget_alerts(monkeypatch):
    """Should the taint plan ever evict a node the budget holds, the budget alerts' words fail."""
    import tests.support.alert_claims as claims

    real = claims.plan_taint
    monkeypatch.setattr(claims, "plan_taint", lambda **kw: real(**{**kw, "held": False}))
    found = contradictions(ALERTS, Behaviour())
    for alert in ("HealthagentBudgetExhausted", "HealthagentBudgetSaturated"):
        assert _named(found, alert), found


def test_a_reboot_taint_that_outlived_the_reboot_would_contradict_the_reboot_alert(monkeypatch):
    import tests.support.alert_claims as claims

    real = claims.decide
    monkeypatch.setattr(claims, "decide", lambda verdict, node, *a, **kw: real(verdict, {
        **node, "status": {"nodeInfo": {"bootID": "boot-a"}}}, *a, **kw))
    found = contradictions(ALERTS, Behaviour())
    assert [line.split(": ", 1)[1].split(";")[0] for line in found] == [
        "the taint clears after the reboot: says the taint clears after the reboot once the checks pass"]


def test_words_about_behaviour_that_no_claim_reads_fail():
    alerts = copy.deepcopy(ALERTS)
    _alert(alerts, "HealthagentGpuLost")["annotations"]["description"] += " The pods are evicted within 5 s."
    found = contradictions(alerts, Behaviour())
    assert [line.split(": ", 1)[1].split(" in:")[0] for line in found] == [
        "unchecked claim about 'evicted'", "unchecked claim about '5 s'"]


# -- the ConnectX alert and the catalog ---------------------------------------------------------------

def test_the_adapter_alert_fires_for_exactly_the_catalogs_reboot_node_events():
    expr = _alert(ALERTS, "HealthagentRdmaAdapterFatal")["expr"]
    listed = set(re.search(r'event=~"([^"]*)"', expr).group(1).split("|"))
    reboot = {e.event for e in load_mlx5_catalog({}).entries() if e.action is Action.REBOOT_NODE}
    assert listed == reboot


# -- the recording rules the docs name ----------------------------------------------------------------

DOCS_WITH_RULES = sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "docs" / "reference").glob("*.md")) + [
    REPO / "README.md"]


def _named_in_docs(pattern: str) -> set[tuple[str, str]]:
    return {(path.name, name) for path in DOCS_WITH_RULES
            for name in re.findall(pattern, path.read_text(encoding="utf-8"))}


def test_every_rule_group_the_docs_name_exists():
    groups = {g["name"] for g in load_rules()["groups"]}
    named = _named_in_docs(r"groups? `(healthagent-[a-z-]+)`")
    assert named, "no doc names a rule group"
    assert {(doc, name) for doc, name in named if name not in groups} == set()


def test_every_recording_rule_the_docs_name_exists():
    records = {r["record"] for r in recording_rules()}
    named = _named_in_docs(r"`([a-z_]+:healthagent_[a-z0-9_]+:[a-z0-9_]+)`")
    assert named
    assert {(doc, name) for doc, name in named if name not in records} == set()


def test_the_metrics_reference_links_the_remediation_metrics_to_the_group_of_their_records():
    group = next(g for g in load_rules()["groups"] if any("record" in r and "remediation" in r["record"]
                                                         for r in g["rules"]))
    assert f"alerts.md#group-{group['name']}" in METRICS_DOC.read_text(encoding="utf-8")
