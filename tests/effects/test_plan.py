"""The planner alone: (verdict, node, record, budget) -> one plan with both patches; no I/O."""

from __future__ import annotations

import pytest

from healthagent.effects.node_desired import CLEAR_ANNOTATION, CLEAR_HANDLED_ANNOTATION, HEALTH_LABEL, rfc3339
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


def verdict(*findings: Finding, unobserved: tuple[str, ...] = ()) -> Verdict:
    return Verdict.of(list(findings), T0, unobserved=unobserved)


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
    ("replace, budget allows: NoSchedule", verdict(gpu(Action.REPLACE_NODE)), node(), None, Budget.ALLOWS, T0,
     ("replace_node", "NoSchedule"), "replace-required", False, True, True),
    ("replace, budget holds: no taint, label still says it", verdict(gpu(Action.REPLACE_NODE)), node(), None,
     Budget.HOLDS, T0, None, "replace-required", True, True, True),
    ("replace on the node, grace not over", verdict(gpu(Action.REPLACE_NODE)),
     node(("replace_node", "NoSchedule", T0)), AppliedTaint("replace_node", "NoSchedule", T0), Budget.UNASKED,
     T0 + 119, ("replace_node", "NoSchedule"), "replace-required", False, True, True),
    ("replace on the node, grace over: NoExecute without asking the budget", verdict(gpu(Action.REPLACE_NODE)),
     node(("replace_node", "NoSchedule", T0)), AppliedTaint("replace_node", "NoSchedule", T0), Budget.UNASKED,
     T0 + 120, ("replace_node", "NoExecute"), "replace-required", False, True, True),
    ("replace is sticky without a finding", verdict(), node(("replace_node", "NoExecute", T0)),
     AppliedTaint("replace_node", "NoExecute", T0, "GPU_XID"), Budget.UNASKED, T0 + 500,
     ("replace_node", "NoExecute"), "replace-required", False, True, True),
    ("reboot taint goes when the finding does", verdict(), node(("reboot_node", "NoSchedule", T0)),
     AppliedTaint("reboot_node", "NoSchedule", T0, "GPU_XID"), Budget.UNASKED, T0 + 60,
     None, "healthy", False, True, True),
    ("reboot taint stays while its GPUs are unobserved", verdict(unobserved=("gpu",)),
     node(("reboot_node", "NoSchedule", T0)), AppliedTaint("reboot_node", "NoSchedule", T0, "GPU_XID"),
     Budget.UNASKED, T0 + 60, ("reboot_node", "NoSchedule"), "reboot-required", False, True, True),
    ("rollback: the fresh taint comes off", verdict(gpu(Action.REPLACE_NODE)),
     node(("replace_node", "NoSchedule", T0)), AppliedTaint("replace_node", "NoSchedule", T0), Budget.ROLLBACK,
     T0, None, "replace-required", True, True, True),
    ("monitor finding: no taint", verdict(gpu(Action.MONITOR, "GPU_ECC_SBE")), node(), None, Budget.UNASKED, T0,
     None, "degraded", False, True, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plan_table(case):
    _, v, n, record, budget, now, taint, label, blocked, wants_node, wants_status = case
    plan = plan_node(v, n, record, [], budget, SETTINGS, now)
    assert our_taint(plan) == taint
    assert plan.desired.labels[HEALTH_LABEL] == label
    assert plan.taint.budget_blocked is blocked
    assert (plan.node_patch is not None) is wants_node
    assert (plan.status_patch is not None) is wants_status
    if plan.node_patch and "taints" in plan.node_patch.get("spec", {}):
        assert plan.node_patch["spec"]["taints"][0] == NOT_READY  # foreign taints stay first, in place


def test_a_node_as_planned_needs_no_write():
    """Apply a plan's patches to the node (as the server would) and plan again: nothing left."""
    v, n = verdict(gpu(Action.REPLACE_NODE)), node()
    plan = plan_node(v, n, None, [], Budget.ALLOWS, SETTINGS, T0)
    n["spec"]["taints"] = plan.node_patch["spec"]["taints"]
    n["metadata"]["labels"].update(plan.node_patch["metadata"]["labels"])
    n["status"]["conditions"] = plan.status_patch["status"]["conditions"]
    again = plan_node(v, n, AppliedTaint("replace_node", "NoSchedule", T0), [], Budget.UNASKED, SETTINGS, T0 + 5)
    assert again.writes == 0


def test_the_budget_is_asked_only_when_a_taint_would_be_added():
    replace = verdict(gpu(Action.REPLACE_NODE))
    assert needs_budget(replace, node(), None, [], KEY)
    assert not needs_budget(replace, node(("replace_node", "NoSchedule", T0)), None, [], KEY)  # NoExecute step
    assert not needs_budget(verdict(gpu(Action.MONITOR)), node(), None, [], KEY)
    assert not needs_budget(verdict(), node(), None, [], KEY)  # healing never asks
    cleared = gpu(Action.REPLACE_NODE)
    assert not needs_budget(verdict(cleared), node(), None, [cleared.key], KEY)


def test_a_clear_annotation_forgets_every_finding_and_is_handled_once():
    v = verdict(gpu(Action.REPLACE_NODE))
    n = node(("replace_node", "NoExecute", T0), annotations={CLEAR_ANNOTATION: "t-1"})
    plan = plan_node(v, n, AppliedTaint("replace_node", "NoExecute", T0), [], Budget.UNASKED, SETTINGS, T0 + 300)
    assert plan.clear is not None and plan.clear.token == "t-1" and plan.findings == ()
    assert our_taint(plan) is None and plan.desired.labels[HEALTH_LABEL] == "healthy"
    assert plan.node_patch["metadata"]["annotations"] == {CLEAR_HANDLED_ANNOTATION: "t-1"}
    handled = node(annotations={CLEAR_ANNOTATION: "t-1", CLEAR_HANDLED_ANNOTATION: "t-1"})
    assert plan_node(v, handled, None, [v.findings[0].key], Budget.UNASKED, SETTINGS, T0 + 301).clear is None


def test_unobserved_is_unknown_not_healthy_and_never_a_taint():
    plan = plan_node(verdict(unobserved=("gpu", "efa")), node(), None, [], Budget.UNASKED, SETTINGS, T0)
    statuses = {c.type: (c.status, c.reason) for c in plan.desired.conditions}
    assert statuses == {"GpuHealthy": ("Unknown", "GpuNotObserved"), "EfaHealthy": ("Unknown", "EfaNotObserved")}
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
    plan = plan_node(verdict(gpu(Action.REPLACE_NODE)), node(), None, [], Budget.ALLOWS, SETTINGS, T0)
    assert our_taint(plan) == ("replace_node", "NoSchedule")
