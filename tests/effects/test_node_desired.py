"""Pure planning: the taint decision table, owned labels, condition timestamps, minimal patches."""

import pytest

from healthagent.effects.node_desired import (
    HEALTH_LABEL,
    HYPERPOD_FAULT_REASONS_LABEL,
    HYPERPOD_FAULT_TYPES_LABEL,
    HYPERPOD_HEALTH_LABEL,
    ConditionSpec,
    DesiredNode,
    TaintPlan,
    TaintSpec,
    condition_of,
    health_value,
    node_patch,
    not_observed_conditions,
    observed_by,
    parse_rfc3339,
    plan_conditions,
    plan_labels,
    plan_taint,
    rfc3339,
    status_patch,
)
from healthagent.model import Action, SourceHealth
from tests.effects.helpers import T0, TAINT_KEY, finding


def node_with(taints=(), labels=None, conditions=(), rv="7"):
    return {"metadata": {"name": "n", "resourceVersion": rv, "labels": dict(labels or {})},
            "spec": {"taints": list(taints)}, "status": {"conditions": list(conditions)}}


def ours(value, effect, added=T0):
    return {"key": TAINT_KEY, "value": value, "effect": effect, "timeAdded": rfc3339(added)}


@pytest.mark.parametrize("action,taints,since,now,grace,want,adds", [
    (Action.NONE, [], None, T0, 120, None, False),
    (Action.RESET_GPU, [], None, T0, 120, None, False),
    (Action.REBOOT_NODE, [], None, T0, 120, TaintSpec("reboot_node", "NoSchedule"), True),
    (Action.REPLACE_NODE, [], None, T0, 120, TaintSpec("replace_node", "NoSchedule"), True),
    (Action.REPLACE_NODE, [], None, T0, 0, TaintSpec("replace_node", "NoExecute"), True),
    (Action.REPLACE_NODE, [ours("replace_node", "NoSchedule")], T0, T0 + 119, 120,
     TaintSpec("replace_node", "NoSchedule"), False),
    (Action.REPLACE_NODE, [ours("replace_node", "NoSchedule")], T0, T0 + 120, 120,
     TaintSpec("replace_node", "NoExecute"), False),
    # escalation from reboot: the replace grace starts when the replace taint goes on
    (Action.REPLACE_NODE, [ours("reboot_node", "NoSchedule")], T0, T0 + 500, 120,
     TaintSpec("replace_node", "NoSchedule"), False),
    # a NoExecute on the node stays, whatever the clock says
    (Action.REPLACE_NODE, [ours("replace_node", "NoExecute")], T0 + 999, T0, 120,
     TaintSpec("replace_node", "NoExecute"), False),
])
def test_taint_decision_table(action, taints, since, now, grace, want, adds):
    plan = plan_taint(action=action, node=node_with(taints), taint_key=TAINT_KEY, grace_seconds=grace,
                      since=since, now=now, budget_allows=lambda: True)
    assert (plan.taint, plan.adds_taint, plan.budget_blocked) == (want, adds, False)


def test_only_adding_asks_the_budget():
    asked = []

    def deny():
        asked.append(1)
        return False

    blocked = plan_taint(action=Action.REPLACE_NODE, node=node_with(), taint_key=TAINT_KEY, grace_seconds=120,
                         since=None, now=T0, budget_allows=deny)
    assert (blocked.taint, blocked.budget_blocked, len(asked)) == (None, True, 1)
    moving = plan_taint(action=Action.REPLACE_NODE, node=node_with([ours("replace_node", "NoSchedule")]),
                        taint_key=TAINT_KEY, grace_seconds=120, since=T0, now=T0 + 200, budget_allows=deny)
    assert moving.taint == TaintSpec("replace_node", "NoExecute") and len(asked) == 1


@pytest.mark.parametrize("action,value", [
    (Action.NONE, "healthy"), (Action.MONITOR, "degraded"), (Action.RESET_GPU, "degraded"),
    (Action.REBOOT_NODE, "reboot-required"), (Action.REPLACE_NODE, "replace-required")])
def test_health_label_values(action, value):
    assert health_value(action) == value


@pytest.mark.parametrize("code,ctype", [("GPU_XID", "GpuHealthy"), ("NVSWITCH_SXID", "GpuHealthy"),
                                        ("EFA_DEVICE_MISSING", "EfaHealthy"), ("GPU_LOST", "GpuHealthy")])
def test_condition_of_code(code, ctype):
    assert condition_of(code) == ctype


