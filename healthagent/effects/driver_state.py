"""The effects' whole state as one frozen value: the record, the Event ledger, the budget's slot knowledge.

``NodeEffects`` (``effects/kube.py``) keeps one ``DriverState`` and replaces it whole once per
reconcile (and once per ``startup``); everything else it holds is wiring (settings, the backend,
the clocks' callers, the watches). A reconcile is then a function from the state before to the
state after, with its requests at the edges, and a reconcile that fails on a bug leaves the state
it started from (marked to read the node again).

What is saved (``effects/state.py``) is the record and the ledger; the rest is what this run
learnt and is found again after a restart: the node is read, the budget's Leases are listed.
"""

from __future__ import annotations

from dataclasses import dataclass

from healthagent.effects.budget_guard import GuardState
from healthagent.effects.events import EventLedger
from healthagent.effects.record import EffectsState
from healthagent.model import SourceHealth, Verdict


@dataclass(frozen=True)
class DriverState:
    """Everything the effects know, as one value."""

    record: EffectsState  # what the node cannot tell (``effects/record.py``)
    ledger: EventLedger  # the Events delivered and queued
    budget: GuardState  # the slot held, the looks' timing, what the judge saw (``effects/budget_guard.py``)
    verdict: Verdict | None = None  # the verdict of the last reconcile
    health: tuple[SourceHealth, ...] = ()  # the sources' health with it
    dirty: bool = True  # read the node before the next step (nothing read yet, a write failed)
    pending: int = 0  # node writes the desired state still needs (``KubeStatus.pending_writes``)
    reachable: bool = False  # the API server answered the last request
    last_read: float | None = None  # when the node was last read (or known as fresh as a read)
    conflicts: int = 0  # node writes refused by a conflict in a row (their back-off)
