"""When a finding may open: one table of per-code rules (data) and the one function that applies them.

A rule says how much of a raw signal it takes before the finding opens:

- ``count``: the signal occurred this many times within ``window`` (``count`` 1: at once). Without
  a window, ``count`` readings in a row (no reading without the signal between them);
- ``sustain``: the signal has been present at every reading for this long;
- ``after_boot_grace``: the signal is ignored for this long after the node's boot.

Every field that is set must hold ("3 within 10 min" and "sustained 5 min" together mean both).
Why data and not code: what is noise differs per fleet and per signal. NVLink links train for
minutes after a boot, so a link-error rule that fires at once took most of a fleet's freshly
rebooted nodes out; a throttle that lasts a few seconds is a job's burst, one that lasts minutes
is a fan. Hard-coded special cases (a sustain timer in one rule, a streak count in another, a list
of XIDs somewhere else) cannot be tuned, cannot be explained by ``healthagent explain`` and differ
in subtle ways; one table applied by one function can, and an operator sets any code's rule in
the policy file (``findings:``) with the same four keys.

Only opening is debounced. A finding already open is refreshed by its signal as before, and it
closes as its kind always did (a quiet period for an event, good readings for a condition, a
reboot or an operator for the node actions): a fault that flaps must not flap the node.

Times are the timestamps policy is handed (the decision clock, which never jumps) and the boot
time is on the same clock; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from healthagent.policy.finding_catalog import catalog_rows
from healthagent.policy.findings import duration_words

FIELDS = ("count", "window", "sustain", "after_boot_grace")

# How a code's raw signal arrives, which decides how often it can occur: once per GPU or EFA
# reading (the sources' intervals), once per new inventory, or as events (an XID is logged at one
# moment; a burst can hold many at once and nothing is read in between).
GPU = "gpu"
EFA = "efa"
RDMA = "rdma"
PCIE = "pcie"
INVENTORY = "inventory"
EVENTS = "events"
READING_WORDS = {GPU: "GPU readings", EFA: "EFA readings", RDMA: "RDMA port readings",
                 PCIE: "PCIe AER readings", INVENTORY: "inventory readings"}


@dataclass(frozen=True)
class Rule:
    """How much of a raw signal opens its finding (module docstring). Seconds throughout."""

    count: int = 1
    window: float | None = None  # None: ``count`` readings in a row
    sustain: float = 0.0
    after_boot_grace: float = 0.0

    @property
    def at_once(self) -> bool:
        """Nothing to remember: the first occurrence opens the finding."""
        return self.count <= 1 and self.sustain <= 0

    def words(self) -> str:
        """``3 within 10 min, not within 15 min of the boot`` or ``at once``."""
        parts = []
        if self.count > 1:
            parts.append(f"{self.count} within {duration_words(self.window)}" if self.window is not None
                         else f"{self.count} readings in a row")
        if self.sustain > 0:
            parts.append(f"present for {duration_words(self.sustain)}")
        if not parts:
            parts.append("at once")
        if self.after_boot_grace > 0:
            parts.append(f"not within {duration_words(self.after_boot_grace)} of the node's boot")
        return ", ".join(parts)


AT_ONCE = Rule()


@dataclass(frozen=True)
class Row:
    """One code in the table: how its signal arrives, whether it is a condition (a state read
    every time, which ``condition_raise_evaluations`` counts), and its built-in rule."""

    reads: str
    condition: bool = False
    rule: Rule = AT_ONCE


# The built-in rules, one row per finding code: the catalog's (findings.csv) reads, kind and debounce
# columns. Why the numbers there are what they are: NVLink links train for minutes after a boot; a
# hardware slowdown of a few seconds is a job's power or heat burst, minutes of it is a fan, the
# airflow or a PSU (sustain 5 min); an InfiniBand link down for half a minute is an outage, not a
# retrain, and after a boot the subnet manager takes a while to bring ports to ACTIVE (sustain 30 s,
# after_boot_grace 5 min); link_downed increments are flaps, five within a minute flapping. A code
# without a row is treated as an event opened at once.
BUILT_IN: Mapping[str, Row] = MappingProxyType({
    row.code: Row(row.reads, condition=row.kind == "condition",
                  rule=Rule(count=row.count, window=row.window, sustain=row.sustain,
                            after_boot_grace=row.after_boot_grace))
    for row in catalog_rows()
})
UNLISTED = Row(EVENTS)


def row(code: str) -> Row:
    return BUILT_IN.get(code, UNLISTED)


# Threshold keys older policy files use for what is now a rule field: each sets that field on
# the codes named, as a ``findings:`` entry would (and an entry for one code wins over it).
ALIASES: Mapping[str, tuple[str, tuple[str, ...]]] = MappingProxyType({
    "condition_raise_evaluations": ("count", tuple(c for c, r in BUILT_IN.items() if r.condition)),
    "throttle_sustain_seconds": ("sustain", ("GPU_THERMAL_THROTTLE", "GPU_POWER_THROTTLE")),
})


def alias_default(key: str) -> float:
    """The value an alias stands for in the built-in table (the same for all its codes)."""
    name, codes = ALIASES[key]
    values = {getattr(BUILT_IN[code].rule, name) for code in codes}
    assert len(values) == 1, f"{key}: the table gives its codes different {name}s"
    return float(values.pop())


# -- the one function ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tally:
    """What a rule remembers about one subject's signal (a GPU's NVLink errors, a device's drops).

    ``hits``: (time, occurrences) still inside the window, newest last, no more than the count
    needs; ``run``: occurrences since the last reading without the signal; ``since``: when that
    run began. The empty tally is not kept.
    """

    hits: tuple[tuple[float, int], ...] = ()
    run: int = 0
    since: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"hits": [list(h) for h in self.hits], "run": self.run, "since": self.since}

    @classmethod
    def from_dict(cls, raw: Any) -> "Tally":
        """As saved; anything else raises (the caller drops the item and counts it)."""
        hits = tuple((float(t), max(1, int(n))) for t, n in raw["hits"])[-MAX_HITS:]
        since = raw["since"]
        return cls(hits=hits, run=max(0, int(raw["run"])), since=None if since is None else float(since))


EMPTY = Tally()
MAX_HITS = 1000  # the largest count a rule may have: a tally holds at most this many hits


def in_grace(rule: Rule, t: float, boot_time: float | None) -> bool:
    """The signal at ``t`` falls inside the rule's grace after the boot (an unknown boot: never)."""
    return boot_time is not None and rule.after_boot_grace > 0 and t < boot_time + rule.after_boot_grace


