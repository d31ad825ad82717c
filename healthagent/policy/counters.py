"""Cumulative counters over time: growth, windows, resets. Pure arithmetic on the timestamps given.

Every hardware counter the rules read (ECC, NVLink, PCIe replay, EFA hw_counters, IB
PortCounters) is cumulative since a driver load or a reboot. So a decrease is a reset, never a
fault, and a rate is "how much it grew inside a window", computed from the sample timestamps,
never from the wall clock. This is the one place a reset is decided (``CounterSeries.add``): a
value lower than the last is a new baseline, and so is a sum whose parts changed (``basis``: a
part absent from one reading, unreadable or past its width, would otherwise come back as growth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from healthagent.policy.findings import duration_words

MAX_POINTS = 512  # a bound on memory per counter, whatever the sample rate


def finite(value: object) -> bool:
    """A real number that is not NaN or infinite (a bool is not a number here)."""
    kind = type(value)
    if kind is int or kind is float:  # nearly every call: no isinstance walk
        return math.isfinite(value)  # type: ignore[arg-type]
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Growth:
    """What one new sample says: the step from the previous sample (None on the first/after reset)."""

    previous: float | None
    current: float
    seconds: float
    reset: bool = False

    @property
    def increase(self) -> float:
        return 0.0 if self.previous is None else max(0.0, self.current - self.previous)

    @property
    def without_baseline(self) -> float:
        """The value when there is no earlier reading to compare (first sight, or just after a
        reset): for counters that reset with the fault's cure, a non-zero value is news too."""
        return self.current if self.previous is None else 0.0


