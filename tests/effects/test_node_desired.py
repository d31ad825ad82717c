"""Pure planning: the taint decision table, owned labels, condition timestamps, minimal patches."""

import pytest

from healthagent.effects.node_desired import (
    HEALTH_LABEL,
    HYPERPOD_FAULT_REASONS_LABEL,
    HYPERPOD_FAULT_TYPES_LABEL,
    HYPERPOD_HEALTH_LABEL,
    TAINT_BOOT_ANNOTATION,
    ConditionSpec,
    DesiredNode,
    Pending,
    TaintPlan,
    TaintSpec,
    condition_of,
    health_value,
    boot_annotation,
    not_observed_conditions,
    observed_by,
    owned_view,
    plan_conditions,
    plan_labels,
    plan_taint,
    reboot_outstanding,
)
from healthagent.effects.api_time import parse_rfc3339, rfc3339
from healthagent.effects.node_patch import node_patch, status_patch
from healthagent.effects.conditions import vocabulary
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
    # escalation from reboot: the grace goes on from the first taint, it does not start again
    (Action.REPLACE_NODE, [ours("reboot_node", "NoSchedule")], T0, T0 + 119, 120,
     TaintSpec("replace_node", "NoSchedule"), False),
    (Action.REPLACE_NODE, [ours("reboot_node", "NoSchedule")], T0, T0 + 120, 120,
     TaintSpec("replace_node", "NoExecute"), False),
    # an escalation never takes an eviction back
    (Action.REPLACE_NODE, [ours("reboot_node", "NoExecute")], T0 + 999, T0, 120,
     TaintSpec("replace_node", "NoExecute"), False),
    # a NoExecute on the node stays, whatever the clock says
    (Action.REPLACE_NODE, [ours("replace_node", "NoExecute")], T0 + 999, T0, 120,
     TaintSpec("replace_node", "NoExecute"), False),
])
def test_taint_decision_table(action, taints, since, now, grace, want, adds):
    plan = plan_taint(action=action, node=node_with(taints), taint_key=TAINT_KEY, grace_seconds=grace,
                      since=since, now=now, held=False)
    assert (plan.taint, plan.adds_taint, plan.budget_blocked) == (want, adds, False)


@pytest.mark.parametrize("taints,grace,now,want,blocked,ready", [
    ([], 120, T0, "NoSchedule", True, False),  # a first taint without a slot: NoSchedule all the same
    ([], 0, T0, "NoSchedule", True, False),  # even with no grace at all
    ([ours("replace_node", "NoSchedule")], 120, T0 + 500, "NoSchedule", True, False),  # grace over: waits
    ([ours("reboot_node", "NoExecute")], 120, T0 + 500, "NoExecute", False, True),  # escalated: stays out
    ([ours("replace_node", "NoExecute")], 120, T0 + 500, "NoExecute", False, True),  # already out: stays
])
def test_without_a_slot_the_node_is_held_at_noschedule(taints, grace, now, want, blocked, ready):
    plan = plan_taint(action=Action.REPLACE_NODE, node=node_with(taints), taint_key=TAINT_KEY, grace_seconds=grace,
                      since=T0, now=now, held=True)
    assert plan.taint == TaintSpec("replace_node", want)
    assert (plan.budget_blocked, plan.disruptive_ready, plan.adds_taint) == (blocked, ready, not taints)


def test_a_rollback_takes_a_noexecute_just_written_back_to_noschedule():
    plan = plan_taint(action=Action.REPLACE_NODE, node=node_with([ours("replace_node", "NoExecute")]),
                      taint_key=TAINT_KEY, grace_seconds=120, since=T0, now=T0 + 500, held=True, rollback=True)
    assert plan.taint == TaintSpec("replace_node", "NoSchedule") and plan.budget_blocked
    assert not plan.disruptive_ready


@pytest.mark.parametrize("action,value", [
    (Action.NONE, "healthy"), (Action.MONITOR, "degraded"), (Action.RESET_GPU, "degraded"),
    (Action.REBOOT_NODE, "reboot-required"), (Action.REPLACE_NODE, "replace-required")])
