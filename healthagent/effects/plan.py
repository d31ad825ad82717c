"""One pure plan for the agent's node: from (verdict, node, record, budget) to the two patches.

``plan_node`` is the whole decision of the write side and does no I/O and reads no clock (``now``
is an argument). The effects ask it once per attempt; both the node patch (labels, annotations,
taints) and the ``/status`` patch (conditions) come from that one plan. The budget is an input:
whether this node holds a slot of the disruption budget. Before planning, a node that holds none
asks whether the plan has a disruptive step ahead (``needs_budget``) and, if so, the budget (a
cluster read: ``BudgetGuard``), and plans with the answer. Nothing else in a plan depends on the
cluster.

The budget guards the disruptive steps only: NoExecute after the grace, HyperPod's
``UnschedulablePending*`` value, a gated condition's ``False``. NoSchedule is never budgeted: a node
with a node action always gets it, so new pods stay off a faulty GPU while its running pods are
untouched. A node without a slot is *held* there (``TaintPlan.budget_blocked``) until one frees.

What the plan decides, in order:
  1. the findings that count: the verdict's. An operator's clear on the node (a new
     ``healthagent.io/clear``) is carried out only with a verdict that accounts for it
     (``Verdict.clear_token``): policy alone decides what it closes, and until that verdict
     arrives the plan holds the node as it is (``hold_plan``);
  2. the action shown: their most severe, except that a ``replace_node`` taint on the node is
     sticky until an operator clears it, and a ``reboot_node`` taint stays while its finding's
     subsystem is unobserved (unobserved is not healthy) and until the node reports a new boot id
     (``node_desired.reboot_outstanding``: only a reboot clears it);
  3. the taint (``node_desired.plan_taint``: NoSchedule, NoExecute after the grace with a slot),
     the conditions in the configured vocabulary (in ``eks`` mode ``False`` only once the taint is
     on past its grace with a slot, so the budget gates them too; none of a type another writer
     owns), the labels, the clear-handled and taint-boot-id annotations (``node_desired``);
  4. the patches: only what differs from the node.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable

from healthagent.effects.conditions import vocabulary
from healthagent.effects.hyperpod import hyperpod_kept
from healthagent.effects.node_desired import (
    CLEAR_ANNOTATION,
    CLEAR_HANDLED_ANNOTATION,
    NO_EXECUTE,
    TAINT_ACTIONS,
    DesiredNode,
    Pending,
    TaintPlan,
    TaintSpec,
    agent_action,
    annotations_of,
    boot_annotation,
    carries_no_execute,
    grace_start,
    not_observed_conditions,
    observed_by,
    owned_taints,
    plan_conditions,
    plan_labels,
    plan_taint,
    reboot_outstanding,
)
from healthagent.effects.node_patch import node_patch, status_patch
from healthagent.effects.record import AppliedTaint
from healthagent.model import Action, Finding, SourceHealth, Verdict


class Budget(enum.Enum):
    """What the disruption budget said about this node's disruptive step."""

    UNASKED = "unasked"  # not asked: no disruptive step ahead (one that is ahead is held: fail closed)
    FIRST = "first"  # not asked yet: the NoSchedule goes on first, the slot is asked right after it
    ALLOWS = "allows"  # this node holds a slot
    HOLDS = "holds"  # no slot (all held, the Leases unreadable): held at NoSchedule
    ROLLBACK = "rollback"  # its slot was reclaimed before its write landed: back to held NoSchedule


@dataclass(frozen=True)
class PlanSettings:
    """The settings a plan depends on."""

    taint_key: str
    grace_seconds: float
    hyperpod_labels: bool
    reboot_noexecute: bool = True  # reboot_node gets NoExecute after the grace, as replace_node does
    condition_vocabulary: str = "healthagent"  # or "eks" (effects/conditions.py)
    foreign_quiet_seconds: float = 660.0  # the most another writer's condition waits to be taken back


@dataclass(frozen=True)
class ClearRequest:
    """An operator's clear: the token and how it was given (``annotation`` | ``taint-removed``)."""

    token: str
    via: str


@dataclass(frozen=True)
class NodePlan:
    desired: DesiredNode
    node_patch: dict | None  # labels, annotations, taints (None: nothing differs)
    status_patch: dict | None  # conditions (None: nothing differs)
    taint: TaintPlan
    clear: ClearRequest | None
    findings: tuple[Finding, ...]
    shown: Action
    leading_key: str
    leading_code: str
    wants_slot: bool = False  # a slot covers this plan's disruptive step (``slot_wanted``)
    hyperpod_kept: str = ""  # another writer's HyperPod value kept where the agent would write its own

    @property
    def writes(self) -> int:
        """How many requests the plan needs (0: the node is as wanted)."""
        return int(self.node_patch is not None) + int(self.status_patch is not None)


