"""When a failed watch request is tried again: one retry policy for the node watch and the budget's.

Why: on a fleet every agent's watch fails at the same moment (an API server restart, a load
balancer cut, a burst the server sheds), so the delays must do two things at once: come back soon
enough that a node does not plan on reads for long, and never bring thousands of agents back in
the same second. The policy is client-go's reflector's (base 0.8 s, cap 30 s) with full jitter:

  - every failure in a row doubles a window, ``min(cap, base * 2**attempt)``, and the delay is
    drawn uniformly in ``[0, window]`` (full jitter: a fleet that failed together spreads over
    the whole window, not over its upper half);
  - a 401 or 403 is a failure like any other, not a verdict: a restarted API server refuses
    every request until its authentication and authorization caches fill (seconds). A
    ClusterRole that really lacks ``watch`` costs one refused request per agent per ~15 s at the
    cap, what client-go's reflector costs it too, and the effects read the node meanwhile;
  - a 429 with ``Retry-After`` (API Priority and Fairness shedding the fleet's flow) is never
    tried before that time; the jitter goes on top of it, so the shed requests do not all
    return together when it is up;
  - a stream that was live and is lost (the server went away or cut it) opens a run of failures
    whose every window is at least ``spread`` wide: thousands of watches cut in the same
    second come back spread over seconds, and their first attempts are not the ones that meet
    a restarted API server while it is still setting itself up.

Everything here is pure: the caller owns the clock, the random source and the waiting.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from healthagent.effects.backend import ApiUnavailable

BASE_SECONDS = 0.8  # client-go's reflector: the first window
CAP_SECONDS = 30.0  # client-go's reflector: the widest window
SPREAD_SECONDS = 10.0  # the narrowest window after a live stream was lost


@dataclass(frozen=True)
class RetryPolicy:
    base: float = BASE_SECONDS
    cap: float = CAP_SECONDS
    spread: float = SPREAD_SECONDS

    def window(self, attempt: int, lost: bool = False) -> float:
        """The widest delay before retry ``attempt`` (0 = the first retry of a run of failures);
        ``lost``: the run began with a live stream lost."""
        width = min(self.cap, self.base * (2 ** min(max(0, attempt), 32)))
        return max(width, min(self.spread, self.cap)) if lost else width

    def delay(self, attempt: int, rng: random.Random, *, lost: bool = False, retry_after: float = 0.0) -> float:
        """Seconds to wait before retry ``attempt``: full jitter over its window, after
        ``retry_after`` (the server's ``Retry-After``) when it gave one."""
        return max(0.0, retry_after) + rng.uniform(0.0, self.window(attempt, lost))


def retry_after(exc: BaseException) -> float:
    """The server's ``Retry-After`` carried by ``exc`` (a 429), 0 when it gave none."""
    return exc.retry_after if isinstance(exc, ApiUnavailable) else 0.0


@dataclass(frozen=True)
class Run:
    """The failures in a row so far, and whether the run began with a live stream lost."""

    failures: int = 0
    lost: bool = False

    def failed(self, *, opened: bool, progressed: bool = False) -> "Run":
        """The run after one more failed attempt. ``opened``: the request was answered and its
        stream open, so a live stream was lost; ``progressed``: that stream lived a while, so the
        failure starts a new run. A stream that carried events but was cut or ended within
        seconds does not: a server shedding its watchers again and again meets ever longer
        delays, not a re-open at once after each event."""
        run = Run() if progressed else self
        return Run(run.failures + 1, run.lost or opened)

    def delay(self, policy: RetryPolicy, rng: random.Random, retry_after: float = 0.0) -> float:
        return policy.delay(self.failures - 1, rng, lost=self.lost, retry_after=retry_after)