def test_health_label_values(action, value):
    assert health_value(action) == value


@pytest.mark.parametrize("code,ctype", [("GPU_XID", "GpuHealthy"), ("NVSWITCH_SXID", "GpuHealthy"),
                                        ("EFA_DEVICE_MISSING", "NetworkHealthy"), ("GPU_LOST", "GpuHealthy")])
def test_condition_of_code(code, ctype):
    assert condition_of(code) == ctype


def test_conditions_carry_code_and_evidence_and_all_checks_passed():
    efa = finding("EFA_RX_DROPS", Action.MONITOR, efa="rdmap0s29", xids=())
    specs = plan_conditions([finding("GPU_XID"), efa])
    by_type = {s.type: s for s in specs}
    assert by_type["GpuHealthy"].status == "False" and by_type["GpuHealthy"].reason == "GPU_XID"
    assert "NVRM: Xid (PCI:0000:53:00): 95" in by_type["GpuHealthy"].message
    assert by_type["NetworkHealthy"].reason == "EFA_RX_DROPS"
    healthy = {s.type: s for s in plan_conditions([])}
    assert {(s.status, s.reason) for s in healthy.values()} == {("True", "AllChecksPassed")}
    sticky = {s.type: s for s in plan_conditions([], Pending("", Action.REPLACE_NODE))}
    assert (sticky["GpuHealthy"].status, sticky["GpuHealthy"].reason) == ("False", "ReplacePending")
    assert sticky["NetworkHealthy"].status == "True"


def test_node_patch_keeps_foreign_taints_in_place_and_pins_no_resource_version():
    node = node_with([{"key": "a.io/x", "effect": "NoSchedule"}, ours("reboot_node", "NoSchedule"),
                      {"key": "b.io/y", "effect": "NoExecute"}], labels={"team": "ml"})
    desired = DesiredNode(taint=TaintSpec("replace_node", "NoSchedule"), labels={HEALTH_LABEL: "replace-required"})
    patch = node_patch(node, desired, TAINT_KEY, T0 + 5)
    assert patch["metadata"] == {"labels": {HEALTH_LABEL: "replace-required"}}
    assert [(t["key"], t.get("value")) for t in patch["spec"]["taints"]] == [
        ("a.io/x", None), (TAINT_KEY, "replace_node"), ("b.io/y", None)]
    # an escalation under the same effect keeps timeAdded (NoExecute tolerations count from it);
    # a new effect is added now
    assert patch["spec"]["taints"][1]["timeAdded"] == node["spec"]["taints"][1]["timeAdded"] != rfc3339(T0 + 5)
    evicting = node_patch(node, DesiredNode(taint=TaintSpec("replace_node", "NoExecute")), TAINT_KEY, T0 + 5)
    assert evicting["spec"]["taints"][1]["timeAdded"] == rfc3339(T0 + 5)
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
    ("NVSWITCH_SXID", ("kernel_log",)), ("RDMA_PORT_DOWN", ("rdma",)), ("RDMA_ADAPTER_EVENT", ("kernel_log",)),
    ("", ("gpu", "efa", "rdma", "kernel_log")),
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
        "NetworkHealthy": ("NetworkNotObserved", "the agent cannot observe the EFA devices (no source answered); "
                                         "their health is unknown, not healthy")}
    on_node = node_with(conditions=[{"type": "GpuHealthy", "status": "Unknown", "reason": "GpuNotObserved",
                                     "message": "as first seen"},
                                    {"type": "NetworkHealthy", "status": "True", "reason": "AllChecksPassed",
                                     "message": "no open EFA findings"}])
    planned = not_observed_conditions(on_node, ("gpu", "efa"), ())
    assert planned["GpuHealthy"] == ("GpuNotObserved", "as first seen")
    assert planned["NetworkHealthy"][1].startswith("the agent cannot observe the EFA devices")
    assert not_observed_conditions(on_node, ("kernel_log",), health) == {}


