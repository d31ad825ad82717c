"""Watch streams: the open watchers, the kept history they resume from, the events a
selector-filtered watcher sees, and BOOKMARKs."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Callable

from tests.support.kubefake.errors import ApiError
from tests.support.kubefake.selectors import parse_field_selector, parse_label_selector

WATCH_HISTORY = 1000


@dataclass
class _Watcher:
    kind: str
    matches: Callable[[dict], bool]
    events: list  # event dicts, or str: a raw line (``send_raw_watch_line``)
    cond: threading.Condition
    dropped: bool = False
    ended: bool = False  # end the stream cleanly now, before its timeoutSeconds
    bookmarks: bool = False


def _watch_event(etype: str, obj: dict, old: dict | None, matches: Callable[[dict], bool]) -> dict | None:
    """The event a selector-filtered watcher sees (the real server's ADDED/DELETED transitions)."""
    now_matches = matches(obj)
    if etype == "MODIFIED" and old is not None:
        was = matches(old)
        if was and now_matches:
            return {"type": "MODIFIED", "object": copy.deepcopy(obj)}
        if was:
            return {"type": "DELETED", "object": copy.deepcopy(obj)}
        if now_matches:
            return {"type": "ADDED", "object": copy.deepcopy(obj)}
        return None
    return {"type": etype, "object": copy.deepcopy(obj)} if now_matches else None


class WatchMixin:
    """``KubeFake``'s watch plumbing: opening, feeding and closing watch streams."""

    def send_bookmarks(self) -> None:
        """A BOOKMARK with the newest resourceVersion into every watch that asked for them."""
        with self._lock:
            for watcher in self._watchers:
                if watcher.bookmarks:
                    self._queue(watcher, self._bookmark())

    @staticmethod
    def _queue(watcher: _Watcher, event: dict | str) -> None:
        with watcher.cond:
            watcher.events.append(event)
            watcher.cond.notify_all()

    def _bookmark(self) -> dict:
        return {"type": "BOOKMARK", "object": {"kind": "Node", "apiVersion": "v1",
                                               "metadata": {"resourceVersion": str(self._rv)}}}

    def _notify(self, kind: str, etype: str, obj: dict, old: dict | None) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self._history.append((rv, kind, etype, copy.deepcopy(obj), copy.deepcopy(old)))
        excess = len(self._history) - self.watch_history
        if excess > 0:
            self._history_floor = self._history[excess - 1][0]
            del self._history[:excess]
        for watcher in self._watchers:
            if watcher.kind != kind:
                continue
            event = _watch_event(etype, obj, old, watcher.matches)
            if event:
                self._queue(watcher, event)

    def _open_watch(self, kind, query, fields, initial=None):
        """A watcher of ``kind`` (``nodes``, or ``leases/<namespace>``): from ``resourceVersion`` "" or
        "0" every matching object of ``initial`` (default: the nodes) first as ADDED, else the
        kept history after that version."""
        labels = parse_label_selector(query.get("labelSelector", ""))
        field_match = parse_field_selector(query.get("fieldSelector", ""), fields)

        def matches(obj: dict) -> bool:
            return labels(obj["metadata"].get("labels") or {}) and field_match(obj)

        watcher = _Watcher(kind=kind, matches=matches, events=[], cond=threading.Condition(),
                           bookmarks=query.get("allowWatchBookmarks") in ("true", "1"))
        since = query.get("resourceVersion", "")
        if since not in ("", "0") and not since.isdigit():
            raise ApiError(400, "BadRequest", f"invalid resource version {since!r}")
        with self._lock:
            if since in ("", "0"):
                objects = self._nodes.values() if initial is None else initial
                for node in sorted(objects, key=lambda n: n["metadata"]["name"]):
                    if matches(node):
                        watcher.events.append({"type": "ADDED", "object": copy.deepcopy(node)})
            else:
                start = int(since)
                if start < self._history_floor:
                    gone = ApiError(410, "Expired", f"too old resource version: {start} ({self._history_floor})")
                    watcher.events.append({"type": "ERROR", "object": gone.status()})
                else:
                    for rv, hkind, etype, obj, old in self._history:
                        if rv > start and hkind == kind:
                            event = _watch_event(etype, obj, old, matches)
                            if event:
                                watcher.events.append(event)
            self._watchers.append(watcher)
        return watcher

    def _close_watch(self, watcher: _Watcher) -> None:
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
