"""The EFA driver's counter list, read from an independent copy taken from the driver's source
(``tests/fixtures/efa/efa-counters.txt``), so tests can check the demo node and the EFA source
against the driver's facts rather than against the code under test."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REFERENCE = Path(__file__).parent.parent / "fixtures" / "efa" / "efa-counters.txt"


@dataclass(frozen=True)
class CounterFact:
    name: str
    scope: str  # "port", "device" or "device AND port"
    relevance: str  # the reference's fault-relevance column, e.g. "volume only", "FAULT-HARD: ..."


def efa_counter_facts() -> dict[str, CounterFact]:
    facts = {}
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, rest = line.split("\t", 1)
        columns = [c.strip() for c in rest.lstrip("# ").split("|")]
        facts[name] = CounterFact(name=name, scope=columns[0], relevance=columns[-1])
    return facts
