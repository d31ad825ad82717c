"""A periodic source whose ``collect`` blocks until the test lets it go, as a wedged driver call
blocks: real blocking code (an Event), used to show what the loop and ``DeadlineSource`` do."""

from __future__ import annotations

import threading

from healthagent.model import SourceHealth
from healthagent.common import ErrorTally
from healthagent.sources.base import SourceResult

LONG = 60.0  # a bound on a hang, never a measurement


class GatedSource:
    """A source whose ``collect`` blocks until ``gate`` is set (set = answers at once)."""

    name = "gated"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0
        self.tally = ErrorTally(self.name)
        self.closed = threading.Event()
        self.raise_next: Exception | None = None

    def collect(self, now: float) -> SourceResult:
        self.calls += 1
        if not self.gate.wait(LONG):
            raise AssertionError("the test never released the gate")
        if self.raise_next is not None:
            exc, self.raise_next = self.raise_next, None
            raise exc
        self.tally.count("parse", "one garbage line")
        return SourceResult(health=SourceHealth(source=self.name, up=True, detail=f"call {self.calls}",
                                                errors=self.tally.snapshot()))

    def take_events(self) -> list[str]:
        return ["event"]

    def close(self) -> None:
        self.closed.set()