TAINT_REMOVED = "taint-removed-"  # a clear token the agent writes for its taint removed by hand


def clear_request(node: dict, to_write: str = "") -> ClearRequest | None:
    """A ``healthagent.io/clear`` token on the node that the agent has not handled yet, else the
    taint-removed clear the agent is about to write there (``to_write``)."""
    annotations = annotations_of(node)
    token = annotations.get(CLEAR_ANNOTATION, "")
    if token and token != annotations.get(CLEAR_HANDLED_ANNOTATION, ""):
        return ClearRequest(token, "taint-removed" if token.startswith(TAINT_REMOVED) else "annotation")
    if to_write:
        return ClearRequest(to_write, "taint-removed")
    return None


def blind_to(verdict: Verdict | None, code: str) -> bool:
    """Is a subsystem that a finding of ``code`` is seen through unobserved right now?"""
    unobserved = verdict.unobserved if verdict is not None else ()
    return any(part in unobserved for part in observed_by(code))


@dataclass(frozen=True)
class Decision:
    """Which findings count and which action the node shows (steps 1 and 2 above)."""

    findings: tuple[Finding, ...]
    shown: Action
    clear: ClearRequest | None
    sticky: bool  # the agent's replace_node taint is on the node and no clear asks it off
    awaits_reboot: bool = False  # its reboot_node taint is on and the node has not rebooted since
    hold: bool = False  # a clear waits for a verdict that accounts for it: the node stays as it is


def decide(verdict: Verdict | None, node: dict, taint_record: AppliedTaint | None, taint_key: str,
           clear_to_write: str = "") -> Decision:
    """Which findings count and which action the node shows. An operator's clear on the node is
    carried out only with a verdict whose ``clear_token`` is that clear's: policy decided what it
    closes. Until then the plan holds (``hold``): nothing is added, nothing taken off."""
    clear = clear_request(node, clear_to_write)
    if clear is not None and (verdict is None or verdict.clear_token != clear.token):
        return Decision((), Action.NONE, clear, False, hold=True)
    findings = verdict.findings if verdict is not None else ()
    action = Action.most_severe([f.action for f in findings])
    on_node = {t.get("value") for t in owned_taints(node, taint_key)} if clear is None else set()
    sticky = Action.REPLACE_NODE.value in on_node
    rebooting = Action.REBOOT_NODE.value in on_node
    awaits_reboot = rebooting and reboot_outstanding(node)
    held = rebooting and (awaits_reboot or blind_to(verdict, taint_record.code if taint_record else ""))
    shown = Action.REPLACE_NODE if sticky else (
        Action.most_severe([action, Action.REBOOT_NODE]) if held else action)
    return Decision(findings, shown, clear, sticky, awaits_reboot)


def disruptive_step_ahead(action: Action, settings: PlanSettings) -> bool:
    """Does ``action`` lead to a disruptive step, one that takes the job's pods off or has the
    node repaired: NoExecute after the grace (replace_node; reboot_node unless
    ``reboot_noexecute`` is off), HyperPod's ``UnschedulablePending*`` value, a gated condition's
    ``False``? NoSchedule alone is not one."""
    if action not in TAINT_ACTIONS:
        return False
    return (action is Action.REPLACE_NODE or settings.reboot_noexecute or settings.hyperpod_labels
            or vocabulary(settings.condition_vocabulary).gated)


def slot_wanted(shown: Action, node: dict, settings: PlanSettings) -> bool:
    """Should this node hold a budget slot: its node action has a disruptive step ahead, or the
    agent's NoExecute is on it already (the disruption it counts was taken)? The slot is taken
    when the node is first tainted, not when the grace ends, so it is reserved while the job
    gets its grace (see docs/design.md)."""
    return shown in TAINT_ACTIONS and (disruptive_step_ahead(shown, settings)
                                       or carries_no_execute(node, settings.taint_key))


def needs_budget(verdict: Verdict | None, node: dict, taint_record: AppliedTaint | None,
                 settings: PlanSettings, clear_to_write: str = "") -> bool:
    """Would the plan take a disruptive step, now or once the grace is over, that a budget slot
    must cover? The caller asks the budget only while this node holds no slot
    (``BudgetGuard.holds_slot``); healing (clearing, removing the taint) and holding never ask."""
    decision = decide(verdict, node, taint_record, settings.taint_key, clear_to_write)
    return not decision.hold and slot_wanted(decision.shown, node, settings)


def pending_taint(decision: Decision, taint_record: AppliedTaint | None, blind: bool) -> Pending | None:
    """The taint the node keeps with no open finding behind it, if any: a sticky ``replace_node``
    without a replace finding, a ``reboot_node`` waiting for its reboot without a finding that
    needs one (while its part is unobserved, the condition says Unknown instead)."""
    code = taint_record.code if taint_record else ""
    if decision.sticky and all(f.action is not Action.REPLACE_NODE for f in decision.findings):
        return Pending(code, Action.REPLACE_NODE)
    if decision.awaits_reboot and not blind and all(f.action not in TAINT_ACTIONS for f in decision.findings):
        return Pending(code, Action.REBOOT_NODE)
    return None


