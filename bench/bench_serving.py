"""The agent's probes and scrape while a slow-client flood holds the training intake: p99 of each.

    .venv/bin/python -m bench.bench_serving [--clients 200] [--requests 300] [--before REF]

Real servers on 127.0.0.1, the agent's ``AgentServer`` with the demo node's snapshot published
(what a scrape of a p5.48xlarge-shaped node renders) and the intake closed as on a cluster (a job
token opens it). Each figure is one request at a time with ``urllib``, a new connection each, as
the kubelet and Prometheus make them:

  quiet   ``/healthz`` and ``/metrics`` with nothing else going on;
  flood   the same while ``--clients`` slow clients hold the training intake: each from its own
          loopback address (127.0.x.y, as pods have their own IPs), sending a report one byte
          per 0.2 s and reconnecting whenever the agent drops it;
  intake  no flood; 50 clients at once post 2,000 reports (40 each) with a job token: how many
          fail (a reset connection, a refusal), the p50/p99 of those that succeed, and how many
          succeed per second of the whole load.

``--before REF`` runs the flood and the intake load against the server of that git revision too
(``git show REF:healthagent/telemetry/server.py``, the single listener this design replaced, with
its shared token), so the two can be compared on the same machine in the same minute.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import threading
import time
import types
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from bench.common import machine, percentile, table
from healthagent.training.access import IntakeAccess, job_token
from healthagent.telemetry.metrics import Telemetry
from healthagent.telemetry.server import AgentServer
from healthagent.training.intake import TrainingIntake
from tests.telemetry.snapshots import demo_snapshot

KEY = "bench-cluster-training-key-0123456789"
JOB = "bench-job"
SLOW_REQUEST = (b"POST /v1/training HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                b"Content-Length: 24\r\n\r\n{\"type\":\"end\",\"job\":\"j\"}")
INTAKE_CLIENTS = 50
INTAKE_REQUESTS = 2_000


def client_address(n: int) -> str:
    """The n-th slow client's own loopback address: 127.0.1.1, 127.0.1.2, ..."""
    return f"127.0.{1 + n // 250}.{1 + n % 250}"


