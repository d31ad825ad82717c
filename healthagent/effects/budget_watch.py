"""A held node's ear on the budget: one watch on its budget's slot Leases while the budget holds it.

Why: a held node waits for one thing, a slot under the limit coming free (a holder giving its
slot back, or its Lease deleted). Its timed looks (every 15-45 s, stretching while it stays held)
would take that slot 15 s to minutes late; the watch tells it within the time a watch event
takes, and the effects look at once (``BudgetGuard.ask``). The timed looks go on beside it: they
are what judges a stale holder, and they cover a watch that is down.

The watch runs only while the node is held (``follow`` when held, ``stop`` when it holds a slot or
needs none): a fleet in a steady state keeps no such watch open. Each request asks for the
current state (``resourceVersion=0``: every Lease first as an ADDED event from the API server's
watch cache, then each change), so a slot freed between the look that held the node and the
watch's start is seen too, and there is no resume version to lose (no 410 Gone to handle). The
server ends a request after ``timeoutSeconds`` (drawn in 5-10 min, so a fleet does not re-watch
in step); the next one follows at once. A refused, cut or hung request, a 429, a 401 or 403 (a
restarted API server refuses everyone until its caches fill) and a stream the server ended before
its time are tried again after the node watch's delays (``effects/watch_retry.py``: capped
exponential with full jitter, never before a 429's ``Retry-After``, spread over seconds after a
live stream was lost). A line that is not a watch event is counted and the stream opened again.
The kinds counted are the node watch's (``watch_unavailable``, ``watch_rejected_<status>``,
``watch_bad_event``, ``watch_internal``), and the log line names the budget's watch.

What it reports is only "a slot of this budget is free now" (``freed``) and a wake-up
(``on_freed``: the effects worker's ``wake``). Whether that slot may be taken is the guard's to
judge, from its own list, as for any look: the watch trusts no Lease.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, Callable

from healthagent.common import ErrorTally
from healthagent.effects.budget import Scope, slot_index
from healthagent.effects.node_watch import (
    BACKOFF_SECONDS,
    HEALTHY_STREAM_SECONDS,
    STOP_JOIN_SECONDS,
    WATCH_TIMEOUT_SECONDS,
    BadEvent,
    end_watch,
    ran_full_term,
    read_events,
    status_error,
    watch_failure,
)
from healthagent.effects.watch_retry import SPREAD_SECONDS, RetryPolicy, Run

log = logging.getLogger(__name__)


class SlotWatch:
    """The watch thread on one budget's slot Leases (see the module docstring)."""

    def __init__(self, store: Any, *, node_name: str, tally: ErrorTally, rng: random.Random,
                 on_freed: Callable[[], None] | None = None,
                 timeout_seconds: tuple[int, int] = WATCH_TIMEOUT_SECONDS,
                 backoff: tuple[float, float] = BACKOFF_SECONDS,
                 spread_seconds: float = SPREAD_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 pause: Callable[[threading.Event, float], object] | None = None) -> None:
        """``store``: the ``LeaseStore`` (its ``watch``; None in dry-run: never watches);
        ``on_freed`` is called from the watch thread when a slot frees and must only wake the
        caller. ``backoff`` (base, cap) and ``spread_seconds``: the retry policy
        (``watch_retry``); ``pause(stopping, seconds)`` waits out a retry delay; ``clock`` times
        how long a stream lived."""
        self._store = store
        self._node = node_name
        self._tally = tally
        self._rng = rng
        self._on_freed = on_freed
        self._timeouts = (max(1, int(timeout_seconds[0])), max(1, int(timeout_seconds[1])))
        self._policy = RetryPolicy(backoff[0], backoff[1], spread_seconds)
        self._clock = clock
        self._pause = pause or (lambda stopping, seconds: stopping.wait(seconds))
        self._opened = False  # the current request was answered: its stream is open
        self._progressed = False  # ... and it lived a while
        self.freed = threading.Event()  # a slot of the budget was seen free: look now
        self._scope = Scope()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._stream: Any = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def follow(self, scope: Scope) -> None:
        """Watch ``scope``'s slots from now on (a no-op while already watching them)."""
        if self._store is None or (self.running and scope == self._scope):
            return
        self.stop()
        self._scope = scope
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stopping,), name="healthagent-slot-watch",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = STOP_JOIN_SECONDS) -> None:
        """End the watch (the node holds a slot, needs none, or the agent stops), waiting at most
        ``timeout`` for the thread (0 on the effects' path: a read that no interrupt reaches ends
        with its request, and the thread with it)."""
        thread = self._thread
        if thread is None:
            return
        end_watch(self._stopping, self._lock, lambda: self._stream, thread, timeout)
        self._thread = None
        self.freed.clear()

    def take_freed(self) -> bool:
        """Was a slot seen free since the last call?"""
        freed = self.freed.is_set()
        self.freed.clear()
        return freed

    # -- the thread --------------------------------------------------------------------------------

    def _run(self, stopping: threading.Event) -> None:
        run = Run()
        while not stopping.is_set():
            self._opened = self._progressed = False
            try:
                full_term = self._follow(stopping)
            except Exception as exc:  # noqa: BLE001 - every failure is classified in _failed
                if stopping.is_set():
                    return
                run = run.failed(opened=self._opened, progressed=self._progressed)
                delay = self._failed(exc, run)
            else:
                if full_term:
                    continue
                run = run.failed(opened=True, progressed=self._progressed)  # the server ended it early
                delay = run.delay(self._policy, self._rng)
                self._tally.count("watch_unavailable", f"node={self._node} the server ended the watch on the "
                                                       f"budget's Leases before its time; again in {delay:.1f} s")
            if not stopping.is_set():
                self._pause(stopping, delay)

    def _follow(self, stopping: threading.Event) -> bool:
        """One watch request, read until the server ends it. True if it ran its full term (or
        the watch was stopped); ``_progressed``: it lived a while."""
        timeout = self._rng.randint(*self._timeouts)
        stream = self._store.watch(self._scope.lease_selector, timeout)
        self._opened = True
        with self._lock:
            self._stream = stream
        opened = self._clock()
        try:
            if not stopping.is_set():
                read_events(stream, stopping, self._handle)
        finally:
            with self._lock:
                self._stream = None
            stream.close()
            lived = self._clock() - opened
            self._progressed = lived >= HEALTHY_STREAM_SECONDS
        return stopping.is_set() or ran_full_term(lived, timeout)

    def _handle(self, kind: str, lease: dict) -> None:
        if kind == "ERROR":  # the object is a Status
            raise status_error(lease)
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise BadEvent(f"unknown watch event type {kind!r}")
        name = str(lease["metadata"].get("name") or "") if kind != "BOOKMARK" else ""
        if not name or slot_index(name, self._scope) is None:
            return
        spec = lease.get("spec")
        holder = spec.get("holderIdentity") if isinstance(spec, dict) else None
        if kind == "DELETED" or not holder:
            log.debug("effects node=%s budget=slot_freed slot=%s: looking again", self._node, name)
            self.freed.set()
            self._wake()

    def _failed(self, exc: Exception, run: Run) -> float:
        """Count and log a failed request; how long to wait before the next one."""
        node = f"node={self._node}"
        kind, delay = watch_failure(exc, run, self._policy, self._rng, relist=False)
        if kind == "bad_event":
            self._tally.count("watch_bad_event", f"{node} {exc}; watching again in {delay:.1f} s")
        elif kind == "unavailable":
            self._tally.count("watch_unavailable", f"{node} watch on the budget's Leases lost ({exc}); again in "
                                                   f"{delay:.1f} s")
        elif kind == "internal":
            self._tally.count("watch_internal", "budget watch step failed (see the traceback)")
            log.error("effects %s budget watch internal error", node, exc_info=exc)
        else:
            self._tally.count(f"watch_{kind}", f"{node} watch on the budget's Leases refused ({exc}); looking on "
                                               f"a timer, watching again in {delay:.1f} s")
        return delay

    def _wake(self) -> None:
        callback = self._on_freed
        if callback is None:
            return
        try:
            callback()
        except Exception:  # the callback is the loop's; its failure must not end the watch
            self._tally.count("watch_callback", "the effects wake-up callback failed (see the traceback)")
            log.exception("effects node=%s budget watch wake-up failed", self._node)
