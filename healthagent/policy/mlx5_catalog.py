"""The ConnectX (mlx5) event catalog: one row per kernel-log event the agent recognises, with its
default action, merged with the operator's overrides.

``mlx5_events.csv`` (beside ``xid_catalog.csv``) holds, per event: ``event`` (the id the parser
gives it, the ``event`` label of ``healthagent_mlx5_events_total`` and the key of a policy file's
``mlx5:`` section), ``action``, ``kernel_text`` (the driver's wording, Linux 6.12; in brackets the
other forms it has printed since 5.4 for the same event), ``meaning`` in
plain words and a ``runbook`` line. docs/findings.md#rdma_adapter_event prints the same table.

How the defaults were chosen, as an InfiniBand operator would defend them:

- The adapter is out of the job (``reboot_node``) when its firmware is hung or fatal, the driver
  gave up on it, a firmware command timed out (a stuck command interface) or its PCIe link failed
  (frozen or permanently failed channel): every queue pair on it is in error, and a reboot resets
  the firmware and the link. The same event on the same adapter again after a reboot escalates to
  ``replace_node`` (``policy/adapters.py``), as a condition that survives a reboot does.
- A bad, unsupported, overheating or unpowered cable or module, an adapter over its temperature
  warning, a correctable PCIe error, a command answered only through the driver's recovery and
  the health buffer's syndrome line are ``monitor``: raised
  as a finding and an alert, but the node stays in the job; when the module's port does go down,
  ``RDMA_PORT_DOWN`` judges the port itself.
- A cable plugged or unplugged and a successful recovery are ``none``: counted in the metric,
  no finding.

This module reads the CSV and nothing else (``settings`` validates a policy file's event ids
against it, so it must not import the policy).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from typing import Mapping

from healthagent.model import Action

CATALOG_FILE = "mlx5_events.csv"
COLUMNS = ("event", "action", "kernel_text", "meaning", "runbook")


@dataclass(frozen=True)
class Mlx5Entry:
    """One event as the agent treats it. ``catalog_action`` is the bundled row's; ``action`` wins."""

    event: str
    action: Action
    meaning: str
    runbook: str
    kernel_text: str = ""
    catalog_action: Action | None = None  # None: not in the catalog
    overridden: bool = False

    def reason(self) -> str:
        """Why this action, in a few words (for a finding's evidence)."""
        if self.overridden:
            was = self.catalog_action.value if self.catalog_action else "monitor"
            return f"operator override in the policy file (the catalog says {was})"
        if self.catalog_action is None:
            return "not in the mlx5 catalog: reported as monitor, never dropped"
        return f"mlx5 catalog: {self.event} -> {self.action.value}"


@lru_cache(maxsize=1)
def bundled_rows() -> tuple[Mapping[str, str], ...]:
    """The bundled rows, read once per process (the file is part of the package)."""
    text = resources.files("healthagent.policy").joinpath(CATALOG_FILE).read_text(encoding="utf-8")
    return tuple(csv.DictReader(io.StringIO(text)))


def event_ids() -> tuple[str, ...]:
    """Every event id of the catalog, in its order."""
    return tuple(row["event"] for row in bundled_rows())


class Mlx5Catalog:
    """event id -> Mlx5Entry, with the operator's overrides applied."""

    def __init__(self, entries: Mapping[str, Mlx5Entry]) -> None:
        self._entries = dict(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Mlx5Entry]:
        return list(self._entries.values())

    def lookup(self, event: str) -> Mlx5Entry:
        entry = self._entries.get(event)
        if entry is not None:
            return entry
        return Mlx5Entry(event=event, action=Action.MONITOR, meaning="an mlx5 event this catalog does not list",
                         runbook="Read the line; report it with `devlink health show`.")


def load_mlx5_catalog(overrides: Mapping[str, Action]) -> Mlx5Catalog:
    """The bundled catalog with the policy file's ``mlx5:`` overrides (ids already validated)."""
    entries: dict[str, Mlx5Entry] = {}
    for row in bundled_rows():
        action = Action.parse(row["action"])
        entries[row["event"]] = Mlx5Entry(event=row["event"], action=action, meaning=row["meaning"],
                                          runbook=row["runbook"], kernel_text=row["kernel_text"],
                                          catalog_action=action)
    for event, action in overrides.items():
        if event in entries:
            entries[event] = replace(entries[event], action=action, overridden=True)
    return Mlx5Catalog(entries)