@dataclass
class CounterSeries:
    """Recent (timestamp, value) points of one cumulative counter."""

    points: list[tuple[float, float]] = field(default_factory=list)
    resets: int = 0
    basis: tuple[str, ...] = ()  # the counters a summed series adds up (() for one counter)

    def add(self, t: float, value: float, horizon: float, basis: tuple[str, ...] | None = None) -> Growth | None:
        """Record a sample; None when it says nothing new (same timestamp, bad numbers). ``basis``
        names the counters ``value`` sums: when it differs from the last sample's, the value is a
        new baseline (a reset), never growth."""
        if not finite(t) or not finite(value) or value < 0:
            return None
        t, value = float(t), float(value)
        if self.points:
            last_t, last_v = self.points[-1]
            if t == last_t:
                return None
            changed = basis is not None and basis != self.basis
            if value < last_v or changed:  # reset (driver reload, GPU reset, reboot) or another sum
                self.points = [(t, value)]
                self.resets += 1
                self.basis = basis if basis is not None else self.basis
                return Growth(previous=None, current=value, seconds=0.0, reset=True)
            if t < last_t:  # the clock stepped back: keep the value as the baseline, restart the times
                self.points = [(t, value)]
                return Growth(previous=last_v, current=value, seconds=0.0)
        if basis is not None:
            self.basis = basis
        previous = self.points[-1] if self.points else None
        self.points.append((t, value))
        self._prune(t, horizon)
        if previous is None:
            return Growth(previous=None, current=value, seconds=0.0)
        return Growth(previous=previous[1], current=value, seconds=t - previous[0])

    def _prune(self, now: float, horizon: float) -> None:
        """Keep the points inside the horizon plus the one just before it (the window's baseline)."""
        points = self.points
        if len(points) <= MAX_POINTS and (len(points) < 2 or points[1][0] > now - horizon):
            return  # the usual case: only the baseline is at or before the horizon
        cut = 0
        for i, (t, _) in enumerate(self.points):
            if t <= now - horizon:
                cut = i
            else:
                break
        if cut:
            del self.points[:cut]
        if len(self.points) > MAX_POINTS:
            del self.points[: len(self.points) - MAX_POINTS]

    def increase_over(self, now: float, window: float) -> tuple[float, float]:
        """(increase, seconds covered) over the last ``window`` seconds before ``now``.

        The baseline is the latest point at or before the window's start, or the oldest point when
        the history is shorter than the window (then less is covered: no extrapolation).
        """
        if len(self.points) < 2:
            return 0.0, 0.0
        start = now - window
        base = self.points[0]
        for point in self.points:
            if point[0] <= start:
                base = point
            else:
                break
        last = self.points[-1]
        return max(0.0, last[1] - base[1]), max(0.0, last[0] - base[0])

    def increase_between(self, start: float, end: float) -> float:
        """Increase from ``start`` to ``end`` as far as the points cover it (a history that begins
        inside the span counts from its first point)."""
        inside = [p for p in self.points if p[0] <= end]
        if not inside:
            return 0.0
        before_start = [p for p in inside if p[0] <= start]
        base = before_start[-1] if before_start else inside[0]
        return max(0.0, inside[-1][1] - base[1])

    def to_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "resets": self.resets,
                **({"basis": list(self.basis)} if self.basis else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "CounterSeries":
        points = [(float(t), float(v)) for t, v in d.get("points", [])][-MAX_POINTS:]
        basis = d.get("basis")
        basis = tuple(str(name) for name in basis[:16]) if isinstance(basis, list) else ()
        return cls(points=sorted(points), resets=int(d.get("resets", 0)), basis=basis)


def over_limit(increase: float, covered: float, window: float, per_minute: float) -> bool:
    """True when ``increase`` exceeds ``per_minute`` scaled to what was covered.

    A window shorter than a minute still allows ``per_minute`` (AWS's "bursts of 100 per minute");
    samples further apart than the window allow proportionally more.
    """
    allowed = per_minute * max(covered, window, 60.0) / 60.0
    return increase > allowed


@dataclass(frozen=True)
class RatePart:
    """One counter checked against a per-minute limit (``series`` names its history)."""

    series: str
    value: float | None
    per_minute: float
    label: str


def rate_over(series: CounterSeries, t: float, value: float, window: float,
              per_minute: float, basis: tuple[str, ...] | None = None) -> tuple[float, float] | None:
    """Record ``value`` at ``t`` in ``series``; (increase, seconds covered) when the counter grew
    faster than ``per_minute`` over the last ``window``, else None (also when the sample says
    nothing new). The one rate test every rule uses; callers pass a finite ``value`` (and, for a
    sum, the counters it adds up: ``CounterSeries.add``)."""
    if series.add(t, value, window, basis) is None:
        return None
    increase, covered = series.increase_over(t, window)
    if over_limit(increase, covered, window, per_minute):
        return increase, covered
    return None


def rates_over(history: Callable[[str], CounterSeries], t: float, window: float,
               parts: Iterable[RatePart]) -> list[tuple[float, str]]:
    """(increase, evidence) for every part whose counter grew faster than its limit.

    ``history(name)`` returns the part's CounterSeries; None values (not supported) are skipped.
    """
    over = []
    for part in parts:
        if part.value is None or not finite(part.value):
            continue
        found = rate_over(history(part.series), t, part.value, window, part.per_minute)
        if found is not None:
            increase, covered = found
            over.append((increase, f"{part.label} +{increase:.0f} in {duration_words(covered)} "
                                   f"(limit {part.per_minute:g}/min)"))
    return over


def optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


@dataclass
class SeriesTrack:
    """The counter histories of one device (a GPU, an EFA port) and its last sample's time."""

    last_sample: float | None = None
    series: dict[str, CounterSeries] = field(default_factory=dict)

    def counter(self, name: str) -> CounterSeries:
        series = self.series.get(name)
        if series is None:  # not setdefault: that would build a new CounterSeries on every call
            series = self.series[name] = CounterSeries()
        return series

    def new_sample(self, timestamp: float, now: float) -> float | None:
        """The sample's time (the collection's when it has none), or None when this sample was
        already judged: the loop re-runs policy for kernel-log events with the same counter
        samples, and those must not count as new evaluations."""
        t = float(timestamp) if finite(timestamp) and timestamp > 0 else now
        if self.last_sample == t:
            return None
        self.last_sample = t
        return t

    def to_dict(self) -> dict:
        return {"last_sample": self.last_sample, "series": {k: s.to_dict() for k, s in self.series.items()}}

    @classmethod
    def base_fields(cls, d: dict, names: Iterable[str]) -> dict:
        allowed = set(names)
        return {"last_sample": optional_float(d.get("last_sample")),
                "series": {str(k): CounterSeries.from_dict(v) for k, v in d.get("series", {}).items()
                           if k in allowed}}