def plan_node(verdict: Verdict | None, node: dict, taint_record: AppliedTaint | None,
              budget: Budget, settings: PlanSettings, now: float,
              health: Iterable[SourceHealth] = (), foreign: Iterable[str] = (), wall: float | None = None,
              clear_to_write: str = "") -> NodePlan:
    """The plan for ``node`` (as last read) under ``verdict``; pure. ``foreign``: condition types
    another writer owns on this node (``EffectsState.foreign``), which the plan leaves alone.

    ``now`` is the decision clock (``clock.py``: it never jumps), which times the grace; ``wall``
    the wall time written for people and the API (``timeAdded``, ``lastTransitionTime``); None:
    the caller has one clock (``now``). ``clear_to_write``: a taint-removed clear the node does
    not carry yet; the plan writes it as the clear annotation and holds."""
    wall = now if wall is None else wall
    key = settings.taint_key
    decision = decide(verdict, node, taint_record, key, clear_to_write)
    if decision.hold:
        return hold_plan(node, key, clear_to_write, wall)
    findings, shown, clear = decision.findings, decision.shown, decision.clear
    since = grace_start(node, key, taint_record.since if taint_record else None, now)
    if since is not None and since > now:  # a grace cannot have started in the future: it starts now
        since = now
    held = budget not in (Budget.ALLOWS, Budget.FIRST) and disruptive_step_ahead(shown, settings)
    taint = plan_taint(action=shown, node=node, taint_key=key, grace_seconds=settings.grace_seconds,
                       since=since, now=now, held=held, reboot_noexecute=settings.reboot_noexecute,
                       rollback=budget is Budget.ROLLBACK, first=budget is Budget.FIRST)
    leading_code = findings[0].code if findings else (taint_record.code if taint_record else "")
    unobserved = verdict.unobserved if verdict is not None else ()
    vocab = vocabulary(settings.condition_vocabulary)
    conditions = plan_conditions(
        findings, pending=pending_taint(decision, taint_record,
                                         blind_to(verdict, taint_record.code if taint_record else "")),
        not_observed=not_observed_conditions(node, unobserved, health, vocab), vocab=vocab, taint=taint,
        leave=foreign)
    labels = plan_labels(node=node, shown=shown, taint=taint, leading_code=leading_code,
                         hyperpod=settings.hyperpod_labels, unobserved=bool(unobserved))
    annotations = {CLEAR_HANDLED_ANNOTATION: clear.token} if clear else {}
    annotations.update(boot_annotation(node, taint, findings))
    desired = DesiredNode(taint=taint.taint, labels=labels, annotations=annotations, conditions=conditions)
    kept = hyperpod_kept(node, agent_action(node), Action(taint.taint.value) if taint.taint else None,
                         taint.disruptive_ready) if settings.hyperpod_labels else ""
    return NodePlan(desired=desired, node_patch=node_patch(node, desired, key, wall),
                    status_patch=status_patch(node, desired, wall), taint=taint, clear=clear,
                    findings=findings, shown=shown, leading_key=findings[0].key if findings else "",
                    leading_code=leading_code, wants_slot=slot_wanted(shown, node, settings), hyperpod_kept=kept)


def hold_plan(node: dict, taint_key: str, clear_to_write: str, wall: float) -> NodePlan:
    """The node as it is while a clear waits for policy: the agent's taint, labels and conditions
    untouched (its budget slot kept while a taint stands), and only a taint-removed clear written
    to the node as the clear annotation, so policy (which reads the node) can account for it."""
    ours = owned_taints(node, taint_key)
    main = max(ours, key=lambda t: (t.get("value") == Action.REPLACE_NODE.value, t.get("effect") == NO_EXECUTE),
               default=None)
    spec = TaintSpec(str(main.get("value") or ""), str(main.get("effect") or "")) if main is not None else None
    annotations = {}
    if clear_to_write and annotations_of(node).get(CLEAR_ANNOTATION) != clear_to_write:
        annotations[CLEAR_ANNOTATION] = clear_to_write
    desired = DesiredNode(taint=spec, annotations=annotations)
    taint = TaintPlan(taint=spec, adds_taint=False, disruptive_ready=carries_no_execute(node, taint_key))
    patch = node_patch(node, desired, taint_key, wall) if annotations else None
    shown = next((a for a in TAINT_ACTIONS if spec is not None and a.value == spec.value), Action.NONE)
    return NodePlan(desired=desired, node_patch=patch, status_patch=None, taint=taint, clear=None, findings=(),
                    shown=shown, leading_key="", leading_code="", wants_slot=spec is not None)
