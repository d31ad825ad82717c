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
from healthagent.present.engine_words import engine_lines

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
