"""SageMaker HyperPod's node labels: when the agent asks HyperPod to reboot or replace a node.

HyperPod's automatic node recovery reboots or replaces a node whose
``sagemaker.amazonaws.com/node-health-status`` says ``UnschedulablePendingReboot`` or
``UnschedulablePendingReplacement``; ``Schedulable`` is its healthy value, which jobs select on. Its
own health agent writes these labels too, with ``fault-types`` and ``fault-reasons`` beside them.

Three rules, as pure functions over the node as last read:

- the pending value is disruptive: the agent writes it only with its taint on, the job's grace
  over and a budget slot held (``disruptive_ready``);
- it never steps back: a replacement the agent asked for stays one when a reboot_node finding
  follows; only the taint's end (a clear, a reboot) or a budget rollback gives the label back;
- another writer's request is never overwritten: a value whose ``metadata.managedFields`` name a
  field manager other than the agent's is kept with its fault labels (``hyperpod_kept``), and the
  agent says so in an Event. Without managedFields (dry-run) a pending value is the agent's when it
  matches the action of the agent's own health label, as the agent writes the two together.
"""

from __future__ import annotations

from typing import Mapping

from healthagent.effects.conditions import FIELD_MANAGER, REPLACE_PENDING_REASON, label_managers
from healthagent.model import Action
from healthagent.policy.finding_catalog import catalog

HYPERPOD_HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
HYPERPOD_FAULT_TYPES_LABEL = "sagemaker.amazonaws.com/fault-types"
HYPERPOD_FAULT_REASONS_LABEL = "sagemaker.amazonaws.com/fault-reasons"
HYPERPOD_PENDING_REPLACEMENT = "UnschedulablePendingReplacement"
HYPERPOD_PENDING_REBOOT = "UnschedulablePendingReboot"
HYPERPOD_SCHEDULABLE = "Schedulable"
HYPERPOD_PENDING = {Action.REPLACE_NODE: HYPERPOD_PENDING_REPLACEMENT,
                    Action.REBOOT_NODE: HYPERPOD_PENDING_REBOOT}


def fault_type_of(code: str) -> str:
    """A short fault category for HyperPod's fault-types label (the agent's own vocabulary): the
    finding catalog's hyperpod_fault_type column; a code it does not know: ``GPU``."""
    row = catalog().get(code)
    return row.hyperpod_fault_type if row is not None and row.hyperpod_fault_type else "GPU"


def hyperpod_request(node: Mapping, agent_action: Action | None) -> tuple[str, bool | None]:
    """The node-health-status on the node and whether the agent wrote it: True (only the agent's
    field manager owns the label), False (another writer does), None (``Schedulable`` or no value:
    no request stands). ``agent_action``: what the agent's own health label says (the fallback
    without managedFields)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    value = labels.get(HYPERPOD_HEALTH_LABEL)
    if not isinstance(value, str) or value in ("", HYPERPOD_SCHEDULABLE):
        return "", None
    managers = label_managers(node, HYPERPOD_HEALTH_LABEL)
    if managers is None:
        return value, HYPERPOD_PENDING.get(agent_action) == value if agent_action else False
    return value, managers == (FIELD_MANAGER,)


def hyperpod_labels(node: Mapping, agent_action: Action | None, taint_action: Action | None, *,
                    disruptive_ready: bool, held: bool, leading_code: str) -> dict[str, str | None]:
    """HyperPod's labels as the agent wants them (a key not named is not touched; None removes).
    ``taint_action``: the value of the agent's taint as planned (None: no taint);
    ``disruptive_ready``: its grace is over and the node holds a budget slot; ``held``: the budget
    holds the node at NoSchedule."""
    value, ours = hyperpod_request(node, agent_action)
    if taint_action is not None and disruptive_ready:
        if ours is False or (ours and value == HYPERPOD_PENDING_REPLACEMENT):
            return {}  # another writer's request, or the agent's replacement: kept as it is
        return {HYPERPOD_HEALTH_LABEL: HYPERPOD_PENDING[taint_action],
                HYPERPOD_FAULT_TYPES_LABEL: fault_type_of(leading_code or "GPU"),
                HYPERPOD_FAULT_REASONS_LABEL: _label_value(leading_code or REPLACE_PENDING_REASON)}
    if ours and (taint_action is None or held):
        return {HYPERPOD_HEALTH_LABEL: HYPERPOD_SCHEDULABLE, HYPERPOD_FAULT_TYPES_LABEL: None,
                HYPERPOD_FAULT_REASONS_LABEL: None}
    return {}


def hyperpod_kept(node: Mapping, agent_action: Action | None, taint_action: Action | None,
                  disruptive_ready: bool) -> str:
    """Another writer's value that the agent kept where it would have written its own pending
    value ("" when none was kept)."""
    if taint_action is None or not disruptive_ready:
        return ""
    value, ours = hyperpod_request(node, agent_action)
    return value if ours is False else ""


def _label_value(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:63].strip("-_.")
    return cleaned or "unknown"
