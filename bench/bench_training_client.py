"""Per-call latency of the training client's ``report_step`` with the agent down, slow and up.

    .venv/bin/python bench/bench_training_client.py [--calls 10000]

What a training loop pays per call is the figure that matters (the promise: never blocked for
anything like a millisecond). Each scenario makes ``--calls`` calls in a tight loop, timing each
with ``time.perf_counter_ns``, and prints p50 / p99 / max in microseconds plus where the reports
went. Scenarios use real servers on 127.0.0.1:
  down  nothing listens on the port (connection refused; the sender backs off)
  slow  a server that accepts and reads the request but never answers (the sender is stuck in a
        request until its timeout; the queue fills and reports are dropped)
  up    the agent's own HTTP server and training intake
and, as the floor for comparison, the same dict-and-put_nowait work with no client at all.

Read the max with care: CPython lets a runnable background thread keep the GIL for up to the
switch interval (``sys.getswitchinterval()``, 5 ms by default), and a busy machine preempts any
process; the no-client floor shows how much of the tail is the machine, not the client.
"""

from __future__ import annotations

import argparse
import queue
import socket
import sys
import threading
import time

from healthagent.training.access import IntakeAccess, job_token
from healthagent.telemetry.metrics import Telemetry
from healthagent.telemetry.server import AgentServer
from healthagent.training.client import INTAKE_PATH, TrainingReporter
from healthagent.training.intake import TrainingIntake


class NeverAnswers:
    """A real TCP server that accepts connections, reads the request and never writes a byte
    (a wedged agent). ``request_seen`` is set once a training POST arrived; the client tests use
    it to know the sender is stuck inside that request."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.listener.settimeout(0.2)
        self.connections: list[socket.socket] = []
        self.request_seen = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            self.connections.append(conn)
            conn.settimeout(10)
            try:
                if conn.recv(65536).startswith(b"POST " + INTAKE_PATH.encode()):
                    self.request_seen.set()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for conn in self.connections:
            conn.close()
        self.listener.close()


BENCH_KEY = "bench-training-key"  # the agent's training key; the reporter holds the job's token


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(url: str, calls: int) -> tuple[list[int], TrainingReporter]:
    reporter = TrainingReporter(job="bench", url=url, rank=0, world_size=8, timeout_seconds=1.0,
                                token=job_token(BENCH_KEY, "bench"))
    latencies = []
    for n in range(calls):
        started = time.perf_counter_ns()
        reporter.report_step(n, tokens=4096, samples=8, step_seconds=0.5)
        latencies.append(time.perf_counter_ns() - started)
    return latencies, reporter


def measure_floor(calls: int) -> list[int]:
    """The same per-call work (build the report dict, put_nowait) without any sender thread."""
    bounded: queue.Queue = queue.Queue(maxsize=10_000)
    latencies = []
    for n in range(calls):
        started = time.perf_counter_ns()
        try:
            bounded.put_nowait({"type": "step", "job": "bench", "rank": 0, "world_size": 8, "step": n,
                                "tokens": 4096, "samples": 8, "step_seconds": 0.5, "timestamp": time.time()})
        except queue.Full:
            pass
        latencies.append(time.perf_counter_ns() - started)
    return latencies


def row(name: str, latencies: list[int], stats=None) -> str:
    ordered = sorted(latencies)
    over = sum(1 for value in latencies if value > 1_000_000)
    text = (f"{name:<9} {percentile(ordered, 0.50):7.1f} {percentile(ordered, 0.99):7.1f} "
            f"{percentile(ordered, 0.999):8.1f} {ordered[-1] / 1000:9.1f} {over:6d}")
    if stats is not None:
        text += f"   {stats.delivered:9d} {stats.dropped:8d} {stats.pending:8d}"
    return text


def percentile(sorted_values: list[int], share: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(share * len(sorted_values)))] / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    args = parser.parse_args()

    telemetry = Telemetry("bench")
    intake = TrainingIntake()
    telemetry.registry.register(intake)
    agent = AgentServer(telemetry, intake, "127.0.0.1", 0, intake_listen=("127.0.0.1", 0),
                        access=IntakeAccess("token", BENCH_KEY))
    agent.start()
    slow = NeverAnswers()
    scenarios = {
        "down": f"http://127.0.0.1:{free_port()}",
        "slow": f"http://127.0.0.1:{slow.port}",
        "up": f"http://127.0.0.1:{agent.intake_port}",
    }
    print(f"report_step latency over {args.calls} calls, microseconds "
          f"(switch interval {sys.getswitchinterval() * 1000:.0f} ms)")
    print(f"{'agent':<9} {'p50':>7} {'p99':>7} {'p99.9':>8} {'max':>9} {'>1ms':>6}"
          f"   delivered  dropped  pending")
    try:
        print(row("no client", measure_floor(args.calls)))
        for name, url in scenarios.items():
            latencies, reporter = measure(url, args.calls)
            reporter.close(timeout=10.0 if name == "up" else 0.5)
            print(row(name, latencies, reporter.stats()))
    finally:
        slow.close()
        agent.stop()


if __name__ == "__main__":
    main()
