"""What ``healthagent classify`` and ``healthagent explain`` say about a ConnectX (mlx5) event.

Why a module of its own: an operator pastes a dmesg from an InfiniBand node into ``classify`` and
expects its mlx5_core lines judged beside the XIDs, and looks an event id up with ``explain`` as
an XID is looked up, both with the action the agent would take under their policy file (the
``mlx5:`` section). The words come from the same catalog rows (``mlx5_events.csv``) that decide
the ``RDMA_ADAPTER_EVENT`` finding, so what these commands print cannot drift from what the agent
does. ``cli.py`` only calls these functions.

A classify row of an adapter event keeps the fields every row has (``pci_bus_id``, ``name``,
``action``, ``line``) and names its event with the key ``mlx5``, as an SXid row names its number
with ``sxid`` instead of ``xid``: a reader that picks rows by ``xid`` or ``sxid`` sees no change.
"""

from __future__ import annotations

from typing import Any

from healthagent.model import Action, AdapterEvent, XidEvent
from healthagent.policy.catalog import Catalog
from healthagent.policy.classify import classify_event
from healthagent.policy.findings import FINDINGS, duration_words
from healthagent.policy.mlx5_catalog import Mlx5Catalog, Mlx5Entry
from healthagent.policy.settings import Policy
from healthagent.present.explain import xid_rule_line

ADAPTER_EVENT = "RDMA_ADAPTER_EVENT"  # the finding an adapter event below "none" opens
MLX5_KEY = "mlx5"  # a classify row's key for the event id, and the policy file's section
DAY = 86400.0


def classify_adapter_event(event: AdapterEvent, catalog: Mlx5Catalog) -> dict[str, Any]:
    """One adapter event as ``healthagent classify`` prints it: the event id, the adapter's PCI id,
    the catalog's action (the policy file's override where it has one), the meaning in plain words,
    what varies within the event (the module number, the command) and the line itself."""
    entry = catalog.lookup(event.event)
    return {MLX5_KEY: event.event, "pci_bus_id": event.pci_bus_id, "name": event.event,
            "action": entry.action.value, "meaning": entry.meaning, "detail": event.detail, "line": event.line}


def classify_row(event: XidEvent | AdapterEvent, catalog: Catalog, mlx5: Mlx5Catalog) -> tuple[str, dict[str, Any]]:
    """(what the row counts as in classify's summary: ``xid``, ``sxid`` or ``mlx5``; the row) for
    any event the kernel-log parser yields, so the command counts and prints in one place."""
    if isinstance(event, AdapterEvent):
        return MLX5_KEY, classify_adapter_event(event, mlx5)
    row = classify_event(event, catalog)
    return ("sxid" if "sxid" in row else "xid"), row


def _span(seconds: float) -> str:
    """A window as a person says it: days for the repeat rule's week, else as findings say it."""
    if seconds >= 2 * DAY:
        return f"{seconds / DAY:g} days"
    return duration_words(seconds)


def finding_words(entry: Mlx5Entry, policy: Policy) -> str:
    """Whether the event opens a finding, and how long it lasts (as ``adapters.AdapterJudge`` and
    the finding book treat it)."""
    if entry.action is Action.NONE:
        return "none (the event is only counted, in healthagent_mlx5_events_total)"
    head = (f"{ADAPTER_EVENT}, one per adapter (its most severe event gives the action and the words; "
            "milder ones refresh it); ")
    if entry.action is Action.REPLACE_NODE:
        return head + "stays until an operator clears it"
    if entry.action is Action.REBOOT_NODE:
        return head + "stays until the node reboots (the boot id changes), then clears if the checks pass"
    return head + (f"drives the verdict until {duration_words(policy.mlx5_window_seconds)} pass without the "
                   "adapter logging another event (mlx5_window_seconds)")


def explain_mlx5(event: str, catalog: Mlx5Catalog, policy: Policy) -> str:
    """``healthagent explain <event id>``: the catalog row as the agent applies it under ``policy``."""
    entry = catalog.lookup(event)
    lines = [f"ConnectX (mlx5) event {event}: {entry.meaning}"]
    if entry.kernel_text:
        lines.append(f"Kernel log: mlx5_core <PCI id>: {entry.kernel_text}")
    lines.append(f"Our action: {entry.action.value}")
    lines.append(f"Decided by: {entry.reason()}")
    repeat = policy.mlx5_repeat_seconds
    if entry.action is Action.REBOOT_NODE and repeat > 0:
        lines.append(f"Again after a reboot: the same event on the same adapter within {_span(repeat)} of the "
                     "last one (mlx5_repeat_seconds) opens as replace_node: the reboot did not fix it.")
    lines.append(f"Finding: {finding_words(entry, policy)}")
    tuned = xid_rule_line(ADAPTER_EVENT, policy)
    if tuned:
        lines.append(tuned)
    if not entry.overridden:
        other = Action.MONITOR if entry.action is not Action.MONITOR else Action.REBOOT_NODE
        lines.append(f"To change it: in the policy file (--policy-file FILE, or the policy_file setting) set "
                     f"`{MLX5_KEY}: {{{event}: {other.value}}}`, or any other action.")
    if policy.source:
        lines.append(f"Policy file: {policy.source}")
    lines.append(f"What to do: {entry.runbook}")
    lines.append(f"Runbook: {FINDINGS[ADAPTER_EVENT].runbook}")
    return "\n".join(lines)
