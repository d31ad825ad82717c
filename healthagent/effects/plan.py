"""One pure plan for the agent's node: from (verdict, node, record, budget) to the two patches.

``plan_node`` is the whole decision of the write side and does no I/O and reads no clock (``now``
is an argument). The effects ask it once per attempt; both the node patch (labels, annotations,
taints) and the ``/status`` patch (conditions) come from that one plan. The budget is an input:
when the plan would ADD the agent's taint and the budget was not asked yet, the plan says so
(``asks_budget``) and holds the taint back; the caller asks the budget (a cluster read) and plans
again with the answer. Nothing else in a plan depends on the cluster.

What the plan decides, in order:
  1. the findings that count: the verdict's, minus those an operator cleared (the record's
     ``cleared`` keys, and all of them when the node carries a new ``healthagent.io/clear``);
  2. the action shown: their most severe, except that a ``replace_node`` taint on the node is
     sticky until an operator clears it, and a ``reboot_node`` taint whose finding's subsystem is
     unobserved stays (unobserved is not healthy);
  3. the taint (``node_desired.plan_taint``: NoSchedule, NoExecute after the grace, the budget),
     the conditions, the labels and the clear-handled annotation (``node_desired``);
  4. the patches: only what differs from the node.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable

from healthagent.effects.node_desired import (
    CLEAR_ANNOTATION,
    CLEAR_HANDLED_ANNOTATION,
    TAINT_ACTIONS,
    DesiredNode,
    TaintPlan,
    annotations_of,
    grace_start,
    node_patch,
    not_observed_conditions,
    observed_by,
    owned_taints,
    plan_conditions,
    plan_labels,
    plan_taint,
    status_patch,
)
from healthagent.effects.record import AppliedTaint
from healthagent.model import Action, Finding, SourceHealth, Verdict


class Budget(enum.Enum):
    """What the disruption budget said about adding the agent's taint."""

    UNASKED = "unasked"  # not needed: the plan adds no taint (one that would is held back)
    ALLOWS = "allows"
    HOLDS = "holds"  # over budget, or the count failed: no new taint
    ROLLBACK = "rollback"  # this node lost a race past the limit: its new taint comes off again


@dataclass(frozen=True)
class PlanSettings:
    """The settings a plan depends on."""

    taint_key: str
    grace_seconds: float
    hyperpod_labels: bool


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

    @property
    def writes(self) -> int:
        """How many requests the plan needs (0: the node is as wanted)."""
        return int(self.node_patch is not None) + int(self.status_patch is not None)


def clear_request(node: dict) -> ClearRequest | None:
    """A ``healthagent.io/clear`` token on the node that the agent has not handled yet."""
    annotations = annotations_of(node)
    token = annotations.get(CLEAR_ANNOTATION, "")
    if token and token != annotations.get(CLEAR_HANDLED_ANNOTATION, ""):
        return ClearRequest(token, "annotation")
    return None


def effective_findings(verdict: Verdict | None, cleared: Iterable[str]) -> tuple[Finding, ...]:
    """The verdict's findings that no operator cleared."""
    if verdict is None:
        return ()
    gone = set(cleared)
    return tuple(f for f in verdict.findings if f.key not in gone)


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


def decide(verdict: Verdict | None, node: dict, taint_record: AppliedTaint | None, cleared: Iterable[str],
           taint_key: str) -> Decision:
    clear = clear_request(node)
    every_key = {f.key for f in verdict.findings} if (clear and verdict) else set()
    findings = effective_findings(verdict, set(cleared) | every_key)
    action = Action.most_severe([f.action for f in findings])
    on_node = {t.get("value") for t in owned_taints(node, taint_key)} if clear is None else set()
    sticky = Action.REPLACE_NODE.value in on_node
    held = Action.REBOOT_NODE.value in on_node and blind_to(verdict, taint_record.code if taint_record else "")
    shown = Action.REPLACE_NODE if sticky else (
        Action.most_severe([action, Action.REBOOT_NODE]) if held else action)
    return Decision(findings, shown, clear, sticky)


def needs_budget(verdict: Verdict | None, node: dict, taint_record: AppliedTaint | None,
                 cleared: Iterable[str], taint_key: str) -> bool:
    """Would the plan ADD the agent's taint (the only step the budget is asked about)?"""
    decision = decide(verdict, node, taint_record, cleared, taint_key)
    return decision.shown in TAINT_ACTIONS and not owned_taints(node, taint_key)


def plan_node(verdict: Verdict | None, node: dict, taint_record: AppliedTaint | None, cleared: Iterable[str],
              budget: Budget, settings: PlanSettings, now: float,
              health: Iterable[SourceHealth] = ()) -> NodePlan:
    """The plan for ``node`` (as last read) under ``verdict``; pure."""
    key = settings.taint_key
    decision = decide(verdict, node, taint_record, cleared, key)
    findings, shown, clear = decision.findings, decision.shown, decision.clear
    if budget is Budget.ROLLBACK:
        taint = TaintPlan(taint=None, adds_taint=True, budget_blocked=True)
    else:
        since = grace_start(node, key, shown.value,
                            taint_record.since if taint_record and taint_record.value == shown.value else None)
        taint = plan_taint(action=shown, node=node, taint_key=key, grace_seconds=settings.grace_seconds,
                           since=since, now=now, budget_allows=lambda: budget is Budget.ALLOWS)
    leading_code = findings[0].code if findings else (taint_record.code if taint_record else "")
    unobserved = verdict.unobserved if verdict is not None else ()
    conditions = plan_conditions(
        findings,
        sticky_without_finding=decision.sticky and all(f.action is not Action.REPLACE_NODE for f in findings),
        sticky_code=taint_record.code if taint_record else "",
        not_observed=not_observed_conditions(node, unobserved, health))
    labels = plan_labels(node=node, shown=shown, taint=taint, leading_code=leading_code,
                         hyperpod=settings.hyperpod_labels, unobserved=bool(unobserved))
    annotations = {CLEAR_HANDLED_ANNOTATION: clear.token} if clear else {}
    desired = DesiredNode(taint=taint.taint, labels=labels, annotations=annotations, conditions=conditions)
    return NodePlan(desired=desired, node_patch=node_patch(node, desired, key, now),
                    status_patch=status_patch(node, desired, now), taint=taint, clear=clear,
                    findings=findings, shown=shown, leading_key=findings[0].key if findings else "",
                    leading_code=leading_code)
