"""One watch on the agent's own Node: the cache the effects plan against, and their wake-up.

Why: noticing operators (the ``healthagent.io/clear`` annotation, a taint removed by hand) by
re-reading the node on a timer costs every node a GET a minute - about 33 GET/s against the API
server on 2,000 nodes, for nothing - and makes an operator's clear wait out the timer. One watch
per node costs one open request; the API server pushes the node whenever it changes.

The protocol, as client-go's reflector speaks it, for one object:
  - LIST ``/api/v1/nodes?fieldSelector=metadata.name=<node>``: the node and the list's
    resourceVersion (the start-up read of ``NodeEffects`` is this LIST, so it costs nothing extra);
  - WATCH from that version with ``allowWatchBookmarks`` and a server-side ``timeoutSeconds``
    (randomised in 5-10 min, so a fleet does not re-watch in step). Every event's
    resourceVersion, a BOOKMARK's included, is where the next watch resumes;
  - the server ending the stream at ``timeoutSeconds`` is normal: watch again, from the last
    version, at once;
  - 410 Gone (an ERROR event in the stream, as the API server sends it, or an HTTP 410): the
    version left the server's window. LIST again, then watch from the new list's version;
  - a refused, cut or hung connection, a 5xx, a 429, a 401 or 403 (a restarted API server
    refuses everyone until its caches fill), or a stream the server ended before its time: back
    off and resume from the last version - nothing is lost, the server replays what was missed.
    The delays are ``effects/watch_retry.py``'s: capped exponential with full jitter, never
    before a 429's ``Retry-After``, and spread over seconds when a live stream was lost, so a
    fleet cut in the same second does not come back in the same second. The effects read the
    node meanwhile;
  - a line that is not a watch event is counted and the node listed again (an event may have
    been lost with it).

``live`` is True from a successful LIST or watch request until the stream fails. While it is
True the cache is as fresh as a read, and ``NodeEffects`` plans and writes against it without a
GET; while it is False, ``NodeEffects`` falls back to reading the node before planning, at the
rate it always had. The cache keeps the newest object by resourceVersion, whoever offers it (a
watch event, a GET, a write's reply), so an event that arrives after the agent's own write
never rolls the cache back.

Each event that changes what the agent owns or acts on (``owned``: its taint, labels, the clear
annotations, its conditions, the object's uid) calls ``on_change``, as does the watch coming
back after it failed; foreign changes (another controller's label, the kubelet's status) only
update the cache.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from typing import Any, Callable

from healthagent.common import ErrorTally
from healthagent.effects.backend import ApiError, ApiRejected, Expired, classify_status
from healthagent.effects.watch_retry import BASE_SECONDS, CAP_SECONDS, SPREAD_SECONDS, RetryPolicy, Run, retry_after

log = logging.getLogger(__name__)

WATCH_TIMEOUT_SECONDS = (300, 600)  # server-side timeoutSeconds, drawn per request (client-go: 5-10 min)
BACKOFF_SECONDS = (BASE_SECONDS, CAP_SECONDS)  # base, cap: client-go's reflector backoff
HEALTHY_STREAM_SECONDS = 10.0  # a stream that lived this long was no failure, events or not
FULL_TERM_SLACK_SECONDS = 1.0  # a stream that lived its timeoutSeconds less this ran its full term
STOP_JOIN_SECONDS = 5.0


class BadEvent(Exception):
    """A watch line that is not a watch event."""


def resource_version(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return str((meta or {}).get("resourceVersion") or "") if isinstance(meta, dict) else ""


def not_older(candidate: str, current: str) -> bool:
    """Is ``candidate`` at least as new as ``current``? resourceVersions are opaque to clients,
    but every API server backed by etcd hands out its integer revisions, and for one object
    they only grow; a version that is not an integer is taken as the newest arrival."""
    if not current or not candidate:
        return True
    try:
        return int(candidate) >= int(current)
    except ValueError:
        return True


def parse_event(line: str) -> tuple[str, dict]:
    """One watch line -> (type, object); ``BadEvent`` for anything else."""
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's limit
        raise BadEvent(f"not JSON: {line[:80]!r}") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str) \
            or not isinstance(event.get("object"), dict):
        raise BadEvent(f"not a watch event: {line[:80]!r}")
    if event["type"] != "ERROR" and not isinstance(event["object"].get("metadata"), dict):
        raise BadEvent(f"{event['type']} event without object metadata")
    return event["type"], event["object"]


def status_error(status: dict) -> ApiError:
    """The error a watch's ERROR event carries (its object is a Status)."""
    code = status.get("code")
    return classify_status(code if isinstance(code, int) else 0, str(status.get("reason") or ""),
                           str(status.get("message") or ""))


def ran_full_term(lived: float, timeout_seconds: int) -> bool:
    """Did a stream that ended cleanly after ``lived`` seconds end because its ``timeoutSeconds``
    was up? Otherwise the server ended it early: it is going away, or shedding watchers."""
    return lived + FULL_TERM_SLACK_SECONDS >= timeout_seconds


