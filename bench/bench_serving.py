"""The agent's probes and scrape while a slow-client flood holds the training intake or the agent's
own port: p99 of each.

    .venv/bin/python -m bench.bench_serving [--clients 200] [--requests 300] [--before REF]
    .venv/bin/python -m bench.bench_serving --fairness [--probes 20]

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

``--fairness`` runs one scenario instead: 8 source addresses (127.0.0.2 .. 127.0.0.9, eight pods)
with 25 slow clients each on the agent's own port, which has 32 slots and 8 per address, plus
100 slow clients on the intake; then ``--probes`` GETs of ``/healthz`` and of ``/metrics`` from
another address (127.0.0.10, the kubelet's or Prometheus'), one at a time, each on a new
connection. It prints how many answered 200, how many within 2 s, and their latency.

``--before REF`` runs the flood and the intake load against the server of that git revision too
(``git show REF:healthagent/telemetry/server.py``, the single listener this design replaced, with
its shared token), so the two can be compared on the same machine in the same minute.
"""

from __future__ import annotations

import argparse
import http.client
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
from typing import Callable, Sequence

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


POD_ADDRESSES = tuple(f"127.0.0.{n}" for n in range(2, 10))  # eight pods flooding the agent's port
PROBE_ADDRESS = "127.0.0.10"  # the kubelet's or Prometheus' own address
FAIR_CLIENTS_PER_POD = 25
FAIR_INTAKE_CLIENTS = 100
FAIR_BOUND_SECONDS = 2.0


class SlowClients:
    """``count`` clients, each from its own address (or from ``addresses`` in turn: many clients of
    one pod), each sending ``request`` (``SLOW_REQUEST``) one byte per round and reconnecting
    whenever the server drops it: a slowloris attack that lasts until ``stop()`` (the tests hold
    the intake and the agent's port with it too)."""

    def __init__(self, port: int, count: int, seconds_per_byte: float = 0.2,
                 addresses: Sequence[str] = (), request: bytes = SLOW_REQUEST) -> None:
        self.port = port
        self.seconds_per_byte = seconds_per_byte
        self.addresses = tuple(addresses)
        self.request = request
        self.clients: list[tuple[socket.socket | None, int]] = [(self._connect(n), 0) for n in range(count)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, name="slow-clients", daemon=True)
        self._thread.start()

    def _connect(self, n: int) -> socket.socket | None:
        sock = socket.socket()
        try:
            sock.bind((self.addresses[n % len(self.addresses)] if self.addresses else client_address(n), 0))
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
                    sock.send(self.request[sent % len(self.request):][:1])
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


SLOW_GET = b"GET /healthz HTTP/1.1\r\nHost: agent\r\nX-Slow: " + b"x" * 64 + b"\r\n\r\n"


def get_from(source: str, port: int, path: str, timeout: float) -> tuple[float, bool]:
    """(seconds, answered 200) for one GET from the loopback address ``source``, a new connection."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        reply.read()
        ok = reply.status == 200
    except (OSError, http.client.HTTPException):
        ok = False
    finally:
        conn.close()
    return time.perf_counter() - started, ok


def pod_flood(agent_port: int, intake_port: int) -> tuple[SlowClients, SlowClients]:
    """8 pods x 25 slow clients on the agent's port and 100 slow clients on the intake."""
    agent = SlowClients(agent_port, len(POD_ADDRESSES) * FAIR_CLIENTS_PER_POD, addresses=POD_ADDRESSES,
                        request=SLOW_GET)
    return agent, SlowClients(intake_port, FAIR_INTAKE_CLIENTS)


def fairness(probes: int) -> list[list[object]]:
    """The pods' flood on both ports, then probes and scrapes from another address."""
    telemetry, intake = _telemetry()
    server = AgentServer(telemetry, intake, "127.0.0.1", 0, intake_listen=("127.0.0.1", 0),
                         access=IntakeAccess("token", KEY))
    server.start()
    flood = pod_flood(server.port, server.intake_port)
    try:
        deadline = time.monotonic() + 30
        while sum(server.held()["agent"].values()) < 32 and time.monotonic() < deadline:
            time.sleep(0.05)  # every slot of the agent's port taken before the first probe
        results = {path: [get_from(PROBE_ADDRESS, server.port, path, 10.0) for _ in range(probes)]
                   for path in ("/healthz", "/metrics")}
        held = server.held()["agent"]
    finally:
        for clients in flood:
            clients.stop()
        server.stop()
    rows = []
    for path, timings in results.items():
        within = sum(1 for seconds, ok in timings if ok and seconds <= FAIR_BOUND_SECONDS)
        rows.append(row("this tree", f"8 pods x 25 slow on the agent's port + {FAIR_INTAKE_CLIENTS} on the "
                                     f"intake; from {PROBE_ADDRESS}", path, timings)
                    + [f"{within}/{len(timings)}"])
    print(f"agent port slots held by the pods when the probes ended: {dict(sorted(held.items()))}")
    print(f"agent port errors: {server.errors}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200, help="slow clients holding the intake")
    parser.add_argument("--requests", type=int, default=300, help="requests per endpoint and scenario")
    parser.add_argument("--before", metavar="REF", help="also run the server of this git revision")
    parser.add_argument("--fairness", action="store_true",
                        help="only the pods' flood on the agent's port, probed from another address")
    parser.add_argument("--probes", type=int, default=20, help="probes and scrapes with --fairness")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    if args.fairness:
        print(table(["server", "scenario", "request", "n", "failed", "p50 ms", "p99 ms", "max ms", "ok/s",
                     f"200 within {FAIR_BOUND_SECONDS:g} s"], fairness(args.probes)))
        return
    rows = measure(current_server(), args.clients, args.requests, quiet=True)
    if args.before:
        rows += measure(server_of_revision(args.before), args.clients, args.requests, quiet=False)
    print(table(["server", "scenario", "request", "n", "failed", "p50 ms", "p99 ms", "max ms", "ok/s"], rows))


if __name__ == "__main__":
    main()