def test_plan_conditions_unknown_without_findings_false_with_them():
    not_observed = {"GpuHealthy": ("GpuNotObserved", "m"), "NetworkHealthy": ("NetworkNotObserved", "e")}
    specs = plan_conditions([finding("EFA_RX_DROPS", Action.MONITOR, pci="", efa="rdmap79s0", xids=())],
                            not_observed=not_observed)
    assert [(c.type, c.status, c.reason) for c in specs] == [
        ("GpuHealthy", "Unknown", "GpuNotObserved"), ("NetworkHealthy", "False", "EFA_RX_DROPS")]
    sticky = plan_conditions([], Pending("GPU_XID", Action.REPLACE_NODE), not_observed=not_observed)
    assert [(c.type, c.status, c.reason) for c in sticky] == [
        ("GpuHealthy", "False", "ReplacePending"), ("NetworkHealthy", "Unknown", "NetworkNotObserved")]


# -- reboot_node leaves the job too; the eks vocabulary; the boot a reboot taint waits out ----------


@pytest.mark.parametrize("reboot_noexecute,now,want", [
    (True, T0 + 119, "NoSchedule"), (True, T0 + 120, "NoExecute"),
    (False, T0 + 120, "NoSchedule"), (False, T0 + 10_000, "NoSchedule")])
def test_reboot_node_gets_noexecute_after_the_grace_unless_kept_to_noschedule(reboot_noexecute, now, want):
    plan = plan_taint(action=Action.REBOOT_NODE, node=node_with([ours("reboot_node", "NoSchedule")]),
                      taint_key=TAINT_KEY, grace_seconds=120, since=T0, now=now, held=False,
                      reboot_noexecute=reboot_noexecute)
    assert plan.taint == TaintSpec("reboot_node", want)
    assert plan.disruptive_ready is (now - T0 >= 120)  # HyperPod's label and eks' False wait the same


def _eks(findings, taint=None, pending=None, not_observed=None, leave=()):
    return {c.type: (c.status, c.reason) for c in plan_conditions(
        findings, pending, not_observed=not_observed, vocab=vocabulary("eks"), taint=taint, leave=leave)}


READY = TaintPlan(TaintSpec("reboot_node", "NoExecute"), adds_taint=False, disruptive_ready=True)
GRACE = TaintPlan(TaintSpec("reboot_node", "NoSchedule"), adds_taint=True, disruptive_ready=False)
HELD = TaintPlan(TaintSpec("reboot_node", "NoSchedule"), adds_taint=True, budget_blocked=True)


def test_eks_conditions_are_false_only_for_a_node_action_that_is_on_and_past_its_grace():
    xid79 = finding("GPU_XID", Action.REBOOT_NODE, xids=(79,))
    assert _eks([xid79], READY) == {"AcceleratedHardwareReady": ("False", "NvidiaXID79Error"),
                                    "NetworkingReady": ("True", "AllChecksPassed")}
    assert _eks([xid79], GRACE)["AcceleratedHardwareReady"] == ("True", "RepairAfterGrace")
    assert _eks([xid79], HELD)["AcceleratedHardwareReady"] == ("True", "RepairHeldByBudget")
    monitor = finding("GPU_THERMAL_THROTTLE", Action.MONITOR, xids=())
    assert _eks([monitor], TaintPlan(None, adds_taint=False))["AcceleratedHardwareReady"] == (
        "True", "FindingsWithoutNodeAction")
    efa = finding("EFA_DEVICE_MISSING", Action.REBOOT_NODE, efa="rdmap79s0", xids=())
    assert _eks([efa], READY) == {"AcceleratedHardwareReady": ("True", "AllChecksPassed"),
                                  "NetworkingReady": ("False", "EFADeviceMissing")}
    # the default vocabulary is not gated: any finding is False at once, with its code
    default = {c.type: (c.status, c.reason) for c in plan_conditions([xid79], taint=HELD)}
    assert default["GpuHealthy"] == ("False", "GPU_XID")