def test_conditions_carry_code_and_evidence_and_all_checks_passed():
    efa = finding("EFA_RX_DROPS", Action.MONITOR, efa="rdmap0s29", xids=())
    specs = plan_conditions([finding("GPU_XID"), efa], sticky_without_finding=False)
    by_type = {s.type: s for s in specs}
    assert by_type["GpuHealthy"].status == "False" and by_type["GpuHealthy"].reason == "GPU_XID"
    assert "NVRM: Xid (PCI:0000:53:00): 95" in by_type["GpuHealthy"].message
    assert by_type["EfaHealthy"].reason == "EFA_RX_DROPS"
    healthy = {s.type: s for s in plan_conditions([], sticky_without_finding=False)}
    assert {(s.status, s.reason) for s in healthy.values()} == {("True", "AllChecksPassed")}
    sticky = {s.type: s for s in plan_conditions([], sticky_without_finding=True)}
    assert (sticky["GpuHealthy"].status, sticky["GpuHealthy"].reason) == ("False", "ReplacePending")
    assert sticky["EfaHealthy"].status == "True"


def test_node_patch_keeps_foreign_taints_in_place_and_pins_no_resource_version():
    node = node_with([{"key": "a.io/x", "effect": "NoSchedule"}, ours("reboot_node", "NoSchedule"),
                      {"key": "b.io/y", "effect": "NoExecute"}], labels={"team": "ml"})
    desired = DesiredNode(taint=TaintSpec("replace_node", "NoSchedule"), labels={HEALTH_LABEL: "replace-required"})
    patch = node_patch(node, desired, TAINT_KEY, T0 + 5)
    assert patch["metadata"] == {"labels": {HEALTH_LABEL: "replace-required"}}
    assert [(t["key"], t.get("value")) for t in patch["spec"]["taints"]] == [
        ("a.io/x", None), (TAINT_KEY, "replace_node"), ("b.io/y", None)]
    assert patch["spec"]["taints"][1]["timeAdded"] == rfc3339(T0 + 5)
    removal = node_patch(node, DesiredNode(taint=None), TAINT_KEY, T0)
    assert [t["key"] for t in removal["spec"]["taints"]] == ["a.io/x", "b.io/y"]
    assert "metadata" not in removal


def test_node_patch_is_none_when_nothing_differs():
    node = node_with([ours("replace_node", "NoExecute")], labels={HEALTH_LABEL: "replace-required"})
    desired = DesiredNode(taint=TaintSpec("replace_node", "NoExecute"), labels={HEALTH_LABEL: "replace-required"})
    assert node_patch(node, desired, TAINT_KEY, T0 + 1000) is None


def test_status_patch_moves_transition_time_only_when_status_flips():
    old = {"type": "GpuHealthy", "status": "False", "reason": "GPU_XID", "message": "m1",
           "lastHeartbeatTime": rfc3339(T0), "lastTransitionTime": rfc3339(T0)}
    node = node_with(conditions=[{"type": "Ready", "status": "True"}, old])
    same = DesiredNode(taint=None, conditions=(ConditionSpec("GpuHealthy", "False", "GPU_XID", "m1"),))
    assert status_patch(node, same, T0 + 50) is None
    new_reason = DesiredNode(taint=None, conditions=(ConditionSpec("GpuHealthy", "False", "GPU_LOST", "m2"),))
    cond = status_patch(node, new_reason, T0 + 50)["status"]["conditions"][0]
    assert (cond["lastTransitionTime"], cond["lastHeartbeatTime"]) == (rfc3339(T0), rfc3339(T0 + 50))
    healed = DesiredNode(taint=None, conditions=(ConditionSpec("GpuHealthy", "True", "AllChecksPassed", "ok"),))
    patch = status_patch(node, healed, T0 + 60)
    assert "metadata" not in patch  # conditions merge by type: no resourceVersion to conflict on
    assert patch["status"]["conditions"] == [{
        "type": "GpuHealthy", "status": "True", "reason": "AllChecksPassed", "message": "ok",
        "lastHeartbeatTime": rfc3339(T0 + 60), "lastTransitionTime": rfc3339(T0 + 60)}]


def _labels(node, shown, taint, hyperpod=True, code="GPU_XID"):
    return plan_labels(node=node, shown=shown, taint=taint, leading_code=code, hyperpod=hyperpod)


