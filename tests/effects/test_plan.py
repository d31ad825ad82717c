"""The planner alone: (verdict, node, record, budget) -> one plan with both patches; no I/O."""

from __future__ import annotations

import pytest

from healthagent.effects.node_desired import CLEAR_ANNOTATION, CLEAR_HANDLED_ANNOTATION, HEALTH_LABEL
from healthagent.effects.api_time import rfc3339
from healthagent.effects.node_desired import HYPERPOD_HEALTH_LABEL
from healthagent.effects.plan import Budget, PlanSettings, needs_budget, plan_node
from healthagent.effects.record import AppliedTaint
from healthagent.model import Action, Finding, Verdict

KEY = "healthagent.io/unhealthy"
T0 = 1_700_000_000.0
SETTINGS = PlanSettings(taint_key=KEY, grace_seconds=120.0, hyperpod_labels=False)
NOT_READY = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}


def gpu(action: Action, code: str = "GPU_XID", pci: str = "0000:53:00.0") -> Finding:
    return Finding(code=code, action=action, summary="s", evidence="e", next_steps="n", pci_bus_id=pci,
                   first_seen=T0, last_seen=T0)


def verdict(*findings: Finding, unobserved: tuple[str, ...] = (), clear_token: str = "") -> Verdict:
    return Verdict.of(list(findings), T0, unobserved=unobserved, clear_token=clear_token)


def node(*ours: tuple[str, str, float], annotations: dict | None = None, conditions: list | None = None) -> dict:
    taints = [dict(NOT_READY)] + [{"key": KEY, "value": v, "effect": e, "timeAdded": rfc3339(at)} for v, e, at in ours]
    return {"metadata": {"name": "n", "uid": "u", "labels": {}, "annotations": annotations or {}},
            "spec": {"taints": taints}, "status": {"conditions": conditions or []}}


def our_taint(plan) -> tuple | None:
    t = plan.desired.taint
    return None if t is None else (t.value, t.effect)


