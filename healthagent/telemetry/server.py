"""The agent's HTTP endpoints, on two listeners that never share fate.

- **The agent's own port** (``listen``, default ``0.0.0.0:9410``): ``/metrics``, ``/healthz`` and
  ``/readyz``. In the DaemonSet this is the pod's own port, without a hostPort: the kubelet
  probes it and Prometheus scrapes it at the pod's IP.
- **The training intake** (``training_listen``, default listen's port + 2: 9412): ``POST /v1/training`` only.
  It is the one port on the node's IP (a hostPort), because training ranks on the node report to
  it; every pod that reaches the node can connect to it.

Each listener has its own socket, thread and connection slots, a deadline for each whole request
and caps per client address (``http_listener.py``), so a flood of slow clients on the intake
cannot delay a probe or a scrape: the kubelet does not restart a healthy agent because a pod
misbehaves. On the agent's own port a flood from many addresses cannot starve them either: when
every slot is taken, an address holding fewer slots takes the oldest slot of the address
holding the most, so the kubelet's and Prometheus' addresses, holding none, always get in. The intake checks the request's credential (``training/access.py``) from the
headers, before it parses the body; it answers everything else with 404.

``/healthz`` is the liveness probe: 200 while the loop's heartbeat is recent, 503 (with why) when
the loop has not completed a cycle for ``heartbeat_timeout_seconds`` (a generous multiple of the
poll interval: a stuck loop, which a restart fixes; a hung NVML/EFA/dcgm call does not stop the
loop, it runs under a deadline, ``sources.base.DeadlineSource``). ``/readyz`` is 200 once
the agent says it is ready (a cycle ran and Kubernetes was reached, or dry-run).
"""

from __future__ import annotations

import gzip
import json
import logging
import time
from typing import Callable

from prometheus_client.exposition import choose_encoder, gzip_accepted

from healthagent.common import ErrorTally
from healthagent.telemetry.http_listener import Handler, Limits, Listener
from healthagent.training.access import IntakeAccess, Refusal
from healthagent.telemetry.metrics import Telemetry
from healthagent.training.intake import IntakeReply, TrainingIntake
from healthagent.training.throttle import FailureThrottle

log = logging.getLogger(__name__)

TRAINING_PATH = "/v1/training"
MAX_BODY_BYTES = 64 * 1024
DISCARD_LIMIT_BYTES = 1024 * 1024  # a larger body is not read at all; the connection is closed
# The agent's port: the kubelet (three probes) and one or two Prometheus replicas.
AGENT_LIMITS = Limits(max_connections=32, max_per_client=8, deadline_seconds=5.0)
# The intake: a node's ranks (each client holds at most one request in flight) and nobody else.
INTAKE_LIMITS = Limits(max_connections=64, max_per_client=16, deadline_seconds=5.0)
_TEXT = "text/plain; charset=utf-8"
_AGENT_ROUTES = {"/metrics": ("GET",), "/healthz": ("GET",), "/readyz": ("GET",)}


def render_metrics(telemetry: Telemetry, accept: str, accept_encoding: str) -> tuple[bytes, str, dict[str, str]]:
    """The ``/metrics`` reply for these request headers: (body, content type, extra headers).

    The one place that encodes the exposition, so the encoder behind it can change without
    touching the HTTP layer.
    """
    encoder, content_type = choose_encoder(accept)
    body = telemetry.exposition(encoder, content_type)
    headers: dict[str, str] = {}
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    return body, content_type, headers


