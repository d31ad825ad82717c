"""What the repair engines do with a GPU_XID verdict, for ``healthagent explain XID``: Karpenter's node
repair, EKS managed node groups' auto repair, the EKS node monitoring agent and SageMaker HyperPod,
under the condition vocabulary and HyperPod labels the agent is configured with.

Why its own module at the edge: this is knowledge of other projects' released behaviour, which
changes with their versions, not a decision of the agent's. The condition types come from the
vocabularies the effects write (``effects/conditions.py``), so the words cannot name a condition
the agent does not set; a vocabulary an engine repairs on is the one whose conditions are
``gated`` (turned False only for a node action the agent is taking).
"""

from __future__ import annotations

from healthagent.effects.conditions import DEFAULT, VOCABULARIES
from healthagent.model import Action

# As released and checked: Karpenter v1.14.1 (kubernetes-sigs/karpenter pkg/controllers/node/health
# with aws/karpenter-provider-aws RepairPolicies: a condition's type and status, a toleration from
# its lastTransitionTime, never its reason); the EKS User Guide's "Automatically repair nodes in
# EKS clusters" for managed node groups; aws/eks-node-monitoring-agent v1.7.0 for the XIDs that
# make its AcceleratedHardwareReady False (monitors/nvidia/dcgm/dcgm_policies.go); SageMaker
# HyperPod's "Resilience-related Kubernetes labels". Karpenter v1.15.0 (2026-10-10: its release notes,
# karpenter.sh/v1.15 "Disruption", the EKS User Guide's "Repair behavior on Karpenter v1.15.0 and
# later") runs repair as the first disruption method: paced by the NodePool's disruption budgets,
# a replacement launched before the node is drained, karpenter.sh/do-not-repair as a veto, and on
# AWS a reboot instead of a replacement by the condition's reason behind the RebootForRepair gate.
KARPENTER_VERSION = "v1.14.1"
KARPENTER_V115 = "v1.15.0"
NMA_VERSION = "v1.7.2"
NMA_FATAL_XIDS = frozenset({46, 48, 54, 62, 63, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 142, 143, 151,
                            155, 156, 158})
# The EKS User Guide's default action per XID reason (managed node groups; Karpenter v1.15.0 and
# later with RebootForRepair): reboot for these, replace for 74, 79, 119, 120, 121 and 140.
EKS_REBOOT_XIDS = frozenset({13, 31, 48, 63, 64, 94, 95})
HYPERPOD_VALUES = {Action.REPLACE_NODE: ("UnschedulablePendingReplacement", "replaces"),
                   Action.REBOOT_NODE: ("UnschedulablePendingReboot", "reboots")}


def engine_lines(xid: int, action: Action, vocabulary: str = "healthagent",
                 hyperpod_labels: bool = False) -> list[str]:
    """What the repair engines do with a GPU_XID verdict of ``action``, for the condition
    vocabulary (``healthagent`` or ``eks``) and HyperPod's labels as configured."""
    node_action = action in (Action.REBOOT_NODE, Action.REPLACE_NODE)
    vocab = VOCABULARIES.get(vocabulary, DEFAULT)
    head = f"Engines (condition_vocabulary={vocabulary}): "
    if action is Action.NONE:
        return [head + "no finding, so no condition or label changes; no engine acts."]
    if not vocab.gated:
        text = (head + f"{vocab.gpu_type} turns False (reason GPU_XID); no engine acts on {vocab.gpu_type} or "
                f"{vocab.network_type} by itself.")
        if node_action and not hyperpod_labels:
            text += (" The agent's taint takes the node out of its job; to have it replaced, set "
                     "condition_vocabulary=eks (Karpenter, managed node groups) or hyperpod_labels=true "
                     "(SageMaker HyperPod).")
        lines = [text]
    elif not node_action:
        lines = [head + f"{vocab.gpu_type} stays True (FindingsWithoutNodeAction): no engine acts "
                        f"on a {action.value} verdict."]
    else:
        reason = f"NvidiaXID{xid}Error"
        nma = (f"XID {xid} is one of its fatal XIDs, so it sets the condition False itself ({reason})"
               if xid in NMA_FATAL_XIDS else
               f"XID {xid} is not one of its fatal XIDs (an Event only), so there only the agent's taint"
               + (" and HyperPod act" if hyperpod_labels else " acts") + " on it")
        lines = [head + f"{vocab.gpu_type} turns False with reason {reason} once the NoExecute grace "
                        "is over and the node holds a budget slot.",
                 f"- Karpenter node repair (feature gate NodeRepair, {KARPENTER_VERSION}) replaces the node once "
                 f"{vocab.gpu_type} has been False for 10 minutes; it reads only the condition's type "
                 f"and status, so this {action.value} verdict is a replacement under Karpenter.",
                 karpenter_v115_line(xid, action, reason),
                 "- EKS managed node groups' node auto repair acts after 10 minutes: reboot or replace, by its "
                 f"own rules for {reason} (its default for the XID, or your nodeRepairConfigOverrides).",
                 f"- EKS node monitoring agent {NMA_VERSION}, where installed, writes {vocab.gpu_type} "
                 f"itself and the agent leaves the condition alone while it does; {nma}."]
    if hyperpod_labels:
        if node_action:
            value, verb = HYPERPOD_VALUES[action]
            lines.append(f"- SageMaker HyperPod (hyperpod_labels): node-health-status becomes {value} once the "
                         f"grace is over and the node holds a budget slot; with automatic node recovery on, "
                         f"HyperPod {verb} the node at once. A request another writer already set is kept.")
        else:
            lines.append("- SageMaker HyperPod (hyperpod_labels): node-health-status is left as it is.")
    return lines


def karpenter_v115_line(xid: int, action: Action, reason: str) -> str:
    """Karpenter v1.15.0's repair of a node whose AcceleratedHardwareReady the agent set False."""
    text = (f"- Karpenter node repair {KARPENTER_V115}: after the same 10 minutes the node is a repair "
            "candidate, repaired as a disruption within its NodePool's disruption budget (a budget whose "
            "reasons leave repair out does not limit it), a replacement launched before the node is "
            "drained; karpenter.sh/do-not-repair=true on the node stops it. ")
    if xid not in EKS_REBOOT_XIDS:
        return text + f"{reason} is a replacement by the EKS User Guide's table, RebootForRepair or not."
    text += (f"With the AWS provider's RebootForRepair gate on, {reason} is a reboot (the EKS User "
             "Guide's table); off, a replacement.")
    if action is Action.REPLACE_NODE:
        text += (" A reboot does not end this replace_node verdict: the agent's taint and the False "
                 "condition stay, and Karpenter repairs the node again.")
    return text
