"""Test harness for the telemetry tests: a real AgentServer on 127.0.0.1 with its own registry,
injected clocks (polling lives in tests/support/wait.py)."""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request
from dataclasses import dataclass

from healthagent.telemetry.metrics import Telemetry
from healthagent.telemetry.server import AgentServer
from healthagent.telemetry.training_intake import TrainingIntake


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
        return f"http://127.0.0.1:{self.server.port}"

    def request(self, path: str, *, method: str = "GET", body: bytes | None = None,
                headers: dict | None = None) -> Reply:
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as reply:
                data = reply.read()
                status, reply_headers = reply.status, dict(reply.headers)
        except urllib.error.HTTPError as exc:
            data, status, reply_headers = exc.read(), exc.code, dict(exc.headers)
        if reply_headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        return Reply(status, reply_headers, data)

    def post_json(self, body: bytes | str, content_type: str = "application/json") -> Reply:
        data = body.encode() if isinstance(body, str) else body
        return self.request("/v1/training", method="POST", body=data,
                            headers={"Content-Type": content_type})

    def scrape(self, accept: str | None = None) -> Reply:
        return self.request("/metrics", headers={"Accept": accept} if accept else {})


def start_agent(port: int = 0, **server_options) -> RunningAgent:
    clock, monotonic = FakeClock(), FakeClock(1000.0)
    telemetry = Telemetry("9.9.9")
    intake = TrainingIntake(max_jobs=4, idle_seconds=3600.0, clock=clock)
    telemetry.registry.register(intake)
    server = AgentServer(telemetry, intake, "127.0.0.1", port, monotonic=monotonic, **server_options)
    server.start()
    return RunningAgent(telemetry, intake, server, clock, monotonic)
