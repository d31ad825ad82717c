"""Test harness for the telemetry tests: a real AgentServer on 127.0.0.1 (the agent's port and the
training intake's, both free ports) with its own registry, injected clocks (polling lives in
tests/support/wait.py)."""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterator

import pytest

from healthagent.training.access import IntakeAccess
from healthagent.telemetry.metrics import Telemetry
from healthagent.telemetry.server import AgentServer
from healthagent.training.intake import TrainingIntake


class FakeClock:
    """A settable clock (time.time / time.monotonic shape) so tests inject time, never sleep."""

    def __init__(self, now: float = 1_760_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()


@dataclass
class RunningAgent:
    telemetry: Telemetry
    intake: TrainingIntake
    server: AgentServer
    clock: FakeClock
    monotonic: FakeClock

    @property
    def url(self) -> str:
        """The agent's own port: /metrics, /healthz, /readyz."""
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def intake_url(self) -> str:
        """The training intake's port (POST /v1/training)."""
        return f"http://127.0.0.1:{self.server.intake_port}"

    def request(self, path: str, *, method: str = "GET", body: bytes | None = None,
                headers: dict | None = None, base: str | None = None) -> Reply:
        req = urllib.request.Request((base or self.url) + path, data=body, method=method,
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as reply:
                data = reply.read()
                status, reply_headers = reply.status, dict(reply.headers)
        except urllib.error.HTTPError as exc:
            data, status, reply_headers = exc.read(), exc.code, dict(exc.headers)
        if reply_headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        return Reply(status, reply_headers, data)

    def post_json(self, body: bytes | str, content_type: str = "application/json",
                  token: str | None = None) -> Reply:
        data = body.encode() if isinstance(body, str) else body
        headers = {"Content-Type": content_type}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return self.request("/v1/training", method="POST", body=data, headers=headers, base=self.intake_url)

    def scrape(self, accept: str | None = None) -> Reply:
        return self.request("/metrics", headers={"Accept": accept} if accept else {})


def start_agent(port: int = 0, *, intake_port: int = 0, intake: str = "open", key: str = "",
                **server_options) -> RunningAgent:
    """Both listeners on loopback (port 0: a free one); ``intake``/``key``: the intake's mode and
    training key (open by default here, so a test about reports need not carry a token)."""
    clock, monotonic = FakeClock(), FakeClock(1000.0)
    telemetry = Telemetry("9.9.9")
    training = TrainingIntake(max_jobs=4, idle_seconds=3600.0, clock=clock)
    telemetry.registry.register(training)
    server = AgentServer(telemetry, training, "127.0.0.1", port, intake_listen=("127.0.0.1", intake_port),
                         access=IntakeAccess(intake, key), monotonic=monotonic, **server_options)
    server.start()
    return RunningAgent(telemetry, training, server, clock, monotonic)


@pytest.fixture
def agent() -> "Iterator[RunningAgent]":
    """An agent serving /metrics and the intake on free loopback ports (imported by conftests)."""
    running = start_agent()
    yield running
    running.server.stop()
