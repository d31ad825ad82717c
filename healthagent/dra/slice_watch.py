"""One watch on the agent's node's ResourceSlices: the device map kept fresh without a poll.

Why a watch: which DRA device is which GPU changes rarely (the driver restarts, a GPU is
replaced, the driver bumps its pool's generation), and a device taint on a stale map may name the
wrong GPU. Re-listing on a timer costs every node a LIST a minute and still leaves the map up to a
minute old; one watch costs one open request and the API server pushes each change at once.

It runs only while the node has a GPU-scope finding to place (``dra/effects.py`` starts it with
the LIST it needs anyway and stops it when the finding is gone), so a healthy fleet holds no
watch at all. The protocol is client-go's reflector's, as ``effects/node_watch.py`` speaks it for
the Node, over ``resource.k8s.io/v1`` ResourceSlices field-selected by ``spec.nodeName``:

  - the caller's LIST gives the slices and the list's resourceVersion; the watch starts there,
    with ``allowWatchBookmarks`` and a server-side ``timeoutSeconds`` drawn in 5-10 min;
  - every event's resourceVersion, a BOOKMARK's included, is where the next watch resumes; the
    server ending the stream at ``timeoutSeconds`` is normal: watch again at once;
  - 410 Gone, or a line that is not a watch event: LIST again, then watch from the new version;
  - a cut, refused or hung connection, a 5xx or 429: resume from the last version after a
    jittered exponential back-off (``jittered_backoff``; 0.8 s doubling to 30 s);
  - another 4xx (RBAC without ``watch``): try again only every ``rejected_retry_seconds``.

Each change to the node's slices calls ``on_change`` (the agent's effects then reconcile against
the new map); the slices are read with ``slices()``, a copy, from any thread.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, Callable

from healthagent.common import ErrorTally
from healthagent.effects.backend import ApiError
from healthagent.effects.node_watch import (BACKOFF_SECONDS, HEALTHY_STREAM_SECONDS, STOP_JOIN_SECONDS,
                                            WATCH_TIMEOUT_SECONDS, BadEvent, end_watch, read_events,
                                            resource_version, status_error, watch_failure)
from healthagent.effects.watch_retry import SPREAD_SECONDS, RetryPolicy, Run

log = logging.getLogger(__name__)


class SliceWatch:
    """The watch thread over one node's ResourceSlices. ``start`` once, ``stop`` once."""

    def __init__(self, api: Any, node_name: str, *, on_change: Callable[[], None], tally: ErrorTally,
                 rng: random.Random | None = None, timeout_seconds: tuple[int, int] = WATCH_TIMEOUT_SECONDS,
                 backoff: tuple[float, float] = BACKOFF_SECONDS, spread_seconds: float = SPREAD_SECONDS) -> None:
        """``api``: ``list_slices() -> (items, version)`` and ``watch_slices(version, timeout)``
        returning a stream with ``lines()``, ``interrupt()`` and ``close()`` (``DraApi``). A failed
        watch is retried as the node's is (``effects/watch_retry.py``)."""
        self._api = api
        self._node = node_name
        self._on_change = on_change
        self._tally = tally
        self._rng = rng or random.Random()
        self._timeouts = timeout_seconds
        self._policy = RetryPolicy(backoff[0], backoff[1], spread_seconds)
        self._lock = threading.Lock()
        self._slices: dict[str, dict] = {}
        self._resume = ""
        self._stopping = threading.Event()
        self._stream: Any = None
        self._thread: threading.Thread | None = None
        self.changes = 0  # slice changes the watch delivered (tests wait on them)

    @property
    def resume_version(self) -> str:
        return self._resume

    def slices(self) -> list[dict]:
        with self._lock:
            return list(self._slices.values())

    def start(self, items: list, version: str) -> None:
        """Watch from ``version``, the LIST the caller just made of ``items``."""
        if self._thread is not None:
            return
        self._replace(items)
        self._resume = version
        self._thread = threading.Thread(target=self._run, name="healthagent-slice-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = STOP_JOIN_SECONDS) -> None:
        end_watch(self._stopping, self._lock, lambda: self._stream, self._thread, timeout)

    # -- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        run = Run()
        while not self._stopping.is_set():
            try:
                if not self._resume:
                    items, self._resume = self._api.list_slices()
                    if self._replace(items):
                        self._changed("listed again")
                progressed = self._follow()
            except Exception as exc:  # noqa: BLE001 - every failure is classified in _failed
                run = run.failed(opened=False)
                delay = self._failed(exc, run)
            else:
                if progressed:
                    run, delay = Run(), 0.0
                else:  # ended within seconds and carried nothing: the server is going away or shedding
                    run = run.failed(opened=True)
                    delay = run.delay(self._policy, self._rng)
            if delay > 0:
                self._stopping.wait(delay)

    def _failed(self, exc: Exception, run: Run) -> float:
        node = f"node={self._node}"
        kind, delay = watch_failure(exc, run, self._policy, self._rng, relist=True)
        if kind in ("expired", "bad_event"):
            self._resume = ""
            self._tally.count(f"slice_watch_{kind}", f"{node} {exc}; listing the ResourceSlices again")
        elif kind == "unavailable":
            self._tally.count("slice_watch_unavailable", f"{node} ResourceSlice watch lost ({exc}); resuming "
                                                         f"in {delay:.1f} s")
        elif kind == "internal":
            self._tally.count("slice_watch_internal", "ResourceSlice watch step failed (see the traceback)")
            log.error("dra %s slice watch internal error", node, exc_info=exc)
            self._resume = ""
        else:
            self._tally.count(f"slice_watch_{kind}",
                              f"{node} ResourceSlice watch refused ({exc}); watching again in {delay:.1f} s")
        return delay

    def _follow(self) -> bool:
        stream = self._api.watch_slices(self._resume, self._rng.randint(*self._timeouts))
        with self._lock:
            self._stream = stream
        opened, events = time.monotonic(), 0
        try:
            if self._stopping.is_set():
                return True
            events = read_events(stream, self._stopping, self._handle)
        except ApiError:
            if self._stopping.is_set():
                return True  # ``stop`` cut the stream
            raise
        finally:
            with self._lock:
                self._stream = None
            stream.close()
        return events > 0 or time.monotonic() - opened >= HEALTHY_STREAM_SECONDS

    def _handle(self, kind: str, obj: dict) -> None:
        if kind == "ERROR":
            raise status_error(obj)
        version = resource_version(obj)
        name = str(obj["metadata"].get("name") or "")
        if kind in ("ADDED", "MODIFIED"):
            with self._lock:
                changed = self._slices.get(name) != obj
                self._slices[name] = obj
            if changed:
                self._changed(f"{kind.lower()} {name}")
        elif kind == "DELETED":
            with self._lock:
                gone = self._slices.pop(name, None) is not None
            if gone:
                self._changed(f"deleted {name}")
        elif kind != "BOOKMARK":
            raise BadEvent(f"unknown watch event type {kind!r}")
        if version:
            self._resume = version

    def _replace(self, items: list) -> bool:
        fresh = {str((i.get("metadata") or {}).get("name") or ""): i for i in items if isinstance(i, dict)}
        with self._lock:
            changed, self._slices = fresh != self._slices, fresh
        return changed

    def _changed(self, why: str) -> None:
        self.changes += 1
        log.info("dra node=%s ResourceSlices changed (%s)", self._node, why)
        try:
            self._on_change()
        except Exception:  # the callback is the loop's; its failure must not end the watch
            self._tally.count("slice_watch_callback", "the wake-up callback failed (see the traceback)")
            log.exception("dra node=%s on_change failed", self._node)
