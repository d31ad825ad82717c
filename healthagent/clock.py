"""The agent's two clocks: one that never jumps for every duration, the wall clock for people.

Durations that lead to a node action (the NoExecute grace, sustain timers, finding expiry, a
budget slot's staleness, back-offs) must not move when NTP or an operator steps the wall clock:
a +1 h step would end a 60 s grace at once, and the job's pods would be evicted with no time to
checkpoint. So the agent decides on ``DecisionClock``: ``epoch + CLOCK_MONOTONIC``. The epoch is
the wall time at which the monotonic clock read zero (the boot), taken once per boot and kept in
the state file with the boot id, so a restart within the same boot continues the same clock
(durations survive the restart) and a new boot starts it afresh. Its values read like wall time
(they equal it until the wall clock is stepped), which keeps logs, evidence and the state file
readable, but it only ever advances with the kernel's monotonic clock.

``/dev/kmsg`` records carry the same monotonic microseconds (``epoch + usec``), and NVML's
events are stamped with the same clock when they arrive, so one XID reported by both pairs up
whatever the wall clock did. CLOCK_MONOTONIC, not CLOCK_BOOTTIME, because the kernel log's
stamps do not count time suspended either (a GPU node does not suspend; the two agree there).

Wall time (``time.time``) is only for what people and the API server read: a taint's
``timeAdded``, a condition's ``lastTransitionTime``, an Event's time, a Lease's ``renewTime``, the
exporter's last-collection timestamp.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

STATE_KEY = "clock"  # {"boot_id": ..., "epoch": ...}: the decision clock of this boot


@dataclass(frozen=True)
class DecisionClock:
    """``epoch + monotonic()``: a clock that reads like wall time and never jumps."""

    epoch: float
    monotonic: Callable[[], float] = time.monotonic

    def __call__(self) -> float:
        return self.epoch + self.monotonic()


def fresh_epoch(wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> float:
    """The wall time at which the monotonic clock read zero, as the wall clock says now."""
    return wall() - monotonic()


def restore_epoch(saved: Any, boot_id: str, fallback: float) -> float:
    """The saved epoch when it belongs to this boot (the same ``boot_id``), else ``fallback``.

    A restart in the same boot keeps the clock the previous run decided on, so a grace or a
    sustain timer it started is measured on, not restarted or shortened by a wall-clock step
    between the two runs. Without a boot id a continuation cannot be proven: a fresh epoch."""
    if boot_id and isinstance(saved, dict) and saved.get("boot_id") == boot_id:
        epoch = saved.get("epoch")
        if isinstance(epoch, (int, float)) and not isinstance(epoch, bool) and math.isfinite(epoch) and epoch > 0:
            return float(epoch)
        log.warning("state: the saved clock epoch %r is not a time; starting a fresh one", epoch)
    return fallback


def saved_epoch(boot_id: str, epoch: float) -> dict:
    """What the state file keeps of the clock."""
    return {"boot_id": boot_id, "epoch": epoch}