def watch_failure(exc: BaseException, run: Run, policy: RetryPolicy, rng: random.Random, *,
                  relist: bool) -> tuple[str, float]:
    """How one failed watch attempt is counted, and how long to wait before the next: (kind,
    delay). ``relist``: a 410 or a damaged stream means the resume point cannot be trusted, so the
    watch lists again, at once the first time and with the back-off when it happens again and
    again (``expired``, ``bad_event``). Otherwise ``rejected_<status>``, ``bad_event``,
    ``unavailable``, or ``internal`` (a bug here must not end the watch for good). The node, slot
    and slice watches all count their failures through this one rule."""
    if relist and isinstance(exc, (Expired, BadEvent)):
        kind = "expired" if isinstance(exc, Expired) else "bad_event"
        return kind, 0.0 if run.failures == 1 else Run(run.failures - 1, run.lost).delay(policy, rng)
    delay = run.delay(policy, rng, retry_after(exc))
    if isinstance(exc, ApiRejected):
        return f"rejected_{exc.status}", delay
    if isinstance(exc, BadEvent):
        return "bad_event", delay
    return ("unavailable" if isinstance(exc, ApiError) else "internal"), delay


def end_watch(stopping: threading.Event, lock: threading.Lock, stream: Callable[[], Any],
              thread: threading.Thread | None, timeout: float) -> None:
    """Stop a watch's thread: say so, interrupt the stream its read may be blocked on (``stream``,
    read under ``lock``), and wait at most ``timeout`` for it. The node, slot and slice watches
    stop alike."""
    stopping.set()
    with lock:
        current = stream()
    if current is not None:
        current.interrupt()
    if thread is not None:
        thread.join(timeout)


def read_events(stream: Any, stopping: threading.Event, handle: Callable[[str, dict], None]) -> int:
    """Hand each event of ``stream`` to ``handle`` until the server ends it, or ``stopping`` is
    set; how many were handled. A line that is not an event raises ``BadEvent``."""
    events = 0
    for line in stream.lines():
        if stopping.is_set():
            break
        if line.strip():
            handle(*parse_event(line))
            events += 1
    return events


