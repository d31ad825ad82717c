"""``healthagent explain XID``: everything the on-call needs about one XID, without searching NVIDIA's
docs during an incident: the catalog row, NVIDIA's resolution bucket, our action and the rule or
override that decided it, how long the finding lasts, what a replacement engine does with the
verdict under the configured condition vocabulary, and what to do.
"""

from __future__ import annotations

from healthagent.model import Action
from healthagent.policy.catalog import BUCKET_ACTIONS, RECOVERY_XID, Catalog, CatalogEntry
from healthagent.policy.debounce import row
from healthagent.policy.findings import ACTION_STEPS, FINDINGS
from healthagent.policy.settings import Policy
from healthagent.policy.scope import explain_scope

PERSISTENCE = {
    Action.NONE: "no finding is raised (the XID is still counted in healthagent_xid_errors_total)",
    Action.REPLACE_NODE: "stays until an operator clears it or the GPU at that PCI id is replaced "
                         "(its UUID changes)",
    Action.REBOOT_NODE: "stays until the node reboots (the boot id changes), then clears if the "
                        "checks pass",
}


def persistence(action: Action, policy: Policy) -> str:
    if action in PERSISTENCE:
        return PERSISTENCE[action]
    return (f"drives the verdict until {policy.xid_window_seconds:g} s pass without this GPU "
            f"logging another XID (xid_window_seconds)")


# What to do, said without a GPU at hand (explain is about an XID, not one GPU's incident) and
# without pointing back at explain itself.
_MONITOR_STEPS = ("No action on the node now. If it repeats on the same GPU, collect "
                  "`nvidia-bug-report.sh` and open a case with NVIDIA.")
_RECOVERY_STEPS = ("Do what the driver's message names (the agent takes that action, as above): "
                   "nothing for 'None'; restart the job for 'Drain P2P'; drain and reset the GPU for "
                   "'Drain and Reset' or 'GPU Reset Required'; drain and reboot the node for 'Node "
                   "Reboot Required'.")


def what_to_do(xid: int, entry: CatalogEntry) -> str:
    """The on-call's next step for an XID in general (``check`` names the GPU for an incident)."""
    if xid == RECOVERY_XID and not entry.overridden:
        return _RECOVERY_STEPS
    if entry.action is Action.MONITOR:
        return _MONITOR_STEPS
    return ACTION_STEPS[entry.action].format(gpu="the GPU that logged it", index="<index>", xid=xid,
                                             device="the device")


