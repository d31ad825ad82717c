"""EFA rules from the driver's hw_counters and the device list.

Facts they rest on (shared/reference/efa-counters.md, amzn-drivers efa_verbs.c, AWS docs):
- the driver hard-codes port ``state`` to ACTIVE and ``phys_state`` to LinkUp, so there is no
  port-down rule: a device that vanished, or fewer devices than the instance has, is the signal
  (EFA_DEVICE_MISSING, in inventory.py);
- ``no_completion_cmds`` rising means the driver stopped its admin queue: a reboot candidate;
- the error counters are judged by rate, with AWS's EKS node monitoring agent's tolerance of 100
  a minute as the default; ``unresponsive_remote_events`` and ``impaired_remote_conn_events``
  point at the *remote* peer;
- counters are cumulative since launch or driver reload: a decrease is a reset; a counter the
  driver does not expose is absent, never a finding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from healthagent.model import EfaSample
from healthagent.policy.book import EVENT, Signal, Where
from healthagent.policy.counters import RatePart, SeriesTrack, finite, rates_over
from healthagent.policy.findings import FINDINGS, steps_for
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


def efa_key(sample: EfaSample) -> str:
    return f"{sample.device}:{sample.port}"


@dataclass
class EfaTrack(SeriesTrack):
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EfaTrack":
        return cls(**cls.base_fields(d, SERIES))


def _signal(code: str, device: str, evidence: str, quiet: float, count: int) -> Signal:
    info = FINDINGS[code]
    return Signal(code=code, where=Where(efa_device=device), bad=True, kind=EVENT, action=info.action,
                  summary=f"EFA {device}: {info.title}", evidence=evidence,
                  next_steps=steps_for(code, device=device), quiet_seconds=quiet, count=max(1, count))


class EfaRules:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def evaluate(self, sample: EfaSample, track: EfaTrack, now: float) -> Iterator[Signal]:
        t = track.new_sample(sample.timestamp, now)
        if t is None:
            return
        counters = {k: v for k, v in (sample.counters or {}).items() if finite(v)}
        yield from self._admin_queue(sample.device, counters, track, t)
        for code, names, threshold in RATE_RULES:
            present = [counters[n] for n in names if n in counters]
            part = RatePart(code, float(sum(present)) if present else None, self.policy.thresholds[threshold],
                            "+".join(names))
            over = rates_over(track.counter, t, self.policy.rate_window_seconds, [part])
            if over:
                yield _signal(code, sample.device, over[0][1], self.policy.counter_quiet_seconds, int(over[0][0]))

    def _admin_queue(self, device: str, counters: dict[str, Any], track: EfaTrack, t: float) -> Iterator[Signal]:
        """Any rise of no_completion_cmds (a non-zero count on first sight too: the queue has
        already been stopped since the driver loaded). reboot_node: stays until the reboot."""
        if ADMIN_QUEUE not in counters:
            return
        growth = track.counter(ADMIN_QUEUE).add(t, counters[ADMIN_QUEUE], self.policy.rate_window_seconds)
        if growth is None:
            return
        if growth.increase > 0:
            evidence = f"{ADMIN_QUEUE} {growth.previous:.0f} -> {growth.current:.0f}"
        elif growth.without_baseline > 0:
            evidence = f"{ADMIN_QUEUE} is {growth.current:.0f} (since the driver loaded)"
        else:
            return
        yield _signal("EFA_ADMIN_QUEUE_STUCK", device, evidence, self.policy.counter_quiet_seconds, 1)
