"""The effects' one pure step: (state, verdict, node, budget, now, wall) -> (state, plan, Events).

Each row is one transition of the node's life as docs/operations.md tells it: a fault taints at
once, the grace ends in NoExecute only with a budget slot, a held node is reported once and
released, a slot lost in a race rolls back, healing removes the taint, an operator clears by
annotation or by removing the taint, a recreated Node forgets the taint, a taint is adopted from
the node with its grace, a reboot taint waits for a reboot, what cannot be seen never taints,
another writer's condition is left alone. No I/O, no clock: the same inputs give the same step,
and the inputs are never changed.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from healthagent.effects.api_time import rfc3339
from healthagent.effects.conditions import vocabulary
from healthagent.effects.node_desired import CLEAR_ANNOTATION, TAINT_BOOT_ANNOTATION
from healthagent.effects.plan import Budget, PlanSettings
from healthagent.effects.record import AppliedTaint, EffectsState
from healthagent.effects.step import StepContext, asks_budget, report_findings, step
from healthagent.model import Action, Finding, Verdict

KEY = "healthagent.io/unhealthy"
T0 = 1_700_000_000.0
GRACE = 120.0
SETTINGS = PlanSettings(taint_key=KEY, grace_seconds=GRACE, hyperpod_labels=False)
CTX = StepContext("gpu-node-0", SETTINGS, vocabulary("healthagent"), budget_note="slots_held=1 limit=1",
                  budget_limits="budget_max_fraction=0.1 budget_max_nodes=None")


def finding(action: Action = Action.REPLACE_NODE, code: str = "GPU_XID", finding_id: int = 1) -> Finding:
    return Finding(code=code, action=action, summary="s", evidence="e", next_steps="n",
                   pci_bus_id="0000:53:00.0", first_seen=T0, last_seen=T0, id=finding_id)


def verdict(*findings: Finding, unobserved: tuple[str, ...] = (), clear_token: str = "") -> Verdict:
    return Verdict.of(list(findings), T0, unobserved=unobserved, clear_token=clear_token)


def node(*ours: tuple[str, str, float], uid: str = "u1", annotations: dict | None = None,
         boot: str = "boot-a", conditions: list | None = None) -> dict:
    taints = [{"key": KEY, "value": v, "effect": e, "timeAdded": rfc3339(at)} for v, e, at in ours]
    return {"metadata": {"name": "gpu-node-0", "uid": uid, "labels": {}, "annotations": annotations or {}},
            "spec": {"taints": taints},
            "status": {"conditions": conditions or [], "nodeInfo": {"bootID": boot}}}


def taint_of(plan) -> tuple | None:
    t = plan.desired.taint
    return None if t is None else (t.value, t.effect)


REPLACE = verdict(finding())
APPLIED = AppliedTaint("replace_node", "NoSchedule", T0, "GPU_XID")
FOREIGN = {"type": "GpuHealthy", "status": "False", "reason": "SomethingElse", "message": "npd"}

# name, state, verdict, node, budget, now, wall ->
#   (taint wanted, recorded taint after (value, effect) or None, budget_blocked, a taint-removed clear
#    still to write, Event reasons)
CASES = [
    ("a fault taints NoSchedule at once", EffectsState(), REPLACE, node(), Budget.ALLOWS, T0, T0,
     ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), False, "", ()),
    ("in the grace: still NoSchedule", replace(EffectsState(), taint=APPLIED), REPLACE,
     node(("replace_node", "NoSchedule", T0)), Budget.ALLOWS, T0 + GRACE - 1, T0 + GRACE - 1,
     ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), False, "", ()),
    ("the grace over with a slot: NoExecute", replace(EffectsState(), taint=APPLIED), REPLACE,
     node(("replace_node", "NoSchedule", T0)), Budget.ALLOWS, T0 + GRACE, T0 + GRACE,
     ("replace_node", "NoExecute"), ("replace_node", "NoExecute"), False, "", ()),
    ("the grace over, the wall clock an hour back: NoExecute all the same",
     replace(EffectsState(), taint=APPLIED), REPLACE, node(("replace_node", "NoSchedule", T0)), Budget.ALLOWS,
     T0 + GRACE, T0 + GRACE - 3600, ("replace_node", "NoExecute"), ("replace_node", "NoExecute"), False, "", ()),
    ("5 s in, the wall clock an hour ahead: still NoSchedule", replace(EffectsState(), taint=APPLIED), REPLACE,
     node(("replace_node", "NoSchedule", T0)), Budget.ALLOWS, T0 + 5, T0 + 3605,
     ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), False, "", ()),
    ("the grace over without a slot: held at NoSchedule and reported once",
     replace(EffectsState(), taint=APPLIED), REPLACE, node(("replace_node", "NoSchedule", T0)), Budget.HOLDS,
     T0 + GRACE, T0 + GRACE, ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), True, "",
     ("TaintBlockedByBudget",)),
    ("still held: no second report", replace(EffectsState(), taint=APPLIED, budget_blocked=True,
                                             budget_blocked_total=1), REPLACE,
     node(("replace_node", "NoSchedule", T0)), Budget.HOLDS, T0 + GRACE + 30, T0 + GRACE + 30,
     ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), True, "", ()),
    ("a slot frees: released, NoExecute", replace(EffectsState(), taint=APPLIED, budget_blocked=True), REPLACE,
     node(("replace_node", "NoSchedule", T0)), Budget.ALLOWS, T0 + GRACE + 60, T0 + GRACE + 60,
     ("replace_node", "NoExecute"), ("replace_node", "NoExecute"), False, "", ()),
    ("a slot lost in a race: a NoExecute just written rolls back to NoSchedule",
     replace(EffectsState(), taint=replace(APPLIED, effect="NoExecute"), rollback=True), REPLACE,
     node(("replace_node", "NoExecute", T0)), Budget.ROLLBACK, T0 + GRACE, T0 + GRACE,
     ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), True, "", ("TaintBlockedByBudget",)),
    ("an escalation keeps the NoExecute on the node", replace(EffectsState(), taint=replace(
        APPLIED, value="reboot_node", effect="NoExecute")), verdict(finding(Action.REPLACE_NODE)),
     node(("reboot_node", "NoExecute", T0)), Budget.ALLOWS, T0 + 500, T0 + 500,
     ("replace_node", "NoExecute"), ("replace_node", "NoExecute"), False, "", ()),
    ("a reboot taint goes when its finding does and the node rebooted",
     replace(EffectsState(), taint=replace(APPLIED, value="reboot_node")), verdict(),
     node(("reboot_node", "NoSchedule", T0), annotations={TAINT_BOOT_ANNOTATION: "boot-a"}, boot="boot-b"),
     Budget.UNASKED, T0 + 600, T0 + 600, None, None, False, "", ("Cleared",)),
    ("a reboot taint stays until the node reboots", replace(EffectsState(), taint=replace(APPLIED, value="reboot_node")),
     verdict(), node(("reboot_node", "NoSchedule", T0), annotations={TAINT_BOOT_ANNOTATION: "boot-a"}),
     Budget.ALLOWS, T0 + 60, T0 + 60, ("reboot_node", "NoSchedule"), ("reboot_node", "NoSchedule"), False, "", ()),
    ("an escalation in the grace goes on with the first taint's grace",
     replace(EffectsState(), taint=replace(APPLIED, value="reboot_node")), verdict(finding(Action.REPLACE_NODE)),
     node(("reboot_node", "NoSchedule", T0)), Budget.ALLOWS, T0 + GRACE, T0 + GRACE,
     ("replace_node", "NoExecute"), ("replace_node", "NoExecute"), False, "", ()),
    ("replace is sticky without a finding", replace(EffectsState(), taint=APPLIED), verdict(),
     node(("replace_node", "NoSchedule", T0)), Budget.ALLOWS, T0 + 10, T0 + 10,
     ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), False, "", ()),
    ("an operator's clear annotation waits for policy: the node is held as it is",
     replace(EffectsState(), taint=APPLIED), REPLACE,
     node(("replace_node", "NoSchedule", T0), annotations={CLEAR_ANNOTATION: "ticket-1"}), Budget.UNASKED,
     T0 + 30, T0 + 30, ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), False, "", ()),
    ("a clear policy accounted for: taint off, said once", replace(EffectsState(), taint=APPLIED),
     verdict(clear_token="ticket-1"),
     node(("replace_node", "NoSchedule", T0), annotations={CLEAR_ANNOTATION: "ticket-1"}), Budget.UNASKED,
     T0 + 31, T0 + 31, None, None, False, "", ("Cleared",)),
    ("the taint removed by hand is an operator's clear, written to the node", replace(EffectsState(), taint=APPLIED),
     REPLACE, node(), Budget.UNASKED, T0 + 30, T0 + 30, None, None, False, "", ()),
    ("a recreated Node object forgets the taint and is tainted again",
     replace(EffectsState(), taint=APPLIED, node_uid="old"), REPLACE, node(uid="new"), Budget.ALLOWS,
     T0 + 30, T0 + 30, ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), False, "", ()),
    ("a taint on the node without a record starts its grace at first sight (state lost)", EffectsState(),
     REPLACE, node(("replace_node", "NoSchedule", T0)), Budget.ALLOWS, 5000.0, T0 + GRACE,
     ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), False, "", ()),
    ("a taint on the node without a record, the wall clock hours ahead: the grace starts at first sight",
     EffectsState(), REPLACE, node(("replace_node", "NoSchedule", T0)), Budget.ALLOWS, 5000.0, T0 + 6 * 3600,
     ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), False, "", ()),
    ("a timeAdded in the future starts the grace now", EffectsState(), REPLACE,
     node(("replace_node", "NoSchedule", T0 + 3600)), Budget.ALLOWS, 5000.0, T0,
     ("replace_node", "NoSchedule"), ("replace_node", "NoSchedule"), False, "", ()),
    ("what cannot be seen never taints", EffectsState(), verdict(unobserved=("gpu", "efa")), node(),
     Budget.UNASKED, T0, T0, None, None, False, "", ()),
    ("a finding below a node action never taints", EffectsState(), verdict(finding(Action.MONITOR, "GPU_ECC_SBE")),
     node(), Budget.UNASKED, T0, T0, None, None, False, "", ()),
    ("another writer's condition is left alone and said once", EffectsState(), REPLACE,
     node(conditions=[FOREIGN]), Budget.ALLOWS, T0, T0, ("replace_node", "NoSchedule"),
     ("replace_node", "NoSchedule"), False, "", ("ForeignConditionWriter",)),
]


@pytest.mark.parametrize("name,state,v,n,budget,now,wall,taint,recorded,blocked,token,reasons", CASES,
                         ids=[c[0] for c in CASES])
def test_each_transition(name, state, v, n, budget, now, wall, taint, recorded, blocked, token, reasons):
    before = (copy.deepcopy(n), state, v)
    result = step(state, v, n, budget, now, wall, CTX)
    assert (copy.deepcopy(n), state, v) == before  # the inputs are untouched
    assert step(state, v, n, budget, now, wall, CTX) == result  # pure: same inputs, same step
    assert taint_of(result.plan) == taint
    after = result.state.taint
    assert (None if after is None else (after.value, after.effect)) == recorded
    assert result.state.budget_blocked is blocked and result.state.clear_to_write == token
    reasons_seen = tuple(e.reason for e in result.noticed + result.events)
    if "ForeignConditionWriter" in reasons:
        assert len(reasons_seen) == 1 and [w.type for w in result.observed.foreign] == ["GpuHealthy"]
    else:
        assert reasons_seen == reasons
    assert not result.state.rollback  # a plan that lands ends a rollback


def test_a_taint_removed_by_hand_becomes_a_clear_on_the_node_and_is_kept_until_written():
    """Seen once, the removal is an operator's clear: the observed state keeps the token to write
    (a write that fails does not make it a second clear with another token), the plan writes it as
    the clear annotation and re-adds no taint; once on the node it is a node fact like any clear."""
    state = replace(EffectsState(), taint=APPLIED)
    token = f"taint-removed-{int(T0 + 30)}"
    result = step(state, REPLACE, node(), Budget.UNASKED, T0 + 30, T0 + 30, CTX)
    assert result.observed.clear_to_write == token and result.observed.taint is None
    assert result.plan.node_patch == {"metadata": {"annotations": {CLEAR_ANNOTATION: token}}}
    assert result.state.clear_to_write == ""  # once that lands, the node carries it
    again = step(result.observed, REPLACE, node(), Budget.UNASKED, T0 + 40, T0 + 40, CTX)  # the write failed
    assert again.observed.clear_to_write == token and again.plan.node_patch == result.plan.node_patch
    on_node = node(annotations={CLEAR_ANNOTATION: token})
    waiting = step(result.state, REPLACE, on_node, Budget.UNASKED, T0 + 41, T0 + 41, CTX)
    assert waiting.plan.writes == 0 and taint_of(waiting.plan) is None  # held until policy accounts for it
    done = step(result.state, verdict(clear_token=token), on_node, Budget.UNASKED, T0 + 42, T0 + 42, CTX)
    assert [e.reason for e in done.events] == ["Cleared"] and "removing the agent's taint" in done.events[0].note


def test_a_taint_removed_by_hand_beside_an_operators_clear_annotation_is_that_clear():
    """The operator removed the taint and annotated the node: one clear, the operator's. The agent
    writes no taint-removed token over it (policy would then wait for a clear nobody asked for)."""
    state = replace(EffectsState(), taint=APPLIED)
    result = step(state, REPLACE, node(annotations={CLEAR_ANNOTATION: "ticket-1"}), Budget.UNASKED, T0 + 30,
                  T0 + 30, CTX)
    assert result.observed.clear_to_write == "" and result.observed.taint is None
    assert result.plan.node_patch is None and taint_of(result.plan) is None  # held as it is, for policy
    done = step(result.state, verdict(clear_token="ticket-1"), node(annotations={CLEAR_ANNOTATION: "ticket-1"}),
                Budget.UNASKED, T0 + 31, T0 + 31, CTX)
    assert [e.reason for e in done.events] == ["Cleared"]


def test_the_budget_is_asked_only_for_a_disruptive_step_ahead():
    assert asks_budget(EffectsState(), REPLACE, node(), SETTINGS)
    assert not asks_budget(EffectsState(), verdict(finding(Action.MONITOR, "GPU_ECC_SBE")), node(), SETTINGS)
    assert not asks_budget(EffectsState(), verdict(), node(), SETTINGS)  # healing never asks


def test_findings_are_reported_once_and_again_only_when_they_escalate():
    state, specs, _ = report_findings(EffectsState(), [finding(Action.REBOOT_NODE)], T0, "n")
    assert [s.action for s in specs] == ["Detected"]
    state, specs, _ = report_findings(state, [finding(Action.REBOOT_NODE)], T0 + 1, "n")
    assert specs == ()
    state, specs, notes = report_findings(state, [finding(Action.REPLACE_NODE)], T0 + 2, "n")
    assert [s.action for s in specs] == ["Escalated"] and "escalated" in notes[0].text
