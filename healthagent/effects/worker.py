"""The effects worker: the thread that brings Kubernetes to the loop's newest verdict.

Why a thread of its own: an API server that is slow (10 s a request) or down must never delay
detection or the exporter, so the loop only hands the verdict over (``submit``) and goes on. The
worker always works on the newest verdict (coalescing): a burst of forty XIDs costs one reconcile,
not forty. It also reconciles every ``retry_seconds`` anyway, which retries writes queued during an
outage; at the moment the effects name as due (``KubeStatus.due_at``: a grace's end, when a
replace_node taint moves from NoSchedule to NoExecute, or a held node's next look at the budget),
so a timed step is taken on time, not up to a retry later; and at once when a watch of the
effects sees an operator (or another controller) change what the effects own, or a budget slot
free (``wake``), so a clear applies now, not on the next retry.

What it drives is ``effects.kube.NodeEffects`` (the ``Effects`` protocol below); the wiring
(``healthagent/wiring.py``) builds both and connects the watch's ``on_change`` to ``wake``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Mapping, Protocol

from healthagent.model import KubeStatus, SourceHealth, Verdict

log = logging.getLogger(__name__)

DEFAULT_RETRY_SECONDS = 5.0


class EventOutbox(Protocol):
    """The Events queue of the effects: how many a full outbox had to drop (cumulative)."""

    @property
    def dropped(self) -> int: ...


class Effects(Protocol):
    """What the worker drives; ``NodeEffects`` is the one implementation."""

    @property
    def mode(self) -> str: ...

    @property
    def ledger(self) -> EventOutbox: ...

    @property
    def errors(self) -> Mapping[str, int]: ...

    def startup(self, now: float, boot_id: str, wall: float | None = None) -> KubeStatus: ...

    def reconcile(self, verdict: Verdict, now: float, boot_id: str,
                  health: tuple[SourceHealth, ...] = (), wall: float | None = None) -> KubeStatus: ...

    def close(self) -> None: ...


def verdict_signature(verdict: Verdict) -> tuple:
    """What a reconcile depends on: a verdict with the same signature needs no early wake-up."""
    return (verdict.action, verdict.unobserved,
            tuple((f.key, f.action, f.count) for f in verdict.findings))


class EffectsWorker:
    """Runs ``Effects.startup`` once, then ``Effects.reconcile`` with the newest verdict.

    Reconciles when the verdict changes, when ``wake`` is called, and every ``retry_seconds``
    anyway. ``stop`` lets the write in flight finish (the SIGTERM contract), then closes the
    effects (their node watch). ``status`` is the effects' last report, read by the loop.
    """

    def __init__(self, effects: Effects, boot_id: str, clock: Callable[[], float],
                 retry_seconds: float = DEFAULT_RETRY_SECONDS, wall: Callable[[], float] = time.time,
                 on_status: Callable[[], None] | None = None) -> None:
        """``clock``: the decision clock (``clock.py``: it never jumps); ``wall``: wall time, for
        what the effects write for people and the API server. ``on_status`` is called (from the
        worker's thread; it must only wake its caller) when the effects' status changed, so the
        loop publishes it at once rather than on its next idle cycle."""
        self._effects = effects
        self._boot_id = boot_id
        self._clock = clock
        self._wall = wall
        self.on_status = on_status
        # Read before every wait, so a caller may change it before ``start`` (or between waits).
        self.retry_seconds = retry_seconds
        self._verdict: Verdict | None = None
        self._health: tuple[SourceHealth, ...] = ()
        self._changed = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="healthagent-effects", daemon=True)
        # Replaced whole (never mutated) by the worker thread; the loop reads it any time.
        self.status = KubeStatus(mode=effects.mode)
        self.reconciles = 0
        self._reconciled_at: float | None = None  # the decision time of the last startup or reconcile
        self.failures: Counter[str] = Counter()  # exceptions that escaped the effects, by step

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Reconcile now rather than at the next retry (the node watch saw a change)."""
        self._changed.set()

    def submit(self, verdict: Verdict, health: tuple[SourceHealth, ...] = ()) -> None:
        """Hand over the newest verdict (and the sources' health, whose detail explains an
        ``Unknown`` condition); wakes the worker only when the verdict means something new."""
        with self._lock:
            changed = self._verdict is None or verdict_signature(self._verdict) != verdict_signature(verdict)
            self._verdict = verdict
            self._health = tuple(health)
        if changed:
            self._changed.set()

    def _run(self) -> None:
        try:
            self._reconciled_at = self._clock()
            self._set_status(self._effects.startup(self._reconciled_at, self._boot_id, wall=self._wall()))
        except Exception:  # the worker must survive anything the API or a bug throws
            self.failures["startup_raised"] += 1
            log.exception("effects startup failed; will retry on the next reconcile")
        while not self._stopping.is_set():
            self._changed.wait(self._until_next())
            self._changed.clear()
            with self._lock:
                verdict, health = self._verdict, self._health
            if verdict is None:
                continue
            try:
                self._reconciled_at = self._clock()
                self._set_status(self._effects.reconcile(verdict, self._reconciled_at, self._boot_id, health=health,
                                                         wall=self._wall()))
                self.reconciles += 1
            except Exception:
                self.failures["reconcile_raised"] += 1
                log.exception("effects reconcile failed; desired state kept, retrying")

    def _until_next(self) -> float:
        """Seconds to wait for the next reconcile: the retry interval, or less when the effects'
        last status names a step due before it (at once when it came during that reconcile). A
        due time the last reconcile had reached already is ignored: it did not take the step
        (the node is held), and waiting for it again would be a busy loop."""
        due = self.status.due_at
        if due is None or self._reconciled_at is None or due <= self._reconciled_at:
            return self.retry_seconds
        return min(self.retry_seconds, max(0.0, due - self._clock()))

    def _set_status(self, status: KubeStatus) -> None:
        changed = status != self.status
        self.status = status
        callback = self.on_status
        if changed and callback is not None:
            try:
                callback()
            except Exception:  # a waker that fails must not stop the effects
                self.failures["on_status_raised"] += 1
                log.exception("effects status callback failed")

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self._changed.set()
        if self._thread.ident is not None:  # started (an agent built but never run has nothing to join)
            self._thread.join(timeout)
        self._effects.close()  # ends the node watch thread and its open request

    def errors(self) -> dict[str, int]:
        """Cumulative failures of the effects side by kind: the effects' own tally (API refusals,
        conflicts given up, budget counts that failed, internal errors, watch problems), Events
        dropped from a full outbox, and exceptions that escaped to this worker."""
        counts = dict(self._effects.errors)
        counts["events_dropped"] = self._effects.ledger.dropped
        counts.update(self.failures)
        return counts
