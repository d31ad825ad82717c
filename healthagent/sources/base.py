"""What every source shares: the protocol the loop drives and the error tally.

A source never raises on bad data. It reads what it can, counts what it could not by kind
(``parse``, ``unreadable``, ``timeout`` ...), logs one line per problem (rate-limited by the
tally so a flood of garbage cannot flood the log), and reports its health with the observations.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from healthagent.model import EfaSample, GpuSample, SourceHealth, XidEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceResult:
    """What one ``collect`` call returns."""

    health: SourceHealth
    gpus: tuple[GpuSample, ...] = ()
    xids: tuple[XidEvent, ...] = ()
    efa: tuple[EfaSample, ...] = ()


class Source(Protocol):
    """A thing the agent reads. ``collect`` is called by the loop; it must not block for long
    (every external read has a timeout) and must not raise."""

    name: str

    def collect(self, now: float) -> SourceResult: ...

    def close(self) -> None: ...


@dataclass
class ErrorTally:
    """Cumulative error counts of one source, by kind, with rate-limited logging.

    Thread-safe because the NVML event thread and the loop both count into the NVML tally.
    """

    source: str
    log_every_seconds: float = 60.0
    counts: Counter = field(default_factory=Counter)
    _last_logged: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, kind: str, message: str, n: int = 1) -> None:
        """Count ``n`` errors of ``kind`` and log the message at most once a minute per kind."""
        now = time.monotonic()
        with self._lock:
            self.counts[kind] += n
            last = self._last_logged.get(kind)
            should_log = last is None or now - last >= self.log_every_seconds
            if should_log:
                self._last_logged[kind] = now
            total = self.counts[kind]
        if should_log:
            log.warning("source=%s error=%s total=%d %s", self.source, kind, total, message)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def host_path(host_root: str, path: str) -> str:
    """Join an absolute host path under the host root (node_exporter's ``--path.rootfs``)."""
    return os.path.join(host_root, path.lstrip("/"))


def read_boot_id(host_root: str) -> str:
    """The host's boot id; it tells a reboot (reboot-class taints clear) from an agent restart."""
    try:
        with open(host_path(host_root, "/proc/sys/kernel/random/boot_id"), encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""