class ListenError(OSError):
    """A listener could not bind. ``setting`` names which one (``listen`` or ``training_listen``),
    so the error can name the port actually in use and the flag that moves it."""

    def __init__(self, setting: str, host: str, port: int, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.setting = setting
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class AgentServer:
    """Both listeners; ``start()`` binds them (port 0 picks a free port, see ``.port`` and
    ``.intake_port``). No intake listener when ``intake`` or ``intake_listen`` is None."""

    def __init__(self, telemetry: Telemetry, intake: TrainingIntake | None, host: str, port: int, *,
                 intake_listen: tuple[str, int] | None = None, access: IntakeAccess | None = None,
                 heartbeat_timeout_seconds: float = 60.0, max_body_bytes: int = MAX_BODY_BYTES,
                 agent_limits: Limits = AGENT_LIMITS, intake_limits: Limits = INTAKE_LIMITS,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.telemetry = telemetry
        self.intake = intake
        self.access = access if access is not None else IntakeAccess()  # closed without a key
        self.throttle = FailureThrottle(clock=monotonic)  # failed credentials, per client address
        self.heartbeat_timeout_seconds = float(heartbeat_timeout_seconds)
        self.max_body_bytes = int(max_body_bytes)
        self._monotonic = monotonic
        self._started_at = monotonic()
        self._last_beat: float | None = None
        self._ready = False
        self._tally = ErrorTally("http")
        self._intake_tally = ErrorTally("http_intake")
        self._agent = Listener("agent", host, port, _AgentHandler, self, agent_limits, self._tally)
        self._intake: Listener | None = None
        if intake is not None and intake_listen is not None:
            self._intake = Listener("training_intake", intake_listen[0], intake_listen[1], _IntakeHandler,
                                    self, intake_limits, self._intake_tally)

    @property
    def port(self) -> int:
        """The agent's own port (``/metrics``, ``/healthz``, ``/readyz``)."""
        return self._agent.port

    @property
    def intake_port(self) -> int | None:
        """The training intake's port, None when it has no listener."""
        return self._intake.port if self._intake is not None else None

    def held(self) -> dict[str, dict[str, int]]:
        """Connections held per client address now, by listener (``agent``, ``intake``)."""
        held = {"agent": self._agent.held}
        if self._intake is not None:
            held["intake"] = self._intake.held
        return held

    def start(self) -> None:
        """Bind and serve both listeners; if the intake cannot bind, the agent's port is closed
        again (the caller reports the error and stops). A bind that fails raises ``ListenError``
        naming the listener."""
        self._started_at = self._monotonic()
        try:
            self._agent.start()
        except OSError as exc:
            raise ListenError("listen", self._agent.host, self._agent.requested_port, exc) from exc
        if self._intake is None:
            return
        try:
            self._intake.start()
        except Exception as exc:
            self._agent.stop()
            if isinstance(exc, OSError):
                raise ListenError("training_listen", self._intake.host, self._intake.requested_port, exc) from exc
            raise
        level, note = self.access.startup_note()
        getattr(log, level)(note)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop both listeners. Safe to call twice."""
        if self._intake is not None:
            self._intake.stop(timeout)
        self._agent.stop(timeout)

    @property
    def errors(self) -> dict[str, int]:
        """Cumulative failures by kind: ``refused`` (connection cap), ``refused_per_client`` (one
        address's cap), ``evicted`` (a connection closed to let in an address holding fewer),
        ``deadline`` (a request too slow), ``handler`` (a 500); the intake's listener's with the
        prefix ``intake_``."""
        counts = self._tally.snapshot()
        counts.update({f"intake_{kind}": n for kind, n in self._intake_tally.snapshot().items()})
        return counts

    def count_error(self, kind: str, message: str) -> None:
        """Count a failure of the agent's own port by kind (the listeners count their own)."""
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

    def readiness(self) -> tuple[bool, str]:
        if self._ready:
            return True, "ready"
        return False, ("not ready: the loop has not completed its first cycle, or Kubernetes is "
                       "unreachable (see healthagent_kube_reachable)")


class _AgentHandler(Handler):
    """The agent's own port: metrics and probes, GET only."""

    def route(self, method: str, path: str) -> None:
        agent: AgentServer = self.server.context
        allowed = _AGENT_ROUTES.get(path)
        if allowed is None:
            where = (f"POST it to port {agent.intake_port}, the training intake's own port"
                     if agent.intake_port is not None else "the training intake is off on this agent")
            hint = f"; {where}" if path == TRAINING_PATH else ""
            self.send(404, _TEXT, f"not found: {path}; this port serves /metrics, /healthz and "
                                  f"/readyz{hint}\n".encode())
        elif method not in allowed:
            self.send(405, _TEXT, f"{method} not allowed on {path}\n".encode(), {"Allow": ", ".join(allowed)})
        elif path == "/metrics":
            body, content_type, headers = render_metrics(agent.telemetry, self.headers.get("Accept", ""),
                                                         self.headers.get("Accept-Encoding", ""))
            self.send(200, content_type, body, headers)
        elif path == "/healthz":
            self._probe(agent.health())
        else:
            self._probe(agent.readiness())

    def _probe(self, result: tuple[bool, str]) -> None:
        ok, why = result
        self.send(200 if ok else 503, _TEXT, (why + "\n").encode())


class _IntakeHandler(Handler):
    """The training intake's port: ``POST /v1/training`` and nothing else."""

    def route(self, method: str, path: str) -> None:
        if path != TRAINING_PATH:
            self.send(404, _TEXT, f"not found: {path}; this port serves only POST {TRAINING_PATH} "
                                  "(metrics and probes are on the agent's own port)\n".encode())
        elif method != "POST":
            self.send(405, _TEXT, f"{method} not allowed on {path}\n".encode(), {"Allow": "POST"})
        else:
            self._training()

    def _training(self) -> None:
        agent: AgentServer = self.server.context
        intake = agent.intake
        address = str(self.client_address[0]) if self.client_address else ""
        wait = agent.throttle.retry_after(address)
        if wait > 0:  # too many failed credentials from this address: not even looked at
            self.close_connection = True
            self._reply(intake.reject("rate_limited", f"too many failed credentials from {address}; "
                                                      f"retry in {wait:.0f} s", 429),
                        {"Retry-After": str(max(1, round(wait)))})
            return
        grant = agent.access.check(self.headers.get("Authorization", ""))
        if isinstance(grant, Refusal):
            agent.throttle.failed(address)
            self._refuse(intake, grant, agent.max_body_bytes)
            return
        media_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            self._reply(intake.reject("content_type", f"Content-Type must be application/json, got "
                                                      f"{media_type or 'none'!r}", 415))
            return
        length = self._content_length()
        if length is None:
            self.close_connection = True
            self._reply(intake.reject("length_required", "a Content-Length header is required "
                                                         "(chunked bodies are not accepted)", 411))
            return
        if length > agent.max_body_bytes:
            self._discard(length, DISCARD_LIMIT_BYTES)
            self.close_connection = True
            self._reply(intake.reject("body_too_large", f"body of {length} bytes is over the "
                                                        f"{agent.max_body_bytes}-byte limit; send "
                                                        f"smaller batches", 413))
            return
        body = self.rfile.read(length)
        if len(body) < length:
            self._reply(intake.reject("malformed_json", f"body ended after {len(body)} of {length} bytes"))
            return
        self._reply(intake.submit(body, job=grant.job))

    def _refuse(self, intake: TrainingIntake, refusal: Refusal, max_body_bytes: int) -> None:
        """401 before the body is parsed. A body up to the size limit is drained unread first, so
        the client reads the 401 instead of a reset (closing a socket with unread input resets
        it); a larger one is not read at all."""
        length = self._content_length()
        if length is not None and length <= max_body_bytes:
            self._discard(length, max_body_bytes)
        self.close_connection = True
        self._reply(intake.reject("unauthorized", refusal.message, 401),
                    {"WWW-Authenticate": 'Bearer realm="healthagent training intake"'})

    def _content_length(self) -> int | None:
        text = (self.headers.get("Content-Length") or "").strip()
        return int(text) if text.isdigit() else None

    def _discard(self, length: int, limit: int) -> None:
        """Read and drop up to ``limit`` bytes of a body we will not use (within the deadline)."""
        remaining = min(length, limit)
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 64 * 1024))
            if not chunk:
                return
            remaining -= len(chunk)

    def _reply(self, reply: IntakeReply, headers: dict[str, str] | None = None) -> None:
        self.send(reply.status, "application/json", (json.dumps(reply.body) + "\n").encode(), headers)
