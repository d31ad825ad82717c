"""The remediation stages by name and a node's history through them: values every layer may carry.

The stage itself is derived from the verdict and the node object (``effects/stage.py``); this
module holds only the vocabulary and the history value, so that the loop's snapshot
(``model.AgentSnapshot``) can carry the history without the model reaching up into the effects.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

HEALTHY, OBSERVING, CORDONED, HELD_BY_BUDGET = "healthy", "observing", "cordoned", "held_by_budget"
DISRUPTING, HANDED_OFF, REBOOTING, CLEARED = "disrupting", "handed_off", "rebooting", "cleared"
STAGES = (HEALTHY, OBSERVING, CORDONED, HELD_BY_BUDGET, DISRUPTING, HANDED_OFF, REBOOTING, CLEARED)
TAINTED_STAGES = frozenset({CORDONED, HELD_BY_BUDGET, DISRUPTING, HANDED_OFF, REBOOTING})
CLEARED_HOLD_SECONDS = 600.0
# Seconds a stay lasted: a minute to a day, the span between a grace and an engine's slowest repair.
DURATION_BUCKETS = (60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0, 86400.0)
# The moves of the pipeline's usual paths: exported at 0 from the start, so that increase() sees
# the first one (a counter series that appears at 1 shows no increase); rarer pairs appear when
# they first happen.
USUAL_MOVES = (
    (HEALTHY, OBSERVING), (HEALTHY, CORDONED), (OBSERVING, HEALTHY), (OBSERVING, CORDONED),
    (CORDONED, HELD_BY_BUDGET), (CORDONED, DISRUPTING), (CORDONED, HANDED_OFF), (CORDONED, CLEARED),
    (HELD_BY_BUDGET, DISRUPTING), (HELD_BY_BUDGET, HANDED_OFF), (DISRUPTING, HANDED_OFF),
    (DISRUPTING, REBOOTING), (DISRUPTING, CLEARED), (HANDED_OFF, CLEARED), (REBOOTING, CLEARED),
    (CLEARED, HEALTHY),
)


@dataclass(frozen=True)
class Durations:
    """Cumulative histogram of finished stays in one stage: counts per ``DURATION_BUCKETS`` upper
    bound (the last is +Inf), their sum and count."""

    buckets: tuple[int, ...] = (0,) * (len(DURATION_BUCKETS) + 1)
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> "Durations":
        at = bisect.bisect_left(DURATION_BUCKETS, seconds)
        counts = tuple(n + (1 if i >= at else 0) for i, n in enumerate(self.buckets))
        return Durations(counts, self.total + seconds, self.count + 1)


@dataclass(frozen=True)
class StageHistory:
    """The current stage (entered on the decision clock and by the wall clock), and the history."""

    stage: str = HEALTHY
    reason: str = ""
    entered: float = 0.0
    entered_wall: float = 0.0
    tainted_since: float | None = None  # decision clock: the episode's first tainted stage
    transitions: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    durations: Mapping[str, Durations] = field(default_factory=lambda: MappingProxyType({}))

    def advance(self, stage: str, reason: str, now: float, wall: float) -> "StageHistory":
        """The history after the node is seen in ``stage`` at ``now`` (decision clock)."""
        if stage == self.stage:
            return self if reason == self.reason else replace(self, reason=reason)
        tainted_since = (self.tainted_since if self.stage in TAINTED_STAGES else now) \
            if stage in TAINTED_STAGES else None
        pair = (self.stage, stage)
        transitions = dict(self.transitions)
        transitions[pair] = transitions.get(pair, 0) + 1
        durations = dict(self.durations)
        durations[self.stage] = durations.get(self.stage, Durations()).observe(max(0.0, now - self.entered))
        return StageHistory(stage, reason, now, wall, tainted_since, MappingProxyType(transitions),
                            MappingProxyType(durations))


def started(now: float, wall: float) -> StageHistory:
    """The history of an agent that just started: healthy since now, until the first look."""
    return StageHistory(entered=now, entered_wall=wall)
