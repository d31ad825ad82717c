"""Where the node is between "fault seen" and "back in service": the remediation stage, and its history.

Operators trust an agent that takes nodes away only when they can see, at any moment, where each
faulty node is in the pipeline and why it waits. The stage is derived (a pure function) from the
verdict and what the node object shows, never kept as a second truth beside them:

  healthy          no open finding, no taint of the agent's
  observing        open findings, none of which takes the node out (monitor, restart_app,
                   reset_gpu)
  cordoned         the agent's NoSchedule: new pods stay off, the job's grace runs. A finding
                   that takes the node out is ``cordoned`` from the moment it opens, while its
                   taint is on its way (a write on the effects thread a moment later): a
                   fault moves healthy -> cordoned, never through ``observing``
  held_by_budget   NoSchedule past the grace: the disruptive step is due and the disruption
                   budget has no slot for it
  disrupting       the agent's disruptive step is on the node (NoExecute evicts the job's
                   pods) and no engine has visibly taken the node yet
  handed_off       an engine has the node: it cordoned or drained it (``spec.unschedulable``, which
                   the agent never sets), Karpenter's ``karpenter.sh/disrupted`` taint is on, or the
                   agent's request is one an engine acts on by itself (HyperPod's
                   ``UnschedulablePending*`` with ``hyperpod_labels``, a gated condition ``False``
                   in the ``eks`` vocabulary, which node repair acts on after its toleration). An
                   engine the agent is not configured for is no hand-off: its marks are any
                   node's to write about itself (``budget_reclaim.Evidence``)
  rebooting        a reboot_node's disruptive step is on: the node waits for a new boot id
  cleared          the agent's taint came off (healed, or an operator's clear), for
                   ``CLEARED_HOLD_SECONDS``: nodes returning to service stay visible

``StageHistory`` (``healthagent/stage_history.py``) keeps, on the decision clock, when the current stage was entered (and the wall
time, for people), the transitions by stage pair, and how long each finished stay lasted, as
cumulative histogram buckets. An agent restart starts the current stay again: the history lives
in the process, and the stage itself is re-derived from the node at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from healthagent.effects.budget_reclaim import Evidence, shows_disruptive_step
from healthagent.effects.node_desired import NO_EXECUTE, owned_taints
from healthagent.model import Action, Verdict
from healthagent.stage_history import (  # noqa: F401 (the stage vocabulary, re-exported)
    CLEARED, CLEARED_HOLD_SECONDS, CORDONED, DISRUPTING, DURATION_BUCKETS, HANDED_OFF, HEALTHY, HELD_BY_BUDGET,
    OBSERVING, REBOOTING, STAGES, TAINTED_STAGES, USUAL_MOVES, Durations, StageHistory, started)

KARPENTER_DISRUPTED_TAINT = "karpenter.sh/disrupted"


@dataclass(frozen=True)
class NodeSide:
    """What the node object shows of the pipeline (``node_side``), carried in ``KubeStatus``."""

    taint_action: str = ""  # the value of the agent's taint: replace_node | reboot_node | ""
    disruptive: bool = False  # a disruptive step is on: NoExecute, HyperPod pending, a gated False
    engine: str = ""  # who has the node: karpenter | drain | hyperpod | node-repair | ""


def node_side(node: Mapping | None, evidence: Evidence) -> NodeSide:
    """The pipeline as ``node`` shows it (None: not read yet), for the engines configured."""
    if not node:
        return NodeSide()
    taints = owned_taints(node, evidence.taint_key)
    action = str(taints[0].get("value") or "") if taints else ""
    return NodeSide(action, shows_disruptive_step(node, evidence), engine_of(node, evidence))


def engine_of(node: Mapping, evidence: Evidence) -> str:
    """Which engine has visibly taken the node, if any: its own action first (Karpenter's
    disrupted taint, a cordon by a drain), then a request that an engine the agent is
    configured for acts on by itself."""
    spec = node.get("spec") or {}
    if any(isinstance(t, Mapping) and t.get("key") == KARPENTER_DISRUPTED_TAINT for t in spec.get("taints") or []):
        return "karpenter"
    if spec.get("unschedulable") is True:
        return "drain"
    if evidence.hyperpod_requested(node):
        return "hyperpod"
    if evidence.repair_requested(node):
        return "node-repair"
    return ""


def stage_of(verdict: Verdict | None, taint_effect: str, budget_blocked: bool, side: NodeSide,
             previous: "StageHistory", now: float, grace_seconds: float = 0.0, *,
             taints: bool = True) -> tuple[str, str]:
    """(stage, reason) for the node now. The reason is short and bounded: a finding code, an
    engine, ``budget``; never free text (it is a metric label). A node the budget holds is
    ``cordoned`` while its grace (``grace_seconds`` since it was first seen tainted) runs: the
    budget matters only once the disruptive step is due. ``taints``: the agent writes its taint
    (not ``--kube off``), so a node action in the verdict is ``cordoned`` before the taint lands."""
    leading = _leading_code(verdict)
    if taint_effect:
        due = previous.tainted_since is not None and now - previous.tainted_since >= grace_seconds
        if budget_blocked and due:
            return HELD_BY_BUDGET, "budget"
        if side.engine and (side.disruptive or side.engine in ("karpenter", "drain")):
            return HANDED_OFF, side.engine
        if taint_effect == NO_EXECUTE or side.disruptive:
            return (REBOOTING, leading or Action.REBOOT_NODE.value) if side.taint_action == Action.REBOOT_NODE.value \
                else (DISRUPTING, leading or side.taint_action or "taint")
        return CORDONED, leading or side.taint_action or "taint"
    if taints and verdict is not None and verdict.action.needs_node_action and \
            previous.stage in (HEALTHY, OBSERVING, CORDONED):
        return CORDONED, leading  # its taint is on its way (or an operator's clear is, to policy)
    if previous.stage in TAINTED_STAGES or (previous.stage == CLEARED and now - previous.entered < CLEARED_HOLD_SECONDS):
        if verdict is None or not verdict.findings or previous.stage == CLEARED:
            return CLEARED, previous.reason if previous.stage == CLEARED else "taint_removed"
        return CLEARED, "taint_removed"
    if verdict is not None and verdict.findings:
        return OBSERVING, leading
    return HEALTHY, ""


def _leading_code(verdict: Verdict | None) -> str:
    if verdict is None or not verdict.findings:
        return ""
    return max(verdict.findings, key=lambda f: list(Action).index(f.action)).code