def test_eks_message_keeps_the_evidence_and_pending_taints_say_why():
    specs = plan_conditions([finding("GPU_XID", Action.REPLACE_NODE, xids=(94,))], vocab=vocabulary("eks"),
                            taint=GRACE)
    assert "NVRM: Xid (PCI:0000:53:00): 95" in specs[0].message and "NoExecute grace" in specs[0].message
    assert _eks([], READY, Pending("GPU_XID", Action.REBOOT_NODE))["AcceleratedHardwareReady"] == (
        "False", "RebootPending")
    assert _eks([], READY, Pending("EFA_DEVICE_MISSING", Action.REPLACE_NODE))["NetworkingReady"] == (
        "False", "ReplacePending")
    unknown = {"AcceleratedHardwareReady": ("GpuNotObserved", "m")}
    assert _eks([], None, None, unknown)["AcceleratedHardwareReady"] == ("Unknown", "GpuNotObserved")


def test_a_condition_type_another_writer_owns_is_never_planned():
    assert set(_eks([finding()], READY, leave=("AcceleratedHardwareReady",))) == {"NetworkingReady"}


def booted(boot, annotation=None, taints=()):
    node = node_with(taints)
    node["status"]["nodeInfo"] = {"bootID": boot} if boot else {}
    if annotation is not None:
        node["metadata"]["annotations"] = {TAINT_BOOT_ANNOTATION: annotation}
    return node


@pytest.mark.parametrize("boot,annotation,outstanding", [
    ("b1", "b1", True),      # the same boot: no reboot yet
    ("b2", "b1", False),     # a new boot id: the node rebooted
    ("", "b1", True),        # no boot id reported: a reboot cannot be proven
    ("b1", None, False),     # no record of the boot: a taint of an older version, clears as it did
])
def test_reboot_outstanding(boot, annotation, outstanding):
    assert reboot_outstanding(booted(boot, annotation)) is outstanding


def test_boot_annotation_follows_the_faults_boot_and_goes_with_the_taint():
    on = TaintPlan(TaintSpec("reboot_node", "NoSchedule"), adds_taint=False)
    reboot = finding("GPU_XID", Action.REBOOT_NODE, xids=(79,))
    assert boot_annotation(booted("b2", "b1"), on, [reboot]) == {TAINT_BOOT_ANNOTATION: "b2"}  # open again
    assert boot_annotation(booted("b1", "b1"), on, []) == {}  # held without a finding: kept
    assert boot_annotation(booted("b1"), on, [finding("GPU_XID", Action.MONITOR)]) == {}
    assert boot_annotation(booted("", None), on, [reboot]) == {}  # no boot id to record
    assert boot_annotation(booted("b2", "b1"), TaintPlan(None, adds_taint=False), []) == {
        TAINT_BOOT_ANNOTATION: None}


def test_owned_view_wakes_on_the_vocabularys_conditions_and_a_new_boot_only():
    eks = vocabulary("eks")
    node = booted("b1")
    node["status"]["conditions"] = [{"type": "AcceleratedHardwareReady", "status": "True", "reason": "x"}]
    view = owned_view(node, TAINT_KEY, False, eks)
    changed = booted("b1")
    changed["status"]["conditions"] = [{"type": "AcceleratedHardwareReady", "status": "False", "reason": "x"}]
    assert owned_view(changed, TAINT_KEY, False, eks) != view
    assert owned_view(changed, TAINT_KEY, False) == owned_view(node, TAINT_KEY, False)  # not GpuHealthy's
    assert owned_view(booted("b2"), TAINT_KEY, False, eks) != owned_view(booted("b1"), TAINT_KEY, False, eks)
    heartbeat = booted("b1")
    heartbeat["status"]["conditions"] = [dict(node["status"]["conditions"][0], lastHeartbeatTime="later")]
    assert owned_view(heartbeat, TAINT_KEY, False, eks) == view