class SlowClients:
    """``count`` clients, each from its own address, each sending ``SLOW_REQUEST`` one byte per
    round and reconnecting whenever the server drops it: a slowloris attack that lasts until
    ``stop()`` (the tests hold the intake with it too)."""

    def __init__(self, port: int, count: int, seconds_per_byte: float = 0.2) -> None:
        self.port = port
        self.seconds_per_byte = seconds_per_byte
        self.clients: list[tuple[socket.socket | None, int]] = [(self._connect(n), 0) for n in range(count)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, name="slow-clients", daemon=True)
        self._thread.start()

    def _connect(self, n: int) -> socket.socket | None:
        sock = socket.socket()
        try:
            sock.bind((client_address(n), 0))
            sock.settimeout(2)
            sock.connect(("127.0.0.1", self.port))
            return sock
        except OSError:
            sock.close()
            return None

    def _trickle(self) -> None:
        while not self._stop.wait(self.seconds_per_byte):
            for n, (sock, sent) in enumerate(self.clients):
                try:
                    if sock is None:
                        raise OSError("not connected")
                    sock.send(SLOW_REQUEST[sent % len(SLOW_REQUEST):][:1])
                    self.clients[n] = (sock, sent + 1)
                except OSError:
                    if sock is not None:
                        sock.close()
                    self.clients[n] = (self._connect(n), 0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock, _ in self.clients:
            if sock is not None:
                sock.close()


@dataclass
class Target:
    """A running server under test: where its probes and its intake are, and the intake's bearer."""

    name: str
    agent_url: str
    intake_port: int
    bearer: str
    stop: Callable[[], None]


def _telemetry() -> tuple[Telemetry, TrainingIntake]:
    telemetry = Telemetry("bench")
    intake = TrainingIntake()
    telemetry.registry.register(intake)
    telemetry.publish(demo_snapshot())
    return telemetry, intake


def current_server() -> Target:
    telemetry, intake = _telemetry()
    server = AgentServer(telemetry, intake, "127.0.0.1", 0, intake_listen=("127.0.0.1", 0),
                         access=IntakeAccess("token", KEY))
    server.start()
    return Target("two listeners (this tree)", f"http://127.0.0.1:{server.port}", server.intake_port,
                  job_token(KEY, JOB), server.stop)


def server_of_revision(ref: str) -> Target:
    """The AgentServer of git revision ``ref`` (one listener for everything), run in this process."""
    source = subprocess.run(["git", "show", f"{ref}:healthagent/telemetry/server.py"], capture_output=True,
                            text=True, check=True).stdout
    module = types.ModuleType(f"server_{ref}")
    exec(compile(source, f"{ref}:healthagent/telemetry/server.py", "exec"), module.__dict__)  # noqa: S102
    telemetry, intake = _telemetry()
    server = module.AgentServer(telemetry, intake, "127.0.0.1", 0, training_token=KEY)
    server.start()
    url = f"http://127.0.0.1:{server.port}"
    return Target(f"one listener ({ref})", url, server.port, KEY, server.stop)


def timed(request: urllib.request.Request | str, expected: int) -> tuple[float, bool]:
    """(seconds, answered with ``expected``) for one request on a new connection; a refusal, a
    reset or another status is a failure."""
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()
            ok = reply.status == expected
    except Exception:
        ok = False
    return time.perf_counter() - started, ok


def timed_get(url: str) -> tuple[float, bool]:
    return timed(url, 200)


def timed_post(url: str, bearer: str) -> tuple[float, bool]:
    body = json.dumps({"type": "end", "job": JOB}).encode()
    return timed(urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {bearer}"}), 202)


def row(server: str, scenario: str, what: str, results: list[tuple[float, bool]],
        wall_seconds: float | None = None) -> list[object]:
    good = [seconds for seconds, ok in results if ok]
    failed = len(results) - len(good)

    def fmt(share: float) -> str:
        return f"{percentile(good, share) * 1000:.1f}" if good else "-"

    return [server, scenario, what, len(results), failed, fmt(0.5), fmt(0.99),
            f"{max(good) * 1000:.1f}" if good else "-",
            f"{len(good) / wall_seconds:.0f}" if wall_seconds else "-"]


def probes(target: Target, requests: int) -> dict[str, list[tuple[float, bool]]]:
    results: dict[str, list[tuple[float, bool]]] = {"/healthz": [], "/metrics": []}
    for _ in range(requests):
        for path in results:
            results[path].append(timed_get(target.agent_url + path))
    return results


def intake_load(target: Target) -> tuple[list[tuple[float, bool]], float]:
    """Every report's (seconds, accepted) and the wall time of the whole load."""
    url = f"http://127.0.0.1:{target.intake_port}/v1/training"
    started = time.perf_counter()
    with ThreadPoolExecutor(INTAKE_CLIENTS) as pool:
        results = list(pool.map(lambda _: timed_post(url, target.bearer), range(INTAKE_REQUESTS)))
    return results, time.perf_counter() - started


def measure(target: Target, clients: int, requests: int, quiet: bool) -> list[list[object]]:
    rows = []
    try:
        if quiet:
            for path, results in probes(target, requests).items():
                rows.append(row(target.name, "quiet", path, results))
        flood = SlowClients(target.intake_port, clients)
        try:
            time.sleep(2.0)  # every slot taken before the first probe
            for path, results in probes(target, requests).items():
                rows.append(row(target.name, f"flood ({clients} slow clients)", path, results))
        finally:
            flood.stop()
        time.sleep(6.0)  # the slow clients' last connections run out their deadline
        rows.append(row(target.name, f"{INTAKE_CLIENTS} clients at once", "POST /v1/training",
                        *intake_load(target)))
    finally:
        target.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200, help="slow clients holding the intake")
    parser.add_argument("--requests", type=int, default=300, help="requests per endpoint and scenario")
    parser.add_argument("--before", metavar="REF", help="also run the server of this git revision")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rows = measure(current_server(), args.clients, args.requests, quiet=True)
    if args.before:
        rows += measure(server_of_revision(args.before), args.clients, args.requests, quiet=False)
    print(table(["server", "scenario", "request", "n", "failed", "p50 ms", "p99 ms", "max ms", "ok/s"], rows))


if __name__ == "__main__":
    main()