# (name, verdict, node, record taint, budget, now) -> (taint, health label, budget blocked, node patch?, status patch?)
CASES = [
    ("healthy node, healthy verdict: conditions only", verdict(), node(), None, Budget.UNASKED, T0,
     None, "healthy", False, True, True),
    ("replace with a slot: NoSchedule", verdict(gpu(Action.REPLACE_NODE)), node(), None, Budget.ALLOWS, T0,
     ("replace_node", "NoSchedule"), "replace-required", False, True, True),
    ("replace without a slot: NoSchedule all the same, held", verdict(gpu(Action.REPLACE_NODE)), node(), None,
     Budget.HOLDS, T0, ("replace_node", "NoSchedule"), "replace-required", True, True, True),
    ("replace is sticky without a finding", verdict(), node(("replace_node", "NoExecute", T0)),
     AppliedTaint("replace_node", "NoExecute", T0, "GPU_XID"), Budget.ALLOWS, T0 + 500,
     ("replace_node", "NoExecute"), "replace-required", False, True, True),
    ("reboot taint goes when the finding does, slot or not", verdict(), node(("reboot_node", "NoSchedule", T0)),
     AppliedTaint("reboot_node", "NoSchedule", T0, "GPU_XID"), Budget.UNASKED, T0 + 60,
     None, "healthy", False, True, True),
    ("reboot taint stays while its GPUs are unobserved", verdict(unobserved=("gpu",)),
     node(("reboot_node", "NoSchedule", T0)), AppliedTaint("reboot_node", "NoSchedule", T0, "GPU_XID"),
     Budget.ALLOWS, T0 + 60, ("reboot_node", "NoSchedule"), "reboot-required", False, True, True),
    ("rollback: a NoExecute just written goes back to NoSchedule, held", verdict(gpu(Action.REPLACE_NODE)),
     node(("replace_node", "NoExecute", T0)), AppliedTaint("replace_node", "NoExecute", T0), Budget.ROLLBACK,
     T0 + 500, ("replace_node", "NoSchedule"), "replace-required", True, True, True),
    ("monitor finding: no taint", verdict(gpu(Action.MONITOR, "GPU_ECC_SBE")), node(), None, Budget.UNASKED, T0,
     None, "degraded", False, True, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plan_table(case):
    _, v, n, record, budget, now, taint, label, blocked, wants_node, wants_status = case
    plan = plan_node(v, n, record, budget, SETTINGS, now)
    assert our_taint(plan) == taint
    assert plan.desired.labels[HEALTH_LABEL] == label
    assert plan.taint.budget_blocked is blocked
    assert (plan.node_patch is not None) is wants_node
    assert (plan.status_patch is not None) is wants_status
    if plan.node_patch and "taints" in plan.node_patch.get("spec", {}):
        assert plan.node_patch["spec"]["taints"][0] == NOT_READY  # foreign taints stay first, in place


@pytest.mark.parametrize("effect,budget,now,want,held", [
    ("NoSchedule", Budget.UNASKED, T0 + 500, "NoSchedule", True),  # not asked: held (fails closed)
    ("NoSchedule", Budget.ALLOWS, T0 + 119, "NoSchedule", False),  # a slot, in the grace
    ("NoSchedule", Budget.ALLOWS, T0 + 120, "NoExecute", False),  # a slot, the grace over
    ("NoSchedule", Budget.HOLDS, T0 + 500, "NoSchedule", True),  # no slot, the grace over: held
    ("NoExecute", Budget.HOLDS, T0 + 500, "NoExecute", False),  # out already (before the budget): stays
    ("NoExecute", Budget.ROLLBACK, T0 + 500, "NoSchedule", True),  # a race lost: taken back
])
def test_a_replace_taint_on_the_node_goes_to_noexecute_only_with_a_slot(effect, budget, now, want, held):
    on, record = node(("replace_node", effect, T0)), AppliedTaint("replace_node", effect, T0)
    plan = plan_node(verdict(gpu(Action.REPLACE_NODE)), on, record, budget, SETTINGS, now)
    assert our_taint(plan) == ("replace_node", want) and plan.taint.budget_blocked is held
    assert plan.desired.labels[HEALTH_LABEL] == "replace-required" and plan.wants_slot


def test_a_node_as_planned_needs_no_write():
    """Apply a plan's patches to the node (as the server would) and plan again: nothing left."""
    v, n = verdict(gpu(Action.REPLACE_NODE)), node()
    plan = plan_node(v, n, None, Budget.ALLOWS, SETTINGS, T0)
    n["spec"]["taints"] = plan.node_patch["spec"]["taints"]
    n["metadata"]["labels"].update(plan.node_patch["metadata"]["labels"])
    n["status"]["conditions"] = plan.status_patch["status"]["conditions"]
    again = plan_node(v, n, AppliedTaint("replace_node", "NoSchedule", T0), Budget.ALLOWS, SETTINGS, T0 + 5)
    assert again.writes == 0


def test_a_held_node_is_as_planned_too_and_wants_a_slot():
    v, n = verdict(gpu(Action.REPLACE_NODE)), node(("replace_node", "NoSchedule", T0))
    n["metadata"]["labels"][HEALTH_LABEL] = "replace-required"
    held = plan_node(v, n, AppliedTaint("replace_node", "NoSchedule", T0), Budget.HOLDS, SETTINGS, T0 + 500)
    assert held.node_patch is None and held.taint.budget_blocked and held.wants_slot


def test_the_budget_is_asked_only_for_a_disruptive_step_ahead():
    replace = verdict(gpu(Action.REPLACE_NODE))
    assert needs_budget(replace, node(), None, SETTINGS)  # a first taint reserves the slot for the grace
    assert needs_budget(replace, node(("replace_node", "NoSchedule", T0)), None, SETTINGS)  # held: asks again
    assert needs_budget(replace, node(("replace_node", "NoExecute", T0)), None, SETTINGS)  # it counts
    assert not needs_budget(verdict(gpu(Action.MONITOR)), node(), None, SETTINGS)
    assert not needs_budget(verdict(), node(), None, SETTINGS)  # healing never asks
    assert not needs_budget(verdict(), node(("reboot_node", "NoExecute", T0)), None, SETTINGS)  # comes off
    clear = node(("replace_node", "NoExecute", T0), annotations={CLEAR_ANNOTATION: "t-1"})
    assert not needs_budget(replace, clear, None, SETTINGS)  # a clear policy has not accounted for: held
    assert not needs_budget(replace, node(), None, SETTINGS, "taint-removed-1")  # nor one to write
    accounted = verdict(clear_token="t-1")  # policy closed what the clear covers
    assert not needs_budget(accounted, clear, None, SETTINGS)


@pytest.mark.parametrize("settings,asks", [
    (PlanSettings(taint_key=KEY, grace_seconds=120.0, hyperpod_labels=False, reboot_noexecute=False), False),
    (PlanSettings(taint_key=KEY, grace_seconds=120.0, hyperpod_labels=True, reboot_noexecute=False), True),
    (PlanSettings(taint_key=KEY, grace_seconds=120.0, hyperpod_labels=False, reboot_noexecute=False,
                  condition_vocabulary="eks"), True),
    (SETTINGS, True),
], ids=["noschedule-only", "hyperpod", "eks", "noexecute"])
def test_a_reboot_that_never_goes_past_noschedule_needs_no_slot(settings, asks):
    v = verdict(gpu(Action.REBOOT_NODE))
    assert needs_budget(v, node(), None, settings) is asks
    plan = plan_node(v, node(), None, Budget.UNASKED, settings, T0 + 500)
    assert our_taint(plan) == ("reboot_node", "NoSchedule") and plan.taint.budget_blocked is asks
    assert plan.wants_slot is asks


def test_a_clear_annotation_waits_for_policy_then_is_handled_once():
    """The effects carry out a clear only with a verdict that accounts for it: policy decides
    what it closes; before that verdict the node is held exactly as it is."""
    record = AppliedTaint("replace_node", "NoExecute", T0)
    n = node(("replace_node", "NoExecute", T0), annotations={CLEAR_ANNOTATION: "t-1"})
    waiting = plan_node(verdict(gpu(Action.REPLACE_NODE)), n, record, Budget.UNASKED, SETTINGS, T0 + 300)
    assert waiting.node_patch is None and waiting.status_patch is None and waiting.clear is None
    assert our_taint(waiting) == ("replace_node", "NoExecute") and waiting.wants_slot
    cleared = verdict(clear_token="t-1")  # policy closed the finding the operator cleared
    plan = plan_node(cleared, n, record, Budget.UNASKED, SETTINGS, T0 + 301)
    assert plan.clear is not None and plan.clear.token == "t-1" and plan.findings == ()
    assert our_taint(plan) is None and plan.desired.labels[HEALTH_LABEL] == "healthy"
    assert plan.node_patch["metadata"]["annotations"] == {CLEAR_HANDLED_ANNOTATION: "t-1"}
    handled = node(annotations={CLEAR_ANNOTATION: "t-1", CLEAR_HANDLED_ANNOTATION: "t-1"})
    assert plan_node(cleared, handled, None, Budget.UNASKED, SETTINGS, T0 + 302).clear is None
    # a fault policy saw after the clear stands: the node keeps what it carries for it
    fresh = verdict(gpu(Action.REPLACE_NODE, pci="0000:64:00.0"), clear_token="t-1")
    after = plan_node(fresh, n, record, Budget.ALLOWS, SETTINGS, T0 + 303)
    assert after.clear is not None and our_taint(after) == ("replace_node", "NoExecute")


def test_a_taint_removed_by_hand_is_written_as_the_clear_and_held():
    plan = plan_node(verdict(gpu(Action.REPLACE_NODE)), node(), AppliedTaint("replace_node", "NoSchedule", T0),
                     Budget.UNASKED, SETTINGS, T0 + 5, clear_to_write="taint-removed-7")
    assert our_taint(plan) is None and plan.status_patch is None
    assert plan.node_patch == {"metadata": {"annotations": {CLEAR_ANNOTATION: "taint-removed-7"}}}


def test_unobserved_is_unknown_not_healthy_and_never_a_taint():
    plan = plan_node(verdict(unobserved=("gpu", "efa")), node(), None, Budget.UNASKED, SETTINGS, T0)
    statuses = {c.type: (c.status, c.reason) for c in plan.desired.conditions}
    assert statuses == {"GpuHealthy": ("Unknown", "GpuNotObserved"), "NetworkHealthy": ("Unknown", "NetworkNotObserved")}
    assert our_taint(plan) is None and plan.desired.labels[HEALTH_LABEL] == "unknown"


def test_the_planner_does_no_io(monkeypatch):
    """Pure: no socket, no file, no clock is touched while planning."""
    import builtins
    import socket
    import time

    def refuse(*_a, **_k):
        raise AssertionError("the planner did I/O")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(time, "time", refuse)
    plan = plan_node(verdict(gpu(Action.REPLACE_NODE)), node(), None, Budget.ALLOWS, SETTINGS, T0)
    assert our_taint(plan) == ("replace_node", "NoSchedule")


# -- the eks vocabulary through the plan: the budget and the grace gate False ------------------------

EKS = PlanSettings(taint_key=KEY, grace_seconds=120.0, hyperpod_labels=False, condition_vocabulary="eks")


def eks_conditions(plan) -> dict:
    return {c.type: (c.status, c.reason) for c in plan.desired.conditions}


def test_eks_condition_goes_false_only_with_the_taint_on_past_its_grace():
    v = verdict(Finding(code="GPU_XID", action=Action.REPLACE_NODE, summary="s", evidence="e", next_steps="n",
                        pci_bus_id="0000:53:00.0", xids=(94,), first_seen=T0, last_seen=T0))
    held = plan_node(v, node(), None, Budget.HOLDS, EKS, T0)
    assert our_taint(held) == ("replace_node", "NoSchedule")  # NoSchedule is never held back
    assert eks_conditions(held)["AcceleratedHardwareReady"] == ("True", "RepairHeldByBudget")
    on = node(("replace_node", "NoSchedule", T0))
    held_past = plan_node(v, on, AppliedTaint("replace_node", "NoSchedule", T0), Budget.HOLDS, EKS, T0 + 500)
    assert eks_conditions(held_past)["AcceleratedHardwareReady"] == ("True", "RepairHeldByBudget")
    rolled_back = plan_node(v, node(("replace_node", "NoExecute", T0)), AppliedTaint("replace_node", "NoExecute", T0),
                            Budget.ROLLBACK, EKS, T0 + 500)
    assert our_taint(rolled_back) == ("replace_node", "NoSchedule")
    assert eks_conditions(rolled_back)["AcceleratedHardwareReady"] == ("True", "RepairHeldByBudget")
    tainted = plan_node(v, node(), None, Budget.ALLOWS, EKS, T0)
    assert our_taint(tainted) == ("replace_node", "NoSchedule")
    assert eks_conditions(tainted)["AcceleratedHardwareReady"] == ("True", "RepairAfterGrace")
    past = plan_node(v, on, AppliedTaint("replace_node", "NoSchedule", T0), Budget.ALLOWS, EKS, T0 + 120)
    assert our_taint(past) == ("replace_node", "NoExecute")
    assert eks_conditions(past) == {"AcceleratedHardwareReady": ("False", "NvidiaXID94Error"),
                                    "NetworkingReady": ("True", "AllChecksPassed")}
    assert not any(c.type.endswith("Healthy") for c in past.desired.conditions)


def test_zero_grace_is_false_with_the_taint_and_the_budget_still_asked_first():
    v = verdict(gpu(Action.REBOOT_NODE))
    zero = PlanSettings(taint_key=KEY, grace_seconds=0.0, hyperpod_labels=False, condition_vocabulary="eks")
    assert needs_budget(v, node(), None, zero)
    held = plan_node(v, node(), None, Budget.HOLDS, zero, T0)
    assert our_taint(held) == ("reboot_node", "NoSchedule")
    assert eks_conditions(held)["AcceleratedHardwareReady"][0] == "True"
    plan = plan_node(v, node(), None, Budget.ALLOWS, zero, T0)
    assert our_taint(plan) == ("reboot_node", "NoExecute")
    assert eks_conditions(plan)["AcceleratedHardwareReady"][0] == "False"


HYPERPOD = PlanSettings(taint_key=KEY, grace_seconds=120.0, hyperpod_labels=True)


def hyperpod_value(plan) -> str | None:
    return plan.desired.labels.get(HYPERPOD_HEALTH_LABEL)


def test_hyperpods_replacement_value_needs_the_slot_and_a_lost_race_gives_it_back():
    v = verdict(gpu(Action.REPLACE_NODE))
    on = node(("replace_node", "NoSchedule", T0))
    record = AppliedTaint("replace_node", "NoSchedule", T0)
    assert hyperpod_value(plan_node(v, on, record, Budget.ALLOWS, HYPERPOD, T0 + 119)) is None  # the grace
    assert hyperpod_value(plan_node(v, on, record, Budget.HOLDS, HYPERPOD, T0 + 500)) is None  # held
    assert hyperpod_value(plan_node(v, on, record, Budget.ALLOWS, HYPERPOD, T0 + 120)) == (
        "UnschedulablePendingReplacement")
    # the value was written with NoExecute, then the slot turned out reclaimed: both go back
    written = node(("replace_node", "NoExecute", T0))
    written["metadata"]["labels"].update({HEALTH_LABEL: "replace-required",
                                          HYPERPOD_HEALTH_LABEL: "UnschedulablePendingReplacement"})
    rolled_back = plan_node(v, written, AppliedTaint("replace_node", "NoExecute", T0), Budget.ROLLBACK,
                            HYPERPOD, T0 + 500)
    assert our_taint(rolled_back) == ("replace_node", "NoSchedule") and hyperpod_value(rolled_back) == "Schedulable"


def test_a_foreign_condition_type_is_left_out_of_the_plan():
    plan = plan_node(verdict(gpu(Action.REPLACE_NODE)), node(), None, Budget.ALLOWS, EKS, T0,
                     foreign={"AcceleratedHardwareReady"})
    assert [c.type for c in plan.desired.conditions] == ["NetworkingReady"]
    assert our_taint(plan) == ("replace_node", "NoSchedule")  # the taint does not depend on it


# -- reboot_node clears itself after a reboot, and only then ---------------------------------------

BOOT_ANNOTATION = "healthagent.io/taint-boot-id"


def booted(boot: str, *ours: tuple[str, str, float], tainted_in: str | None = None) -> dict:
    n = node(*ours, annotations={BOOT_ANNOTATION: tainted_in} if tainted_in else None)
    n["status"]["nodeInfo"] = {"bootID": boot}
    return n


def test_a_new_reboot_taint_records_the_boot_it_waits_out():
    plan = plan_node(verdict(gpu(Action.REBOOT_NODE)), booted("boot-a"), None, Budget.ALLOWS, SETTINGS, T0)
    assert our_taint(plan) == ("reboot_node", "NoSchedule")
    assert plan.node_patch["metadata"]["annotations"] == {BOOT_ANNOTATION: "boot-a"}


def test_without_a_reboot_the_taint_stays_even_when_the_finding_is_gone():
    """A lost state file or a classifier that forgot is not a reboot."""
    on = booted("boot-a", ("reboot_node", "NoExecute", T0), tainted_in="boot-a")
    plan = plan_node(verdict(), on, AppliedTaint("reboot_node", "NoExecute", T0, "GPU_XID"), Budget.UNASKED,
                     SETTINGS, T0 + 600)
    assert our_taint(plan) == ("reboot_node", "NoExecute")
    assert plan.desired.labels[HEALTH_LABEL] == "reboot-required"
    assert {c.type: (c.status, c.reason) for c in plan.desired.conditions}["GpuHealthy"] == ("False", "RebootPending")


def test_after_a_reboot_with_no_open_finding_the_reboot_taint_clears():
    on = booted("boot-b", ("reboot_node", "NoExecute", T0), tainted_in="boot-a")
    plan = plan_node(verdict(), on, AppliedTaint("reboot_node", "NoExecute", T0, "GPU_XID"), Budget.UNASKED,
                     SETTINGS, T0 + 600)
    assert our_taint(plan) is None and plan.desired.labels[HEALTH_LABEL] == "healthy"
    assert plan.node_patch["metadata"]["annotations"] == {BOOT_ANNOTATION: None}
    assert {c.status for c in plan.desired.conditions} == {"True"}


def test_a_new_boot_never_clears_an_open_fault_nor_a_replace_taint():
    still = plan_node(verdict(gpu(Action.REBOOT_NODE)), booted("boot-b", ("reboot_node", "NoExecute", T0),
                                                              tainted_in="boot-a"),
                      AppliedTaint("reboot_node", "NoExecute", T0, "GPU_XID"), Budget.UNASKED, SETTINGS, T0 + 600)
    assert our_taint(still) == ("reboot_node", "NoExecute")
    assert still.node_patch["metadata"]["annotations"] == {BOOT_ANNOTATION: "boot-b"}  # now waits out boot-b
    replace = plan_node(verdict(), booted("boot-b", ("replace_node", "NoExecute", T0), tainted_in="boot-a"),
                        AppliedTaint("replace_node", "NoExecute", T0, "GPU_XID"), Budget.UNASKED, SETTINGS, T0 + 600)
    assert our_taint(replace) == ("replace_node", "NoExecute")
    unobserved = plan_node(verdict(unobserved=("gpu",)), booted("boot-b", ("reboot_node", "NoExecute", T0),
                                                                tainted_in="boot-a"),
                           AppliedTaint("reboot_node", "NoExecute", T0, "GPU_XID"), Budget.UNASKED, SETTINGS,
                           T0 + 600)
    assert our_taint(unobserved) == ("reboot_node", "NoExecute")  # a silent driver is not a recovery


def test_reboot_noexecute_setting_keeps_todays_noschedule():
    keep = PlanSettings(taint_key=KEY, grace_seconds=120.0, hyperpod_labels=False, reboot_noexecute=False)
    on = node(("reboot_node", "NoSchedule", T0))
    record = AppliedTaint("reboot_node", "NoSchedule", T0)
    assert our_taint(plan_node(verdict(gpu(Action.REBOOT_NODE)), on, record, Budget.UNASKED, keep,
                               T0 + 500)) == ("reboot_node", "NoSchedule")
    assert our_taint(plan_node(verdict(gpu(Action.REBOOT_NODE)), on, record, Budget.ALLOWS, SETTINGS,
                               T0 + 120)) == ("reboot_node", "NoExecute")