def step(rule: Rule, tally: Tally, t: float, present: bool, occurrences: int = 1) -> tuple[Tally, bool]:
    """One reading of a raw signal at ``t`` (``present``: the signal was there, ``occurrences``
    times) -> the tally after it and whether its finding may open now.

    Pure and the only place a rule is judged. A reading without the signal ends the run (and
    with it ``sustain`` and a count in a row); hits inside a window stay, because "3 within
    10 min" counts occurrences whatever came between them. A ``t`` before the run's start (a
    clock handed back) starts the run again rather than measuring a negative duration.
    """
    if not present:
        return (Tally(hits=tally.hits) if tally.run or tally.since is not None else tally), False
    occurrences = max(1, occurrences)
    since = tally.since if tally.since is not None and tally.since <= t else t
    run = tally.run + occurrences if tally.since is not None and tally.since <= t else occurrences
    hits: tuple[tuple[float, int], ...] = ()
    if rule.count > 1 and rule.window is not None:
        hits = _trim(tuple(h for h in tally.hits if t - rule.window <= h[0]) + ((t, occurrences),), rule.count)
        counted = sum(n for _, n in hits) >= rule.count
    else:
        counted = run >= rule.count
    sustained = t - since >= rule.sustain
    return Tally(hits=hits, run=run, since=since), counted and sustained


def _trim(hits: tuple[tuple[float, int], ...], count: int) -> tuple[tuple[float, int], ...]:
    """The newest hits that still reach ``count`` (older ones can no longer matter)."""
    total = 0
    for i in range(len(hits) - 1, -1, -1):
        total += hits[i][1]
        if total >= count:
            return hits[i:]
    return hits[-MAX_HITS:]
