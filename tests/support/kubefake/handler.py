"""The HTTP side: one handler thread per connection, JSON answers and chunked watch streams."""

from __future__ import annotations

import json
import select
import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from tests.support.kubefake.errors import ApiError
from tests.support.kubefake.recording import RecordedRequest
from tests.support.kubefake.watch import _Watcher

if TYPE_CHECKING:
    from tests.support.kubefake.store import KubeFake


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms stalls
    fake: KubeFake  # set on the subclass made per server

    def log_message(self, format, *args) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def setup(self) -> None:
        super().setup()
        with self.fake._lock:
            self.fake._conns.add(self.connection)

    def finish(self) -> None:
        with self.fake._lock:
            self.fake._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _serve(self, method: str) -> None:
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body: Any = None
        status, answer = 0, None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                status, answer = 400, ApiError(400, "BadRequest", "request body is not JSON").status()
        if self.fake._delay > 0:
            self.fake._stopping.wait(self.fake._delay)
        queued = self.fake._take_queued(method, split.path)
        if answer is None and queued and queued > _seconds(query.get("timeout", "")):
            status, answer = 504, ApiError(504, "Timeout", "the request did not complete within the allotted "
                                                          "timeout").status()
        if answer is None:
            status, answer = self.fake.handle(method, split.path, query, content_type, body,
                                              self.headers.get("Accept") or "")
        self.fake._record(RecordedRequest(method, split.path, query, content_type, body, status, time.time()))
        try:
            if isinstance(answer, _Watcher):
                self._stream(answer, float(query.get("timeoutSeconds") or 0) or None)
            else:
                self._send_json(status, answer)
        except OSError:
            self.close_connection = True

    def _send_json(self, status: int, answer: Any) -> None:
        data = json.dumps(answer).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == self.fake._fail_status and self.fake._fail_retry_after is not None:
            self.send_header("Retry-After", str(self.fake._fail_retry_after))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, watcher: _Watcher, timeout: float | None) -> None:
        deadline = time.monotonic() + timeout if timeout else None
        last_bookmark = time.monotonic()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while not self.fake._stopping.is_set():
                if self._peer_closed():
                    return  # the client went away (a real server notices at once, too)
                interval = self.fake.bookmark_interval
                if watcher.bookmarks and interval and time.monotonic() - last_bookmark >= interval:
                    last_bookmark = time.monotonic()
                    with self.fake._lock:  # every event up to the newest version is queued first
                        self.fake._queue(watcher, self.fake._bookmark())
                with watcher.cond:
                    if not watcher.events and not watcher.dropped and not watcher.ended:
                        watcher.cond.wait(0.05)
                    pending, watcher.events = watcher.events, []
                    dropped, ended = watcher.dropped, watcher.ended
                for event in pending:
                    text = event if isinstance(event, str) else json.dumps(event)
                    line = text.encode("utf-8") + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                    if isinstance(event, dict) and event["type"] == "ERROR":
                        deadline = time.monotonic()
                if dropped:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)  # cut mid-stream, no final chunk
                    return
                if ended or (deadline is not None and time.monotonic() >= deadline):
                    break
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        finally:
            self.fake._close_watch(watcher)

    def _peer_closed(self) -> bool:
        """Has the client closed a quiet stream? (readable with nothing to read = EOF)"""
        try:
            # poll, not select: select() refuses descriptors past 1023, and an agent in the same
            # process holding its EFA counter files open pushes socket numbers past that.
            poller = select.poll()
            poller.register(self.connection, select.POLLIN)
            readable = poller.poll(0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._serve("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._serve("PATCH")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")


def _seconds(duration: str) -> float:
    """A ``timeout`` query parameter as Go's ``time.ParseDuration`` reads the simple forms ("10s",
    "1m", "500ms"); none or unreadable is no deadline."""
    for unit, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if duration.endswith(unit):
            try:
                return float(duration[:-len(unit)]) * scale
            except ValueError:
                return float("inf")
    return float("inf")
