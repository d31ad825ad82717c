"""The finding codes, what each one demands by default, and the words an on-call engineer reads.

Codes are a contract (alerts, dashboards and ``docs/findings.md#<code>`` anchors use them); this
table is the view of the finding catalog (``findings.csv``, ``finding_catalog.py``) that the rules
and ``check`` read. ``settings`` validates ``disabled_rules`` against it and the docs test checks
that every code has its section. The texts are short on purpose: ``check`` prints them in a
table, and the full runbook is one link away.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from healthagent.model import Action
from healthagent.policy.finding_catalog import catalog_rows

DOCS = "docs/findings.md"


@dataclass(frozen=True)
class FindingInfo:
    """One finding code: its default action (None = decided per event by a catalog: the XID
    catalog, or for RDMA_ADAPTER_EVENT the mlx5 one)."""

    code: str
    title: str
    action: Action | None
    next_steps: str
    runbook: str  # the docs anchor of its runbook


_INFOS = tuple(FindingInfo(row.code, row.title, Action.parse(row.action) if row.action else None,
                            row.next_steps, row.runbook or f"{DOCS}#{row.code.lower()}")
               for row in catalog_rows())

FINDINGS: dict[str, FindingInfo] = {info.code: info for info in _INFOS}
FINDING_CODES: tuple[str, ...] = tuple(FINDINGS)

# What an on-call engineer does for an XID incident, by the action it demands.
ACTION_STEPS: dict[Action, str] = {
    Action.NONE: "Nothing to do.",
    Action.MONITOR: "No action on the node now. If it repeats, run `healthagent explain {xid}` and "
                    "attach `nvidia-bug-report.sh` to a case with NVIDIA.",
    Action.RESTART_APP: "The application faulted, not the node: restart the job from its last "
                        "checkpoint and read its CUDA error. If the same XID follows this GPU "
                        "across jobs, drain the node and run `dcgmi diag -r 3`.",
    Action.RESET_GPU: "Drain the workloads on {gpu}, then reset it (`nvidia-smi -r -i {index}`); if "
                      "the reset fails or the XID returns, reboot the node.",
    Action.REBOOT_NODE: "The agent taints the node (NoSchedule, then NoExecute after the grace, within the "
                        "disruption budget): let the job "
                        "checkpoint and scale down, then "
                        "drain and reboot. The finding clears after the reboot if checks pass; if "
                        "it returns, replace the node.",
    Action.REPLACE_NODE: "The agent taints the node (NoSchedule, then NoExecute after the grace, within the "
                         "disruption budget): do not "
                         "return it to the job. Collect `nvidia-bug-report.sh` and replace the "
                         "instance; the finding stays until the GPU is replaced or an operator "
                         "clears it.",
}

# Plain words for what an action means, used at the end of summaries.
ACTION_WORDS: dict[Action, str] = {
    Action.NONE: "no action",
    Action.MONITOR: "informational, no action on the node",
    Action.RESTART_APP: "the application faulted; the GPU is expected to be healthy",
    Action.RESET_GPU: "the GPU needs a reset before it can be trusted",
    Action.REBOOT_NODE: "the node needs a reboot",
    Action.REPLACE_NODE: "the node must be replaced",
}


def gpu_words(index: int | None, pci_bus_id: str) -> str:
    """"GPU 3 (0000:a8:00.0)", "GPU 0000:a8:00.0" or "an unknown GPU"."""
    if index is not None and pci_bus_id:
        return f"GPU {index} ({pci_bus_id})"
    if index is not None:
        return f"GPU {index}"
    if pci_bus_id:
        return f"GPU {pci_bus_id}"
    return "an unknown GPU"


def fill(template: str, *, index: int | None = None, pci_bus_id: str = "", device: str = "",
         xid: int | None = None) -> str:
    """Fill a next-steps template; an unknown GPU index becomes a placeholder the reader fills."""
    return template.format(
        gpu=gpu_words(index, pci_bus_id), index=index if index is not None else "<index>",
        device=device or "the device", xid=xid if xid is not None else "<xid>",
    )


def steps_for(code: str, **where) -> str:
    info = FINDINGS[code]
    return f"{fill(info.next_steps, **where)} Runbook: {info.runbook}"


def clock(t: float) -> str:
    """A timestamp as UTC wall time for evidence ("10:11:12"); formatting only, no clock read."""
    try:
        return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return f"t={t:.0f}"


def day(t: float) -> str:
    try:
        return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d")
    except (OverflowError, OSError, ValueError):
        return "?"


def span_words(start: float, end: float) -> str:
    """"at 10:11:12 UTC on 2024-05-01" or "between 10:11:12 and 10:11:40 UTC on 2024-05-01"."""
    if end - start < 1:
        return f"at {clock(start)} UTC on {day(start)}"
    return f"between {clock(start)} and {clock(end)} UTC on {day(start)}"


def duration_words(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
