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
- **fair admission when every slot is taken**: a new connection from an address that holds
  fewer slots than some other address closes the oldest connection of the address that holds
  the most (ties: the one whose oldest connection is oldest) and takes its slot; the new
  connection is refused only when its address already holds as many slots as any other. So an
  address holding no slot always gets in: no number of slow clients from other addresses can
  keep out the kubelet's probe (from the node's address) or Prometheus' scrape (from its pod's).
  The flood only competes with itself, each of its addresses held to an equal share. The oldest
  connection is the one to close because a request that is being answered is done in
  milliseconds, while a slow client has been holding its slot longest. A closed connection's
  thread ends at once (its socket is shut down), and its slot passes to the newcomer at once;
  if ``max_connections`` closed connections are still winding down, new ones are refused
  (threads stay bounded). Each eviction is counted (``evicted``). The unit is the address:
  clients behind one address share its share (host-network pods share the node's with the
  kubelet; ``deploy/components/network-policy`` keeps other pods off the agent's port);
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
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping
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


@dataclass(frozen=True)
class Admission:
    """What happens to a new connection: ``refused`` names the cap that turns it away ("" when it
    is admitted); ``evict`` names the address whose oldest connection makes room for it."""

    refused: str = ""
    evict: str | None = None


def admit(held: Mapping[str, int], oldest: Mapping[str, float], client: str, limits: Limits,
          closing: int = 0) -> Admission:
    """The fair admission rule (module docstring) for a connection from ``client``.

    ``held``: slots held per address; ``oldest``: per address, when its oldest connection was
    admitted; ``closing``: evicted connections whose threads have not ended yet.
    """
    mine = held.get(client, 0)
    if mine >= limits.max_per_client:
        return Admission(refused="refused_per_client")
    if sum(held.values()) < limits.max_connections:
        return Admission()
    richer = [address for address, count in held.items() if count > mine and address != client]
    if not richer or closing >= limits.max_connections:
        return Admission(refused="refused")
    return Admission(evict=max(richer, key=lambda address: (held[address], -oldest[address])))


@dataclass(frozen=True, eq=False)
class _Slot:
    """One admitted connection: its socket, its client's address and when it was admitted."""

    sock: socket.socket
    address: Any
    since: float

    @property
    def client(self) -> str:
        return self.address[0]


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
        self._slots: dict[str, list[_Slot]] = {}  # per address, oldest first
        self._closing: set[_Slot] = set()  # evicted, their threads not ended yet
        super().__init__(address, handler)

    def count_deadline(self) -> None:
        self.tally.count("deadline", f"a request took longer than its {self.limits.deadline_seconds:g} s "
                                     "deadline; the connection was closed")

    @property
    def held(self) -> dict[str, int]:
        """Slots held per client address now (what the admission rule weighs)."""
        with self._lock:
            return {client: len(slots) for client, slots in self._slots.items()}

    def _admit(self, slot: _Slot) -> tuple[Admission, int]:
        """Take a slot for ``slot`` by the admission rule, closing the evicted connection at once;
        returns the decision and how many slots the evicted address held."""
        with self._lock:
            held = {client: len(slots) for client, slots in self._slots.items()}
            oldest = {client: slots[0].since for client, slots in self._slots.items()}
            decision = admit(held, oldest, slot.client, self.limits, len(self._closing))
            if decision.refused:
                return decision, 0
            if decision.evict is not None:
                victim = self._slots[decision.evict].pop(0)
                if not self._slots[decision.evict]:
                    del self._slots[decision.evict]
                self._closing.add(victim)
                # Under the lock: the victim's thread closes its socket only after taking the lock
                # to release its slot, so this never shuts down a closed (or reused) descriptor.
                try:
                    victim.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # the client is already gone
            self._slots.setdefault(slot.client, []).append(slot)
            return decision, held.get(decision.evict, 0) if decision.evict else 0

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            if slot in self._closing:
                self._closing.discard(slot)
                return
            slots = self._slots.get(slot.client, [])
            if slot in slots:
                slots.remove(slot)
            if not slots:
                self._slots.pop(slot.client, None)

    def process_request(self, request, client_address) -> None:
        """Admit by the rule, then serve on a thread of its own (or close at once, counted)."""
        slot = _Slot(request, client_address, time.monotonic())
        decision, victim_held = self._admit(slot)
        if decision.refused:
            cap = (f"{self.limits.max_connections} connections open and none from an address holding "
                   "more than this one" if decision.refused == "refused" else
                   f"{self.limits.max_per_client} connections open from this address")
            self.tally.count(decision.refused, f"connection from {slot.client} refused: {cap}")
            self.shutdown_request(request)
            return
        if decision.evict is not None:
            self.tally.count("evicted", f"all {self.limits.max_connections} connections were taken: the "
                                        f"oldest of {decision.evict}'s {victim_held} was closed to let "
                                        f"{slot.client} in")
        thread = threading.Thread(target=self._serve, args=(slot,), daemon=True)
        try:
            thread.start()
        except Exception:
            self._release(slot)
            self.shutdown_request(request)
            raise

    def _serve(self, slot: _Slot) -> None:
        """ThreadingMixIn's per-connection thread, with the slot released before the socket is
        closed (see ``_admit``)."""
        try:
            self.finish_request(slot.sock, slot.address)
        except Exception:
            self.handle_error(slot.sock, slot.address)
        finally:
            self._release(slot)
            self.shutdown_request(slot.sock)

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

    @property
    def held(self) -> dict[str, int]:
        """Connections held per client address now ({} before ``start()``)."""
        return self._httpd.held if self._httpd is not None else {}

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
