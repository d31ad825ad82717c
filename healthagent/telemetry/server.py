"""The agent's HTTP server: ``/metrics``, ``/healthz``, ``/readyz`` and the training intake.

Stdlib ``ThreadingHTTPServer`` on its own thread: a scrape, a probe and rank reports can run at
the same time, and none of them touches the loop (the exporter renders the published snapshot).
The server is reachable from every pod on the node (hostPort), so it defends itself: a bounded
number of connections, a socket timeout per request, a size limit on bodies, and no request error
can stop it (each is answered, or logged at DEBUG when the client went away).

``/healthz`` is the liveness probe: 200 while the loop's heartbeat is recent, 503 (with why) when
the loop has not completed a cycle for ``heartbeat_timeout_seconds`` (a generous multiple of the
poll interval: a stuck loop, which a restart fixes; a hung NVML/EFA/dcgm call does not stop the
loop, it runs under a deadline, ``sources.base.DeadlineSource``). ``/readyz`` is 200 once
the agent says it is ready (a cycle ran and Kubernetes was reached, or dry-run).
"""

from __future__ import annotations

import gzip
import hmac
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

from prometheus_client.exposition import choose_encoder, gzip_accepted

from healthagent.common import ErrorTally
from healthagent.telemetry.metrics import Telemetry
from healthagent.telemetry.training_intake import IntakeReply, TrainingIntake

log = logging.getLogger(__name__)

TRAINING_PATH = "/v1/training"
MAX_BODY_BYTES = 64 * 1024
DISCARD_LIMIT_BYTES = 1024 * 1024  # a larger body is not read at all; the connection is closed
REQUEST_TIMEOUT_SECONDS = 10.0
MAX_CONNECTIONS = 64
_TEXT = "text/plain; charset=utf-8"
_ROUTES = {"/metrics": ("GET",), "/healthz": ("GET",), "/readyz": ("GET",), TRAINING_PATH: ("POST",)}


