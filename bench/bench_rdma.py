"""CPU per scrape for InfiniBand/RoCE ports: the agent against node_exporter, on one sysfs tree.

    .venv/bin/python -m bench.bench_rdma [--scrapes 200]

The tree is the test suite's DGX H100-style node (``tests/support/rdma_tree.py``: 8 NDR InfiniBand
ports, 2 RoCE ports, 516 of the agent's series). Debian's ``prometheus-node-exporter`` runs with
only its infiniband collector on it (``--path.sysfs``), and each round the traffic and error
counters of every port move, as under a job; then:

- node_exporter is scraped (it reads sysfs on every scrape): its process's CPU from /proc;
- the agent does what it does for one scrape when it reads sysfs once per scrape: one RDMA
  collection (``RdmaSource.collect``), the classifier's observation of it (the port rules) and the
  exposition Prometheus negotiates (OpenMetrics), in this process, CPU from ``time.process_time``.
  The agent's own interval is 10 s and a scrape usually 15-30 s, so a real scrape costs less than
  this: the figure is the agent's read-judge-render path per reading.

Printed: CPU per scrape for each, the ratio (target: within 1.5x), and the agent's parts. On this
tree of regular files the agent opens and closes each file as node_exporter does; on a node's real
sysfs it holds them open and reads each with one ``pread`` (``bench.bench_node_exporter`` measures
that on real kernfs attributes).
"""

from __future__ import annotations

import argparse
import gzip
import logging
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.exposition import choose_encoder

from bench.common import PROMETHEUS_ACCEPT, machine, table
from healthagent.model import AgentSnapshot, Collection
from healthagent.policy.catalog import load_catalog
from healthagent.policy.classify import Classifier
from healthagent.policy.settings import Policy
from healthagent.sources.rdma import RdmaSource
from healthagent.telemetry.metrics import Telemetry
from tests.support.live_agent import proc_cpu_seconds
from tests.support.node_exporter import InfinibandExporter
from tests.support.rdma_tree import build_rdma_tree


def scrape(port: int) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        body = reply.read()
        return len(gzip.decompress(body) if reply.headers.get("Content-Encoding") == "gzip" else body)


def traffic(tree, step: int) -> None:
    for spec in tree.ports:
        tree.bump(spec.device, "port_xmit_data", 2_500_000_000 + step)
        tree.bump(spec.device, "port_rcv_data", 2_400_000_000 + step)
        tree.bump(spec.device, "port_xmit_packets", 600_000)
        tree.bump(spec.device, "port_rcv_packets", 590_000)
        tree.bump(spec.device, "port_xmit_wait", 1_000 + step % 7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    print(machine())
    encoder, _ = choose_encoder(PROMETHEUS_ACCEPT)
    with tempfile.TemporaryDirectory(prefix="bench-rdma-") as tmp:
        tree = build_rdma_tree(Path(tmp) / "host")
        exporter = InfinibandExporter(Path(tmp) / "host" / "sys", Path(tmp) / "node_exporter.log")
        source = RdmaSource(str(Path(tmp) / "host"))
        classifier = Classifier(Policy(), load_catalog(Policy()))
        telemetry = Telemetry("bench")
        parts: dict[str, list[float]] = {"collect": [], "classify": [], "render": []}
        ne_cpu: list[float] = []
        ne_bytes = ag_bytes = 0
        try:
            for step in range(args.scrapes + 5):  # the first 5 warm both up
                traffic(tree, step)
                before = proc_cpu_seconds(exporter.server.process.pid)
                size = scrape(exporter.port)
                ne = proc_cpu_seconds(exporter.server.process.pid) - before
                now = 1_700_000_000.0 + 10 * step
                t0 = time.process_time()
                result = source.collect(now)
                t1 = time.process_time()
                classifier.observe(Collection(timestamp=now, rdma=result.rdma, health=(result.health,)))
                t2 = time.process_time()
                telemetry.publish(AgentSnapshot(timestamp=now, rdma=result.rdma, health=(result.health,)))
                body = telemetry.exposition(encoder, "")
                t3 = time.process_time()
                if step >= 5:
                    ne_cpu.append(ne)
                    ne_bytes += size
                    ag_bytes += len(body)
                    for name, spent in (("collect", t1 - t0), ("classify", t2 - t1), ("render", t3 - t2)):
                        parts[name].append(spent)
                time.sleep(0.05)  # node_exporter's CPU ticks (10 ms) land in the right round on average
        finally:
            exporter.stop()
            source.close()
    n = args.scrapes
    ne_mean = sum(ne_cpu) / n
    ag = {name: sum(values) / n for name, values in parts.items()}
    ag_total = sum(ag.values())
    print(f"{n} scrapes, the counters of every port moved before each; 8 InfiniBand + 2 RoCE ports")
    print(table(["per scrape", "node_exporter", "healthagent", "healthagent / node_exporter"], [
        ["CPU (read sysfs, judge, render)", f"{ne_mean * 1000:.2f} ms", f"{ag_total * 1000:.2f} ms",
         f"{ag_total / ne_mean:.2f}x"],
        ["bytes uncompressed", f"{ne_bytes // n:,}", f"{ag_bytes // n:,}", ""],
    ]))
    print(table(["agent part", "mean CPU", "median CPU"], [
        [name, f"{ag[name] * 1000:.2f} ms", f"{statistics.median(parts[name]) * 1000:.2f} ms"] for name in parts]))


if __name__ == "__main__":
    main()