class NodeCache:
    """The latest Node object seen; thread-safe. Objects handed out are shared: read-only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._node: dict | None = None
        self._version = ""

    def get(self) -> dict | None:
        with self._lock:
            return self._node

    def offer(self, node: dict) -> tuple[dict | None, bool]:
        """Keep ``node`` unless the cache holds a newer version: (the node before, kept?)."""
        version = resource_version(node)
        with self._lock:
            previous = self._node
            if not not_older(version, self._version):
                return previous, False
            self._node, self._version = node, version
            return previous, True

    def forget(self, version: str) -> dict | None:
        """The node was deleted at ``version``: (the node before)."""
        with self._lock:
            previous = self._node
            if not_older(version, self._version):
                self._node, self._version = None, version
            return previous


class NodeWatch:
    """The watch thread for one node (see the module docstring). ``start`` once, ``stop`` once."""

    def __init__(
        self,
        backend: Any,
        cache: NodeCache,
        *,
        owned: Callable[[dict | None], object],
        on_change: Callable[[], None],
        tally: ErrorTally,
        rng: random.Random | None = None,
        timeout_seconds: tuple[int, int] = WATCH_TIMEOUT_SECONDS,
        backoff: tuple[float, float] = BACKOFF_SECONDS,
        spread_seconds: float = SPREAD_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[threading.Event, float], object] | None = None,
    ) -> None:
        """``backoff`` (base, cap) and ``spread_seconds``: the retry policy (``watch_retry``);
        ``pause(stopping, seconds)`` waits out a retry delay (``stopping.wait`` unless a test
        records the delays instead); ``clock`` times how long a stream lived."""
        self._backend = backend
        self._cache = cache
        self._owned = owned
        self._on_change = on_change
        self._tally = tally
        self._rng = rng or random.Random()
        self._timeouts = (max(1, int(timeout_seconds[0])), max(1, int(timeout_seconds[1])))
        self._policy = RetryPolicy(backoff[0], backoff[1], spread_seconds)
        self._clock = clock
        self._pause = pause or (lambda stopping, seconds: stopping.wait(seconds))
        self._opened = False  # the current attempt's watch request was answered: its stream is open
        self._progressed = False  # ... and it lived a while
        self._node_name = backend.node_name
        self._resume = ""
        self._live = False
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._stream: Any = None
        self._thread: threading.Thread | None = None

    @property
    def live(self) -> bool:
        return self._live

    @property
    def resume_version(self) -> str:
        """The resourceVersion the next watch request starts from ("" = list first)."""
        return self._resume

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, listed_version: str = "") -> None:
        """Start the thread. ``listed_version``: the caller just LISTed the node (and offered it
        to the cache) at this version, so the thread watches from there without listing again."""
        if self._thread is not None:
            return
        self._resume = listed_version
        if listed_version:
            self._set_live(True)
        self._thread = threading.Thread(target=self._run, name="healthagent-node-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = STOP_JOIN_SECONDS) -> None:
        end_watch(self._stopping, self._lock, lambda: self._stream, self._thread, timeout)
        self._live = False

    # -- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        run = Run()
        while not self._stopping.is_set():
            self._opened = self._progressed = False
            try:
                if not self._resume:
                    self._relist()
                full_term = self._follow()
            except Exception as exc:  # noqa: BLE001 - every failure is classified in _failed
                if self._stopping.is_set():
                    return
                run = run.failed(opened=self._opened, progressed=self._progressed)
                delay = self._failed(exc, run)
            else:
                if full_term:
                    run, delay = Run(), 0.0
                else:  # the server ended the stream early: it is going away, or shedding watchers
                    self._set_live(False)
                    run = run.failed(opened=True, progressed=self._progressed)
                    delay = run.delay(self._policy, self._rng)
                    self._tally.count("watch_unavailable", f"node={self._node_name} the server ended the watch "
                                      f"before its time; resuming in {delay:.1f} s")
            if delay > 0 and not self._stopping.is_set():
                self._pause(self._stopping, delay)

    def _failed(self, exc: Exception, run: Run) -> float:
        """Count and log a failed attempt; return how long to wait before the next one."""
        self._set_live(False)
        node = f"node={self._node_name}"
        kind, delay = watch_failure(exc, run, self._policy, self._rng, relist=True)
        if kind in ("expired", "bad_event"):
            self._resume = ""  # the resume version, or the stream, cannot be trusted: list again
            self._tally.count(f"watch_{kind}", f"{node} {exc}; listing again")
        elif kind == "unavailable":
            self._tally.count("watch_unavailable", f"{node} watch lost ({exc}); resuming from resourceVersion "
                                                   f"{self._resume or '(list)'} in {delay:.1f} s")
        elif kind == "internal":
            self._tally.count("watch_internal", "watch step failed (see the traceback)")
            log.error("effects %s watch internal error", node, exc_info=exc)
            self._resume = ""
        else:
            self._tally.count(f"watch_{kind}", f"{node} watch/list refused ({exc}); reading the node instead, "
                                               f"watching again in {delay:.1f} s")
        return delay

    def _relist(self) -> None:
        node, version = self._backend.list_own_node()
        if node is None:
            self._tally.count("watch_node_missing", f"node={self._node_name} is not in the node list")
            self._deleted(version)
        else:
            self._offer(node)
        self._resume = version
        self._set_live(True)
        log.info("effects node=%s watch listed resourceVersion=%s", self._node_name, version)

    def _follow(self) -> bool:
        """One watch request, read until the server ends it. True if the stream ran its full
        term (the next request then follows at once); ``_progressed`` says whether it lived a
        while (a failure after it starts a new run of failures)."""
        timeout = self._rng.randint(*self._timeouts)
        stream = self._backend.watch_own_node(self._resume, timeout)
        self._opened = True
        with self._lock:
            self._stream = stream
        opened = self._clock()
        try:
            if self._stopping.is_set():
                return True
            self._set_live(True)
            read_events(stream, self._stopping, self._handle)
        finally:
            with self._lock:
                self._stream = None
            stream.close()
            lived = self._clock() - opened
            self._progressed = lived >= HEALTHY_STREAM_SECONDS
        return self._stopping.is_set() or ran_full_term(lived, timeout)

    def _handle(self, kind: str, obj: dict) -> None:
        if kind == "ERROR":  # the object is a Status
            raise status_error(obj)
        version = resource_version(obj)
        if kind == "BOOKMARK":
            pass
        elif obj["metadata"].get("name") != self._node_name:
            self._tally.count("watch_foreign_object", f"the watch on {self._node_name} sent "
                                                      f"{obj['metadata'].get('name')!r}; ignored")
        elif kind in ("ADDED", "MODIFIED"):
            self._offer(obj)
        elif kind == "DELETED":
            self._deleted(version)
        else:
            raise BadEvent(f"unknown watch event type {kind!r}")
        if version:
            self._resume = version

    # -- the cache and the wake-up -----------------------------------------------------------------

    def _offer(self, node: dict) -> None:
        previous, kept = self._cache.offer(node)
        if kept and self._owned(previous) != self._owned(node):
            self._wake("node changed")

    def _deleted(self, version: str) -> None:
        if self._cache.forget(version) is not None:
            log.warning("effects node=%s the Node object was deleted", self._node_name)
            self._wake("node deleted")

    def _set_live(self, live: bool) -> None:
        was, self._live = self._live, live
        if live and not was:
            self._wake("watch live")

    def _wake(self, why: str) -> None:
        log.debug("effects node=%s watch wakes the effects: %s", self._node_name, why)
        try:
            self._on_change()
        except Exception:  # the callback is the loop's; its failure must not end the watch
            self._tally.count("watch_callback", "the effects wake-up callback failed (see the traceback)")
            log.exception("effects node=%s on_change failed", self._node_name)
