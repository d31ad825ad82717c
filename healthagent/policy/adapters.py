"""ConnectX (mlx5) kernel-log events -> RDMA_ADAPTER_EVENT findings, one per adapter; pure.

Each event takes its action from the mlx5 catalog (``mlx5_catalog.py``, with the policy file's
``mlx5:`` overrides), as an XID takes its from the XID catalog. The finding names the adapter by
its PCI id (the key, stable whether or not its RDMA device is known) and by its device (``mlx5_0``)
when the RDMA source has read a port of that PCI function; the name is remembered, so an adapter
the driver has unloaded after a fatal error keeps it. Its code starts ``RDMA_``, so it lands on
the networking condition with the ports' findings.

Why one finding per adapter rather than one per event: a failing adapter logs a burst (the miss
count, the fatal sensor, the health buffer, a command timeout, the recovery), and the node needs
one finding and one Event for it. The finding keeps the action and the words of the most severe
event; milder ones refresh it and are counted.

**A repeat after a reboot is a replacement.** A ``reboot_node`` event on an adapter that had one
in an earlier boot, within ``mlx5_repeat_seconds`` (7 days), opens as ``replace_node``: the reboot
did not fix it. That is the rule the book applies to a reboot-class condition that comes straight
back; an event has no "straight back", hence the window. The memory (adapter -> the boot and time
of its last reboot-class event) is saved with the classifier's state, learns from a kernel-log
file's earlier boots too (history, otherwise never judged) and is forgotten by an operator's clear
(the adapter was dealt with).

**Names from text are bounded.** The PCI id comes from a kernel-log line, so it goes through the
shared bound (``healthagent/bounded_names.py``) before it names a finding or a count: past
``MLX5_ADAPTERS`` distinct adapters, events fold into one ``~other`` adapter whose finding keeps
the worst action folded into it. The repeat rule never escalates a folded event: ``~other`` is
many adapters, and one adapter's history must not make another's event a replacement.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from healthagent.bounded_names import MLX5_ADAPTERS, OVERFLOW, NameBound
from healthagent.model import Action, AdapterEvent, Collection, RdmaPort
from healthagent.policy.book import EVENT, FindingBook, Signal, Where
from healthagent.policy.findings import FINDINGS, clock, day
from healthagent.policy.incidents import event_time
from healthagent.policy.mlx5_catalog import Mlx5Catalog
from healthagent.policy.settings import Policy

log = logging.getLogger(__name__)

ADAPTER_EVENT = "RDMA_ADAPTER_EVENT"
# The finding codes this module's rules produce (each has its row in findings.csv; a test checks both ways).
PRODUCES = (ADAPTER_EVENT,)
MAX_ADAPTERS = 256  # adapters remembered; far above any real node, a bound for garbage input
EARLIER_BOOT = "earlier boot"  # the boot of an event read from a kernel-log file's earlier boots


def adapter_words(pci_bus_id: str, device: str) -> str:
    """"mlx5_0 (0000:41:00.0)", "0000:41:00.0", or a placeholder when the line named neither."""
    if pci_bus_id == OVERFLOW:
        return f"beyond the first {MLX5_ADAPTERS} adapters the log named (folded into one)"
    if device and pci_bus_id:
        return f"{device} ({pci_bus_id})"
    return device or pci_bus_id or "an adapter the log did not name"


@dataclass
class AdapterJudge:
    """The adapters' events against the catalog, with what must outlive one observation."""

    policy: Policy
    catalog: Mlx5Catalog
    names: dict[str, str] = field(default_factory=dict)  # PCI id -> RDMA device, from the ports seen
    fatal: dict[str, tuple[str, float]] = field(default_factory=dict)  # PCI id -> (boot id, time)
    earlier_boot_total: int = 0  # events from earlier boots seen since start (history only)
    bound: NameBound = field(default_factory=lambda: NameBound("mlx5_adapter", MLX5_ADAPTERS))

    def arrange(self, collection: Collection, now: float) -> list[tuple[AdapterEvent, float]]:
        """This boot's events with their device and time, oldest first; an earlier boot's are only
        remembered (their reboot-class events feed the repeat rule) and logged."""
        self._learn(collection.rdma)
        events = [self._bounded_name(e) for e in collection.adapter_events]
        earlier = [e for e in events if e.previous_boot]
        if earlier:
            self.earlier_boot_total += len(earlier)
            log.info("mlx5_events_from_earlier_boots=%d total=%d not judged (logged before this boot)",
                     len(earlier), self.earlier_boot_total)
            for event in earlier:
                if self.catalog.lookup(event.event).action is Action.REBOOT_NODE:
                    self._remember_earlier(event.pci_bus_id, event_time(event, now))
        current = [(self._named(e), event_time(e, now)) for e in events if not e.previous_boot]
        return sorted(current, key=lambda pair: pair[1])

    def take(self, event: AdapterEvent, t: float, boot_id: str, book: FindingBook) -> None:
        """Judge one event: raise or refresh its adapter's finding (nothing for a ``none`` event)."""
        entry = self.catalog.lookup(event.event)
        action, again = entry.action, ""
        if action is Action.REBOOT_NODE and event.pci_bus_id != OVERFLOW:
            again = self._repeat(event.pci_bus_id, boot_id, t)
            if again:
                action = Action.REPLACE_NODE
        if action is Action.NONE:
            return  # informational (or silenced by the operator): counted in the metric only
        where = Where(pci_bus_id=event.pci_bus_id, fabric_device=event.device)
        name = adapter_words(event.pci_bus_id, event.device)
        what = event.event + (f" ({event.detail})" if event.detail else "")
        reason = entry.reason() + (f"; {again}, so the adapter must be replaced" if again else "")
        repeats = max(1, event.repeats)
        lines = f"{repeats} lines" if repeats > 1 else "1 line"
        signal = Signal(
            code=ADAPTER_EVENT, where=where, bad=True, kind=EVENT, action=action,
            summary=f"ConnectX adapter {name} logged {what}. {entry.meaning}",
            evidence=(f"{' '.join(event.message.split())[:300]!r} at {clock(t)} UTC on {day(t)} "
                      f"(kernel log, {lines}); {action.value}: {reason}"),
            next_steps=f"{entry.runbook} Runbook: {FINDINGS[ADAPTER_EVENT].runbook}",
            quiet_seconds=self.policy.mlx5_window_seconds, count=repeats, occurrences=repeats,
        )
        open_entry = book.entries.get(signal.key)
        if open_entry is not None and open_entry.action.severity > action.severity:
            # a milder event refreshes the finding; its words stay those of the worst one
            signal = replace(signal, action=open_entry.action, summary=open_entry.summary,
                             evidence=open_entry.evidence, next_steps=open_entry.next_steps)
        book.apply(signal, t)

    def forget(self) -> None:
        """An operator's clear: the adapters' reboot-class history starts again."""
        self.fatal.clear()

    # -- memory ---------------------------------------------------------------------------------

    def _learn(self, ports: Iterable[RdmaPort]) -> None:
        for port in ports:
            if port.pci_bus_id and port.device and self.names.get(port.pci_bus_id) != port.device:
                _bounded(self.names)
                self.names[port.pci_bus_id] = port.device

    def _bounded_name(self, event: AdapterEvent) -> AdapterEvent:
        """The event under its bounded name (``bounded_names``): its own, or ``~other``."""
        pci = self.bound.admit(event.pci_bus_id)
        return event if pci == event.pci_bus_id else replace(event, pci_bus_id=pci, device="")

    def _named(self, event: AdapterEvent) -> AdapterEvent:
        device = self.names.get(event.pci_bus_id, "") if event.pci_bus_id else ""
        return replace(event, device=device) if device and device != event.device else event

    def _repeat(self, pci: str, boot_id: str, t: float) -> str:
        """"" or, when this reboot-class event repeats one of an earlier boot within the window,
        the words that say so. Notes this event either way."""
        last = self.fatal.get(pci) if pci else None
        if pci and boot_id:
            _bounded(self.fatal, keep=pci)
            self.fatal[pci] = (boot_id, t)
        window = self.policy.mlx5_repeat_seconds
        if last is None or not boot_id or window <= 0 or last[0] == boot_id or not 0 <= t - last[1] <= window:
            return ""
        return f"it came back after a reboot (the last one at {clock(last[1])} UTC on {day(last[1])})"

    def _remember_earlier(self, pci: str, t: float) -> None:
        last = self.fatal.get(pci)
        if pci and (last is None or last[1] < t):
            _bounded(self.fatal, keep=pci)
            self.fatal[pci] = (EARLIER_BOOT, t)

    # -- state ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"names": dict(self.names), "fatal": {pci: [boot, t] for pci, (boot, t) in self.fatal.items()}}

    def load(self, d: Any, problems: list[str]) -> None:
        """As ``to_dict`` wrote it; an item that cannot be read is left out and described."""
        if not isinstance(d, dict):
            raise TypeError(f"{type(d).__name__} is not a mapping")
        self.names, self.fatal = {}, {}
        for pci, device in list(dict(d.get("names") or {}).items())[:MAX_ADAPTERS]:
            if isinstance(pci, str) and isinstance(device, str):
                self.names[pci] = device
            else:
                problems.append(f"adapter name {str(pci)[:40]}: not text")
        for pci, item in list(dict(d.get("fatal") or {}).items())[:MAX_ADAPTERS]:
            try:
                boot, t = item
                if not isinstance(pci, str) or not isinstance(boot, str) or isinstance(t, bool):
                    raise TypeError("not (text, number)")
                self.fatal[pci] = (boot, float(t))
            except (TypeError, ValueError) as exc:
                problems.append(f"adapter history {str(pci)[:40]}: {exc!r}"[:120])
        self.bound.learn([*self.fatal, *self.names])  # the adapters known before keep their names


def _bounded(table: dict[str, Any], keep: str = "") -> None:
    """Room for one more entry: the oldest goes first (never ``keep``, about to be written)."""
    while len(table) >= MAX_ADAPTERS and keep not in table:
        table.pop(next(iter(table)))
