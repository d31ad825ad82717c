"""One HTTP listener that a hostile client cannot take down: bounded in every dimension.

Each listener is its own socket, accept thread and pool of connection slots, so what happens on
one (the training intake, open to every pod on the node) never reaches another (the kubelet's
probes and Prometheus' scrape). On each listener:

- **a deadline for the whole request**: the request line, the headers and the body must all
  arrive within ``deadline_seconds`` of the connection starting to be served, and the reply must
  be written within the same deadline. Every read from the socket gets only the time left, so a
  client sending one byte a second is cut off at the deadline, not kept for ever by a per-read
  timeout it resets with each byte;
- **a cap on connections**, in all and per client address: a client past either cap is closed at
  once, before a thread is started for it, and counted; one address cannot take every slot;
- **a listen backlog** of ``backlog`` (socketserver's default of 5 resets clients as soon as a
  burst of connections outruns the accept loop);
- one request per connection (HTTP/1.0), so a slot is held for one request at most;
- no request error can stop the listener: each is answered, or logged at DEBUG when the client
  went away; a handler bug is a 500 and a count.

Stdlib ``ThreadingHTTPServer``: a scrape, a probe and a report can be served at the same time.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

from healthagent.common import ErrorTally

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one listener allows. Defaults suit the agent's own endpoints."""

    max_connections: int = 32
    max_per_client: int = 8
    deadline_seconds: float = 5.0
    backlog: int = 256


class DeadlineReader(io.RawIOBase):
    """The socket's input, where every read waits at most until ``deadline`` (a monotonic time).

    Past the deadline a read raises ``socket.timeout`` (``TimeoutError``), which the stdlib handler
    treats as a timed-out request and closes the connection.
    """

    def __init__(self, sock: socket.socket, deadline: float, on_expired: Callable[[], None],
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline
        self._on_expired = on_expired
        self._monotonic = monotonic

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - self._monotonic()
        if remaining <= 0:
            self._on_expired()
            raise socket.timeout("the request did not arrive within its deadline")
        self._sock.settimeout(remaining)
        try:
            return self._sock.recv_into(buffer)
        except socket.timeout:
            self._on_expired()
            raise


class Handler(BaseHTTPRequestHandler):
    """Base of a listener's request handler: deadline-bound input and output, quiet logging.

    A subclass implements ``route(method, path)``; ``send`` writes a whole reply.
    """

    server: "_Server"
    server_version = "healthagent"
    protocol_version = "HTTP/1.0"  # one request per connection: a slot is never held idle

    def setup(self) -> None:
        super().setup()
        self.deadline = time.monotonic() + self.server.limits.deadline_seconds
        self.rfile.close()  # the stdlib's reader: closed, or it keeps the socket open after close()
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, self.deadline,
                                                      self.server.count_deadline))

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("http %s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def route(self, method: str, path: str) -> None:
        raise NotImplementedError

    def _dispatch(self, method: str) -> None:
        try:
            self.route(method, urlsplit(self.path).path)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            log.debug("http client %s went away or ran out of time during %s %s",
                      self.client_address[0], method, self.path)
        except Exception:
            self.server.tally.count("handler", f"{method} {self.path} failed with a 500")
            log.exception("http %s %s failed", method, self.path)
            try:
                self.send(500, "text/plain; charset=utf-8", b"internal error; see the agent's log\n")
            except Exception:
                pass

    def send(self, status: int, content_type: str, body: bytes,
             headers: dict[str, str] | None = None) -> None:
        """Write one reply within the request's deadline (a client that does not read is cut off)."""
        self.connection.settimeout(max(0.5, self.deadline - time.monotonic()))
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with daemon threads, the caps, the backlog and quiet error handling."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[Handler], limits: Limits,
                 tally: ErrorTally, context: Any) -> None:
        self.limits = limits
        self.tally = tally
        self.context = context
        self.request_queue_size = limits.backlog  # read by server_activate() in __init__
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._lock = threading.Lock()
        self._open = 0
        self._per_client: Counter = Counter()
        super().__init__(address, handler)

    def count_deadline(self) -> None:
        self.tally.count("deadline", f"a request took longer than its {self.limits.deadline_seconds:g} s "
                                     "deadline; the connection was closed")

    def _admit(self, client: str) -> str | None:
        """Take a slot for ``client``, or say which cap refuses it."""
        with self._lock:
            if self._open >= self.limits.max_connections:
                return "refused"
            if self._per_client[client] >= self.limits.max_per_client:
                return "refused_per_client"
            self._open += 1
            self._per_client[client] += 1
            return None

    def _release(self, client: str) -> None:
        with self._lock:
            self._open -= 1
            self._per_client[client] -= 1
            if self._per_client[client] <= 0:
                del self._per_client[client]

    def process_request(self, request, client_address) -> None:
        client = client_address[0]
        refused = self._admit(client)
        if refused is not None:
            cap = (f"{self.limits.max_connections} connections open" if refused == "refused" else
                   f"{self.limits.max_per_client} connections open from this address")
            self.tally.count(refused, f"connection from {client} refused: {cap}")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._release(client)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(client_address[0])

    def handle_error(self, request, client_address) -> None:
        log.debug("http request from %s failed", client_address, exc_info=True)


class Listener:
    """One listening socket served by ``handler`` on its own thread; ``context`` is what the
    handler reads as ``self.server.context``. ``start()`` binds (port 0 picks a free port)."""

    def __init__(self, name: str, host: str, port: int, handler: type[Handler], context: Any,
                 limits: Limits, tally: ErrorTally) -> None:
        self.name = name
        self.host = host
        self.requested_port = port
        self.handler = handler
        self.context = context
        self.limits = limits
        self.tally = tally
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port after ``start()`` (the requested one before)."""
        return self._httpd.server_address[1] if self._httpd is not None else self.requested_port

    def start(self) -> None:
        self._httpd = _Server((self.host, self.requested_port), self.handler, self.limits, self.tally,
                              self.context)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"healthagent-http-{self.name}", daemon=True)
        self._thread.start()
        log.info("http listening on=%s host=%s port=%d", self.name, self.host, self.port)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close the socket, join the serving thread. Safe to call twice."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
        log.info("http stopped on=%s port=%d", self.name, httpd.server_address[1])
