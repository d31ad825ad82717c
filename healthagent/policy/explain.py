"""``healthagent explain XID``: everything the on-call needs about one XID, without searching NVIDIA's
docs during an incident: the catalog row, NVIDIA's resolution bucket, our action and the rule or
override that decided it, how long the finding lasts, and what to do.
"""

from __future__ import annotations

from healthagent.model import Action
from healthagent.policy.catalog import BUCKET_ACTIONS, RECOVERY_XID, Catalog, CatalogEntry
from healthagent.policy.findings import ACTION_STEPS, FINDINGS
from healthagent.policy.settings import Policy

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


def explain(xid: int, catalog: Catalog, policy: Policy) -> str:
    entry = catalog.lookup(xid)
    lines = [f"XID {xid}: {entry.name}" + (f" - {entry.description}" if entry.description else "")]
    if entry.known:
        lines.append(f"NVIDIA resolution bucket: {entry.nvidia_resolution or '(blank in NVIDIA catalog)'}")
        if entry.bucket in BUCKET_ACTIONS:
            lines.append(f"Mapping rule: NVIDIA bucket {entry.bucket} -> {BUCKET_ACTIONS[entry.bucket].value}")
    else:
        lines.append("NVIDIA resolution bucket: none (not in NVIDIA's catalog for Ampere and newer)")
    lines.append(f"Our action: {entry.action.value}")
    lines.append(f"Decided by: {entry.decided_by()}")
    if xid == RECOVERY_XID and not entry.overridden:
        lines.append("XID 154 text: the action comes from the driver's message: 'None' -> monitor, "
                     "'Drain P2P' -> restart_app, 'Drain and Reset' / 'GPU Reset Required' -> reset_gpu, "
                     "'Node Reboot Required' -> reboot_node; unreadable -> monitor, quoted. The incident "
                     "takes the most severe of its XIDs.")
    lines.append(f"Finding: GPU_XID, one per incident (XIDs on one GPU until "
                 f"{policy.incident_quiet_seconds:g} s of silence); {persistence(entry.action, policy)}")
    if policy.source:
        lines.append(f"Policy file: {policy.source}")
    lines.append("What to do: " + what_to_do(xid, entry))
    lines.append(f"Runbook: {FINDINGS['GPU_XID'].runbook}")
    return "\n".join(lines)