# -- what a replacement engine does with the verdict --------------------------------------------
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
    head = f"Engines (condition_vocabulary={vocabulary}): "
    if action is Action.NONE:
        return [head + "no finding, so no condition or label changes; no engine acts."]
    if vocabulary != "eks":
        text = head + "GpuHealthy turns False (reason GPU_XID); no engine acts on GpuHealthy or NetworkHealthy by itself."
        if node_action and not hyperpod_labels:
            text += (" The agent's taint takes the node out of its job; to have it replaced, set "
                     "condition_vocabulary=eks (Karpenter, managed node groups) or hyperpod_labels=true "
                     "(SageMaker HyperPod).")
        lines = [text]
    elif not node_action:
        lines = [head + f"AcceleratedHardwareReady stays True (FindingsWithoutNodeAction): no engine acts "
                        f"on a {action.value} verdict."]
    else:
        reason = f"NvidiaXID{xid}Error"
        nma = (f"XID {xid} is one of its fatal XIDs, so it sets the condition False itself ({reason})"
               if xid in NMA_FATAL_XIDS else
               f"XID {xid} is not one of its fatal XIDs (an Event only), so there only the agent's taint"
               + (" and HyperPod act" if hyperpod_labels else " acts") + " on it")
        lines = [head + f"AcceleratedHardwareReady turns False with reason {reason} once the NoExecute grace "
                        "is over and the node holds a budget slot.",
                 f"- Karpenter node repair (feature gate NodeRepair, {KARPENTER_VERSION}) replaces the node once "
                 "AcceleratedHardwareReady has been False for 10 minutes; it reads only the condition's type "
                 f"and status, so this {action.value} verdict is a replacement under Karpenter.",
                 karpenter_v115_line(xid, action, reason),
                 "- EKS managed node groups' node auto repair acts after 10 minutes: reboot or replace, by its "
                 f"own rules for {reason} (its default for the XID, or your nodeRepairConfigOverrides).",
                 f"- EKS node monitoring agent {NMA_VERSION}, where installed, writes AcceleratedHardwareReady "
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


# -- where this project's default is not NVIDIA's bucket -------------------------------------------

def bucket_action(entry: CatalogEntry) -> Action | None:
    """What NVIDIA's immediate bucket alone gives (the mapping rule), None without a rule."""
    return BUCKET_ACTIONS.get(entry.bucket) if entry.known else None


def departs(entry: CatalogEntry) -> bool:
    """The bundled row's action is not the mapping rule's: this project chose otherwise."""
    rule = bucket_action(entry)
    return rule is not None and entry.catalog_action is not None and entry.catalog_action is not rule


def _numbers(xids: list[int]) -> str:
    words = [str(x) for x in xids]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def departure_lines(xid: int, entry: CatalogEntry, catalog: Catalog) -> list[str]:
    """Said plainly when the default is this project's and not NVIDIA's: the action, why, and the
    policy-file key that changes it. XID 63, 64, 94 and 95 replace the node although NVIDIA's
    buckets say monitor, reset_gpu or restart_app; the reader of "Our action" must not have to
    reconcile two contradicting lines during an incident."""
    rule = bucket_action(entry)
    assert rule is not None and entry.catalog_action is not None
    lines = [f"Our action: {entry.action.value}" + (
        "" if entry.overridden else
        f" (this project's default, not NVIDIA's: the bucket {entry.bucket} alone would give {rule.value})")]
    if entry.catalog_action is Action.REPLACE_NODE:
        group = [e.xid for e in catalog.entries() if departs(e) and e.catalog_action is Action.REPLACE_NODE]
        lines.append(f"Why: by default this project replaces the node on XID {_numbers(group)}: each reports "
                     "the GPU's memory failing (a row remapped or a remap that failed, an ECC error "
                     "contained or not), so the GPU needs service, and a job put back on it is likely "
                     "to fail again.")
    if not entry.overridden:
        lines.append(f"To change it: in the policy file (--policy-file FILE, or the policy_file setting) "
                     f"set `xid: {{{xid}: {rule.value}}}` for NVIDIA's action, or any other action.")
    return lines


def explain(xid: int, catalog: Catalog, policy: Policy, vocabulary: str = "healthagent",
            hyperpod_labels: bool = False) -> str:
    entry = catalog.lookup(xid)
    lines = [f"XID {xid}: {entry.name}" + (f" - {entry.description}" if entry.description else "")]
    if entry.known:
        lines.append(f"NVIDIA resolution bucket: {entry.nvidia_resolution or '(blank in NVIDIA catalog)'}")
        if entry.bucket in BUCKET_ACTIONS and not departs(entry):
            lines.append(f"Mapping rule: NVIDIA bucket {entry.bucket} -> {BUCKET_ACTIONS[entry.bucket].value}")
    else:
        lines.append("NVIDIA resolution bucket: none (not in NVIDIA's catalog for Ampere and newer)")
    if departs(entry):
        lines += departure_lines(xid, entry, catalog)
    else:
        lines.append(f"Our action: {entry.action.value}")
    lines.append(f"Decided by: {entry.decided_by()}")
    lines.append(explain_scope("GPU_XID", entry.action, policy.scope))
    if xid == RECOVERY_XID and not entry.overridden:
        lines.append("XID 154 text: the action comes from the driver's message: 'None' -> monitor, "
                     "'Drain P2P' -> restart_app, 'Drain and Reset' / 'GPU Reset Required' -> reset_gpu, "
                     "'Node Reboot Required' -> reboot_node; unreadable -> monitor, quoted. The incident "
                     "takes the most severe of its XIDs.")
    lines.append(f"Finding: GPU_XID, one per incident (XIDs on one GPU until "
                 f"{policy.incident_quiet_seconds:g} s of silence); {persistence(entry.action, policy)}")
    tuned = xid_rule_line("GPU_XID", policy)
    if tuned:
        lines.append(tuned)
    if xid == RECOVERY_XID and not entry.overridden:
        lines.append("When the message says 'Node Reboot Required' (reboot_node):")
        lines += engine_lines(xid, Action.REBOOT_NODE, vocabulary, hyperpod_labels)
    else:
        lines += engine_lines(xid, entry.action, vocabulary, hyperpod_labels)
    if policy.source:
        lines.append(f"Policy file: {policy.source}")
    lines.append("What to do: " + what_to_do(xid, entry))
    lines.append(f"Runbook: {FINDINGS['GPU_XID'].runbook}")
    return "\n".join(lines)


def xid_rule_line(code: str, policy: Policy) -> str | None:
    """For ``explain XID``: one line when the incident's rule is not the built-in one."""
    if policy.rule(code) == row(code).rule:
        return None
    return f"Finding rule: {code} opens {policy.rule(code).words()} (`healthagent explain {code}`)"