def test_hyperpod_labels_only_with_the_flag_only_after_the_grace_and_given_back_only_if_ours():
    ready = TaintPlan(TaintSpec("replace_node", "NoExecute"), adds_taint=False, disruptive_ready=True)
    waiting = TaintPlan(TaintSpec("replace_node", "NoSchedule"), adds_taint=False, disruptive_ready=False)
    none = TaintPlan(None, adds_taint=False)
    assert _labels(node_with(), Action.REPLACE_NODE, ready, hyperpod=False) == {HEALTH_LABEL: "replace-required"}
    assert HYPERPOD_HEALTH_LABEL not in _labels(node_with(), Action.REPLACE_NODE, waiting)
    assert _labels(node_with(), Action.REPLACE_NODE, ready) == {
        HEALTH_LABEL: "replace-required", HYPERPOD_HEALTH_LABEL: "UnschedulablePendingReplacement",
        HYPERPOD_FAULT_TYPES_LABEL: "GPU", HYPERPOD_FAULT_REASONS_LABEL: "GPU_XID"}
    ours_on_node = node_with(labels={HEALTH_LABEL: "replace-required",
                                     HYPERPOD_HEALTH_LABEL: "UnschedulablePendingReplacement"})
    assert _labels(ours_on_node, Action.NONE, none) == {
        HEALTH_LABEL: "healthy", HYPERPOD_HEALTH_LABEL: "Schedulable",
        HYPERPOD_FAULT_TYPES_LABEL: None, HYPERPOD_FAULT_REASONS_LABEL: None}
    hyperpods_own = node_with(labels={HEALTH_LABEL: "healthy", HYPERPOD_HEALTH_LABEL: "Unschedulable"})
    assert _labels(hyperpods_own, Action.NONE, none) == {HEALTH_LABEL: "healthy"}


def test_time_round_trip():
    assert parse_rfc3339(rfc3339(T0)) == T0
    assert parse_rfc3339("garbage") is None and parse_rfc3339(None) is None


@pytest.mark.parametrize("action,unobserved,label", [
    (Action.NONE, False, "healthy"),
    (Action.NONE, True, "unknown"),
    (Action.MONITOR, True, "degraded"),
    (Action.REBOOT_NODE, True, "reboot-required"),
    (Action.REPLACE_NODE, True, "replace-required"),
])
def test_health_label_is_unknown_only_when_nothing_worse_applies(action, unobserved, label):
    assert health_value(action, unobserved) == label


@pytest.mark.parametrize("code,needs", [
    ("GPU_XID", ("gpu",)), ("GPU_ROW_REMAP_PENDING", ("gpu",)), ("EFA_DEVICE_MISSING", ("efa",)),
    ("NVSWITCH_SXID", ("kernel_log",)), ("", ("gpu", "efa", "kernel_log")),
])
def test_observed_by(code, needs):
    assert observed_by(code) == needs


def test_not_observed_conditions_from_the_sources_detail_and_kept_while_unknown():
    health = (SourceHealth("nvml", False, "nvmlInit: Driver Not Loaded"), SourceHealth("dcgm", True, "8 GPUs"),
              SourceHealth("efa", False, ""))
    planned = not_observed_conditions(node_with(), ("gpu", "efa", "kernel_log"), health)
    assert planned == {
        "GpuHealthy": ("GpuNotObserved", "the agent cannot observe the GPUs (nvml: nvmlInit: Driver Not "
                                         "Loaded); their health is unknown, not healthy"),
        "EfaHealthy": ("EfaNotObserved", "the agent cannot observe the EFA devices (no source answered); "
                                         "their health is unknown, not healthy")}
    on_node = node_with(conditions=[{"type": "GpuHealthy", "status": "Unknown", "reason": "GpuNotObserved",
                                     "message": "as first seen"},
                                    {"type": "EfaHealthy", "status": "True", "reason": "AllChecksPassed",
                                     "message": "no open EFA findings"}])
    planned = not_observed_conditions(on_node, ("gpu", "efa"), ())
    assert planned["GpuHealthy"] == ("GpuNotObserved", "as first seen")
    assert planned["EfaHealthy"][1].startswith("the agent cannot observe the EFA devices")
    assert not_observed_conditions(on_node, ("kernel_log",), health) == {}


def test_plan_conditions_unknown_without_findings_false_with_them():
    not_observed = {"GpuHealthy": ("GpuNotObserved", "m"), "EfaHealthy": ("EfaNotObserved", "e")}
    specs = plan_conditions([finding("EFA_RX_DROPS", Action.MONITOR, pci="", efa="rdmap79s0", xids=())],
                            False, not_observed=not_observed)
    assert [(c.type, c.status, c.reason) for c in specs] == [
        ("GpuHealthy", "Unknown", "GpuNotObserved"), ("EfaHealthy", "False", "EFA_RX_DROPS")]
    sticky = plan_conditions([], True, "GPU_XID", not_observed=not_observed)
    assert [(c.type, c.status, c.reason) for c in sticky] == [
        ("GpuHealthy", "False", "ReplacePending"), ("EfaHealthy", "Unknown", "EfaNotObserved")]
