"""The request log: every request the fake answered, for tests to count what the client did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the fake saw it (``status`` is what it answered; 0 = cut off)."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any
    status: int
    at: float

    @property
    def is_write(self) -> bool:
        return self.method in ("POST", "PUT", "PATCH", "DELETE")


class RequestLogMixin:
    """``KubeFake``'s request log (``requests()``, ``writes()``, ``watches()``, ``open_watches()``)."""

    def requests(self, method: str | None = None, path: str | None = None) -> list[RecordedRequest]:
        """Recorded requests, optionally of one method and under one path prefix."""
        with self._lock:
            return [r for r in self._log
                    if (method is None or r.method == method) and (path is None or r.path.startswith(path))]

    def writes(self, path: str | None = None) -> list[RecordedRequest]:
        """Recorded POST/PUT/PATCH/DELETE requests (whatever they were answered)."""
        return [r for r in self.requests(path=path) if r.is_write]

    def watches(self, path: str | None = None) -> list[RecordedRequest]:
        """Recorded watch requests (``watch=true``), whatever they were answered."""
        return [r for r in self.requests("GET", path) if r.query.get("watch") in ("true", "1")]

    def open_watches(self) -> int:
        """Watch streams the server is serving now (a client that went away is noticed)."""
        with self._lock:
            return len(self._watchers)

    def reset_log(self) -> None:
        with self._lock:
            self._log.clear()

    def _record(self, req: RecordedRequest) -> None:
        with self._lock:
            self._log.append(req)
