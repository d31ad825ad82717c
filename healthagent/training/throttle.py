"""Failed credentials are rate limited per client address.

Why: every job token is derived from the cluster's training key, and the intake answers a wrong
credential at once. Unthrottled, one client could try thousands of credentials a second. Each
address gets a bucket of ``burst`` failures that refills at ``per_second``; an address whose
bucket is empty is answered 429 (with Retry-After) without its credential being looked at, and
counted (``rate_limited``), until the bucket refills. A valid credential costs nothing, so a job
whose token is right is never slowed by a neighbour's mistakes on another address. At most
``max_clients`` addresses are remembered (the fullest buckets are forgotten first: they hold
nothing back).
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class FailureThrottle:
    """Per-address token buckets for failed credentials; thread-safe (one HTTP thread a request)."""

    def __init__(self, burst: int = 10, per_second: float = 1.0, max_clients: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or per_second <= 0 or max_clients < 1:
            raise ValueError("throttle: burst and max_clients must be at least 1, per_second above 0")
        self.burst, self.per_second, self.max_clients = float(burst), float(per_second), max_clients
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)

    def _level(self, address: str, now: float) -> float:
        tokens, at = self._buckets.get(address, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.per_second)

    def retry_after(self, address: str) -> float:
        """0 when ``address`` may try a credential now, else the seconds until it may."""
        with self._lock:
            level = self._level(address, self._clock())
        return 0.0 if level >= 1.0 else (1.0 - level) / self.per_second

    def failed(self, address: str) -> None:
        """``address`` presented a credential that opened nothing: one token less."""
        with self._lock:
            now = self._clock()
            self._buckets[address] = (max(0.0, self._level(address, now) - 1.0), now)
            if len(self._buckets) > self.max_clients:
                fullest = max(self._buckets, key=lambda a: self._level(a, now))
                del self._buckets[fullest]

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._buckets)
