"""The fault switches: the server going down, slow answers, injected errors and conflicts, cut
watch streams, compaction, a lagging watch cache and garbage watch lines."""

from __future__ import annotations

import copy


class FaultsMixin:
    """``KubeFake``'s fault switches (see the package documentation)."""

    def go_down(self) -> None:
        """Stop listening (connection refused) and cut every open connection."""
        self._close_listener()
        self.down = True

    def come_up(self) -> None:
        """Listen again on the same port."""
        if self.down and not self._stopping.is_set():
            self._listen()

    def set_delay(self, seconds: float) -> None:
        self._delay = seconds

    def queue_next(self, method: str, path: str, seconds: float) -> None:
        """The next ``method`` request to ``path`` counts as having waited ``seconds`` in the
        server's queue (no real wait: the test runs what happens meanwhile itself). A request whose
        ``timeout`` query parameter is shorter gets 504 Timeout and changes nothing, as
        kube-apiserver answers a request past its deadline; any other is served as usual."""
        with self._lock:
            self._queued[(method, path)] = seconds

    def _take_queued(self, method: str, path: str) -> float:
        with self._lock:
            return self._queued.pop((method, path), 0.0)

    def fail_next(self, n: int, status: int = 500, retry_after: int | None = None) -> None:
        """The next ``n`` requests get ``status`` (a Status with the reason the real server gives),
        with a ``Retry-After: <retry_after>`` header when given (as API Priority and Fairness
        sends one with its 429)."""
        with self._lock:
            self._fail_next, self._fail_status, self._fail_retry_after = n, status, retry_after

    def conflict_next_writes(self, n: int) -> None:
        with self._lock:
            self._conflict_next = n

    def drop_watches(self) -> None:
        with self._lock:
            for watcher in self._watchers:
                with watcher.cond:
                    watcher.dropped = True
                    watcher.cond.notify_all()

    def end_watches(self) -> None:
        """End every open watch stream cleanly before its ``timeoutSeconds``, as a server going
        away or shedding watchers it cannot keep up with does."""
        with self._lock:
            for watcher in self._watchers:
                with watcher.cond:
                    watcher.ended = True
                    watcher.cond.notify_all()

    def compact(self) -> None:
        """Forget the watch history, as etcd compaction does: a watch resuming from a version
        older than the current one gets 410 Expired and must list again."""
        with self._lock:
            self._history.clear()
            self._history_floor = self._rv

    def hold_watch_cache(self) -> None:
        """Lists served from the watch cache answer with the nodes as they are now, until
        ``release_watch_cache()``: a cache lagging behind etcd."""
        with self._lock:
            self._cache = (self._rv, copy.deepcopy(self._nodes))

    def release_watch_cache(self) -> None:
        with self._lock:
            self._cache = None

    def send_raw_watch_line(self, text: str) -> None:
        """Write ``text`` as one line into every open watch stream (garbage, for the client)."""
        with self._lock:
            for watcher in self._watchers:
                self._queue(watcher, text)