class AgentServer:
    """Serves the agent's endpoints; ``start()`` binds (port 0 picks a free port, see ``.port``)."""

    def __init__(self, telemetry: Telemetry, intake: TrainingIntake | None, host: str, port: int, *,
                 heartbeat_timeout_seconds: float = 60.0, max_body_bytes: int = MAX_BODY_BYTES,
                 max_connections: int = MAX_CONNECTIONS, training_token: str = "",
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.telemetry = telemetry
        self.intake = intake
        # When set, POST /v1/training must carry "Authorization: Bearer <token>" (docs/training.md).
        self._training_authorization = f"Bearer {training_token}".encode() if training_token else None
        self.host = host
        self.requested_port = port
        self.heartbeat_timeout_seconds = float(heartbeat_timeout_seconds)
        self.max_body_bytes = int(max_body_bytes)
        self.max_connections = int(max_connections)
        self._monotonic = monotonic
        self._started_at = monotonic()
        self._last_beat: float | None = None
        self._ready = False
        self._tally = ErrorTally("http")
        self._httpd: _HttpServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port after ``start()`` (the requested one before)."""
        return self._httpd.server_address[1] if self._httpd is not None else self.requested_port

    def start(self) -> None:
        self._started_at = self._monotonic()
        self._httpd = _HttpServer((self.host, self.requested_port), self)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="healthagent-http", daemon=True)
        self._thread.start()
        log.info("http listening host=%s port=%d", self.host, self.port)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close the socket, join the serving thread. Safe to call twice."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
        log.info("http stopped port=%d", httpd.server_address[1])

    @property
    def errors(self) -> dict[str, int]:
        """Cumulative failures by kind: ``refused`` (connection cap reached), ``handler``
        (a request failed with a 500)."""
        return self._tally.snapshot()

    def count_error(self, kind: str, message: str) -> None:
        self._tally.count(kind, message)

    def heartbeat(self, now: float) -> None:
        """The loop completed a cycle. ``now`` is the loop's clock; liveness uses our monotonic one."""
        self._last_beat = self._monotonic()

    def set_ready(self, ready: bool) -> None:
        self._ready = bool(ready)

    def health(self) -> tuple[bool, str]:
        """(alive, why) for /healthz."""
        now = self._monotonic()
        limit = self.heartbeat_timeout_seconds
        if self._last_beat is None:
            waited = now - self._started_at
            if waited <= limit:
                return True, f"ok: starting, first cycle not completed yet ({waited:.1f}s)"
            return False, f"unhealthy: the loop has not completed a cycle in {waited:.0f}s since start (limit {limit:.0f}s)"
        age = now - self._last_beat
        if age <= limit:
            return True, f"ok: last loop cycle {age:.1f}s ago"
        return False, f"unhealthy: the loop's last cycle was {age:.0f}s ago (limit {limit:.0f}s)"

    def authorized(self, authorization: str) -> bool:
        """True when no training token is set, or the header carries it (constant-time compare)."""
        if self._training_authorization is None:
            return True
        return hmac.compare_digest(authorization.strip().encode("latin-1", "replace"),
                                   self._training_authorization)

    def readiness(self) -> tuple[bool, str]:
        if self._ready:
            return True, "ready"
        return False, ("not ready: the loop has not completed its first cycle, or Kubernetes is "
                       "unreachable (see healthagent_kube_reachable)")


class _HttpServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with daemon threads, a connection cap and quiet error handling."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], agent: AgentServer) -> None:
        self.agent = agent
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._slots = threading.BoundedSemaphore(agent.max_connections)
        self.refused_connections = 0
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            self.agent.count_error("refused", f"connection from {client_address[0]} refused: "
                                              f"{self.agent.max_connections} connections open")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        log.debug("http request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _HttpServer
    timeout = REQUEST_TIMEOUT_SECONDS
    server_version = "healthagent"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("http %s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def _route(self, method: str) -> None:
        try:
            path = urlsplit(self.path).path
            allowed = _ROUTES.get(path)
            if allowed is None:
                self._send(404, _TEXT, f"not found: {path}; try /metrics, /healthz, /readyz, "
                                       f"POST {TRAINING_PATH}\n".encode())
            elif method not in allowed:
                self._send(405, _TEXT, f"{method} not allowed on {path}\n".encode(),
                           {"Allow": ", ".join(allowed)})
            elif path == "/metrics":
                self._metrics()
            elif path == "/healthz":
                self._probe(self.server.agent.health())
            elif path == "/readyz":
                self._probe(self.server.agent.readiness())
            else:
                self._training()
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            log.debug("http client went away during %s %s", method, self.path)
        except Exception:
            self.server.agent.count_error("handler", f"{method} {self.path} failed with a 500")
            log.exception("http %s %s failed", method, self.path)
            try:
                self._send(500, _TEXT, b"internal error; see the agent's log\n")
            except Exception:
                pass

    def _metrics(self) -> None:
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        body = self.server.agent.telemetry.exposition(encoder, content_type)
        headers = {}
        if gzip_accepted(self.headers.get("Accept-Encoding", "")):
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        self._send(200, content_type, body, headers)

    def _probe(self, result: tuple[bool, str]) -> None:
        ok, why = result
        self._send(200 if ok else 503, _TEXT, (why + "\n").encode())

    def _training(self) -> None:
        agent = self.server.agent
        intake = agent.intake
        if intake is None:
            self._send(404, _TEXT, b"the training intake is off on this agent\n")
            return
        if not agent.authorized(self.headers.get("Authorization", "")):
            length_text = (self.headers.get("Content-Length") or "").strip()
            if length_text.isdigit():  # read (bounded) and drop it, so the client sees our 401
                self._discard(int(length_text))
            self.close_connection = True
            self._reply(intake.reject("unauthorized", "this agent requires 'Authorization: Bearer "
                                                      "<token>' (HEALTHAGENT_TRAINING_TOKEN)", 401),
                        {"WWW-Authenticate": 'Bearer realm="healthagent training intake"'})
            return
        media_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            self._reply(intake.reject("content_type", f"Content-Type must be application/json, got "
                                                      f"{media_type or 'none'!r}", 415))
            return
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.strip().isdigit():
            self.close_connection = True
            self._reply(intake.reject("length_required", "a Content-Length header is required "
                                                         "(chunked bodies are not accepted)", 411))
            return
        length = int(length_text)
        if length > agent.max_body_bytes:
            self._discard(length)
            self.close_connection = True
            self._reply(intake.reject("body_too_large", f"body of {length} bytes is over the "
                                                        f"{agent.max_body_bytes}-byte limit; send "
                                                        f"smaller batches", 413))
            return
        body = self.rfile.read(length)
        if len(body) < length:
            self._reply(intake.reject("malformed_json", f"body ended after {len(body)} of {length} bytes"))
            return
        self._reply(intake.submit(body))

    def _discard(self, length: int) -> None:
        """Read and drop a too-large body (up to a bound) so the client can read our 413: closing
        a socket with unread data makes TCP reset it, and the client would see only the reset."""
        remaining = min(length, DISCARD_LIMIT_BYTES)
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 64 * 1024))
            if not chunk:
                return
            remaining -= len(chunk)

    def _reply(self, reply: IntakeReply, headers: dict[str, str] | None = None) -> None:
        self._send(reply.status, "application/json", (json.dumps(reply.body) + "\n").encode(), headers)

    def _send(self, status: int, content_type: str, body: bytes,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
