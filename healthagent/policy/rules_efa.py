"""EFA rules from the driver's hw_counters and the device list.

Facts they rest on (the EFA driver's source, amzn-drivers efa_verbs.c, and AWS docs):
- the driver hard-codes port ``state`` to ACTIVE and ``phys_state`` to LinkUp, so there is no
  port-down rule: a device that vanished, or fewer devices than the instance has, is the signal
  (EFA_DEVICE_MISSING, in inventory.py);
- ``no_completion_cmds`` rising means the driver stopped its admin queue: a reboot candidate;
- the error counters are judged by rate, with AWS's EKS node monitoring agent's tolerance of 100
  a minute as the default; ``unresponsive_remote_events`` and ``impaired_remote_conn_events``
  point at the *remote* peer;
- counters are cumulative since launch or driver reload: a decrease is a reset (a new baseline,
  never a finding, ``counters.CounterSeries``); a counter the driver does not expose is absent,
  never a finding;
- the counters are u64: the histories that decide are floats (a rate needs no more), but the
  evidence an operator reads is exact integers, kept beside them (a value near 2**64 has no exact
  float: ``2**64 - 1`` would read ``18446744073709551616``).

Every reading of a counter is reported, over its limit or not (``bad`` False): when a finding
opens is its code's rule (``debounce.py``), which may count readings in a row or a sustain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from healthagent.model import EfaSample
from healthagent.policy.book import EVENT, Signal, Where
from healthagent.policy.counters import SeriesTrack, finite, rate_over
from healthagent.policy.findings import FINDINGS, duration_words, steps_for
from healthagent.policy.settings import Policy

ADMIN_QUEUE = "no_completion_cmds"

# code, counters summed, threshold name
RATE_RULES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("EFA_UNRESPONSIVE_REMOTE", ("unresponsive_remote_events",), "efa_unresponsive_remote_per_minute"),
    ("EFA_IMPAIRED_REMOTE", ("impaired_remote_conn_events",), "efa_impaired_remote_per_minute"),
    ("EFA_RETRANS_TIMEOUT", ("retrans_timeout_events",), "efa_retrans_timeout_per_minute"),
    ("EFA_CMD_ERRORS", ("cmds_err",), "efa_cmds_err_per_minute"),
    ("EFA_RX_DROPS", ("rx_drops",), "efa_rx_drops_per_minute"),
    ("EFA_WR_ERRORS", ("rdma_read_wr_err", "rdma_write_wr_err"), "efa_wr_err_per_minute"),
)
SERIES = (ADMIN_QUEUE,) + tuple(code for code, _, _ in RATE_RULES)
# The finding codes this module's rules produce (each has its row in findings.csv; a test checks both ways).
PRODUCES = ("EFA_ADMIN_QUEUE_STUCK",) + tuple(code for code, _, _ in RATE_RULES)


def efa_key(sample: EfaSample) -> str:
    return f"{sample.device}:{sample.port}"


@dataclass
class EfaTrack(SeriesTrack):
    # The exact integer of each series' samples by sample time, for the evidence (module docstring);
    # pruned with the float history, so it holds the same points.
    exact: dict[str, dict[float, int]] = field(default_factory=dict)

    def note_exact(self, series: str, t: float, value: int) -> None:
        """Keep ``value`` at ``t`` and drop what the float history dropped. The history drops from
        its front (the window moved on), so this costs a step or two per call, not a pass over
        the points (32 devices x 7 series every collection); when it was cut otherwise (a reset,
        the clock stepped back) the points are matched to it whole."""
        points = self.exact.setdefault(series, {})
        points[t] = value
        history = self.counter(series).points
        oldest = history[0][0] if history else t
        while points and (first := next(iter(points))) < oldest:
            del points[first]
        if len(points) > len(history):
            kept = {p for p, _ in history}
            for old in [p for p in points if p not in kept]:
                del points[old]

    def exact_at(self, series: str, t: float) -> int | None:
        """The exact value of the sample nearest ``t`` (times are the same floats, give or take
        the rounding of a subtraction)."""
        points = self.exact.get(series)
        if not points:
            return None
        value = points.get(t)
        if value is not None:
            return value
        return points[min(points, key=lambda p: abs(p - t))]

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(),
                "exact": {k: [[t, v] for t, v in points.items()] for k, points in self.exact.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EfaTrack":
        exact = {str(k): {float(t): int(v) for t, v in points} for k, points in d.get("exact", {}).items()
                 if k in SERIES}
        return cls(**cls.base_fields(d, SERIES), exact=exact)


def _present(counters: dict[str, Any], names: tuple[str, ...]) -> tuple[str, ...]:
    """The named counters the sample has as finite numbers (a driver may expose some of them, and a
    reading may lack one it could not read)."""
    return tuple(n for n in names if (v := counters.get(n)) is not None and finite(v))


def _total(counters: dict[str, Any], names: tuple[str, ...]) -> int | None:
    """The sum of the named counters the sample has, or None when it has none of them."""
    present = _present(counters, names)
    return sum(int(counters[n]) for n in present) if present else None


def _signal(code: str, device: str, evidence: str, quiet: float, count: int) -> Signal:
    info = FINDINGS[code]
    return Signal(code=code, where=Where(fabric_device=device), bad=True, kind=EVENT, action=info.action,
                  summary=f"EFA {device}: {info.title}", evidence=evidence,
                  next_steps=steps_for(code, device=device), quiet_seconds=quiet, count=max(1, count))


def _absent(code: str, device: str) -> Signal:
    """A reading without the code's signal (ends a run its rule counts; sent only for a rule
    that counts, ``Rules.counts``)."""
    return Signal(code=code, where=Where(fabric_device=device), bad=False, kind=EVENT)


class EfaRules:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def evaluate(self, sample: EfaSample, track: EfaTrack, now: float) -> Iterator[Signal]:
        t = track.new_sample(sample.timestamp, now)
        if t is None:
            return
        # Only the counters the rules read are looked at: a port has ~40, the rules use eight, and
        # this runs for every port on every collection.
        counters = sample.counters or {}
        yield from self._admin_queue(sample.device, counters, track, t)
        window = self.policy.rate_window_seconds
        thresholds = self.policy.thresholds
        for code, names, threshold in RATE_RULES:
            total = _total(counters, names)
            if total is None:
                continue
            per_minute = thresholds[threshold]
            over = rate_over(track.counter(code), t, float(total), window, per_minute, _present(counters, names))
            track.note_exact(code, t, total)
            if over is not None:
                rough, covered = over
                base = track.exact_at(code, t - covered)
                increase = total - base if base is not None and base <= total else int(rough)
                evidence = (f"{'+'.join(names)} +{increase} in {duration_words(covered)} "
                            f"(limit {per_minute:g}/min)")
                yield _signal(code, sample.device, evidence, self.policy.counter_quiet_seconds, increase)
            elif self.policy.rules.counts(code):
                yield _absent(code, sample.device)

    def _admin_queue(self, device: str, counters: dict[str, Any], track: EfaTrack, t: float) -> Iterator[Signal]:
        """Any rise of no_completion_cmds (a non-zero count on first sight too: the queue has
        already been stopped since the driver loaded; after a decrease, a reset, the count is
        only the new baseline). reboot_node: stays until the reboot."""
        current = _total(counters, (ADMIN_QUEUE,))
        if current is None:
            return
        previous = track.exact_at(ADMIN_QUEUE, track.counter(ADMIN_QUEUE).points[-1][0]) \
            if track.counter(ADMIN_QUEUE).points else None
        growth = track.counter(ADMIN_QUEUE).add(t, current, self.policy.rate_window_seconds)
        if growth is None:
            return
        track.note_exact(ADMIN_QUEUE, t, current)
        if growth.increase > 0:
            evidence = f"{ADMIN_QUEUE} {previous if previous is not None else int(growth.previous or 0)} -> {current}"
        elif growth.without_baseline > 0 and not growth.reset:  # after a reset: the new baseline
            evidence = f"{ADMIN_QUEUE} is {current} (since the driver loaded)"
        else:
            if self.policy.rules.counts("EFA_ADMIN_QUEUE_STUCK"):
                yield _absent("EFA_ADMIN_QUEUE_STUCK", device)
            return
        yield _signal("EFA_ADMIN_QUEUE_STUCK", device, evidence, self.policy.counter_quiet_seconds, 1)
