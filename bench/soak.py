"""Soak: the agent on the demo node for a long time, with moving counters and injected faults.

    .venv/bin/python -m bench.soak [--minutes 60] [--fault-every 60] [--sample-every 30] [--dry-run]

Not part of CI (it runs for as long as you ask). ``healthagent run`` (default settings, NVML through
the stub library) runs on the demo node and writes to the fake API server through the kubernetes
client (``--dry-run``: no API server). Every 10 s the EFA traffic counters of all 32 devices and
two NVML fields move. Every ``--fault-every`` seconds one fault is injected, in turn:
  an XID 95 in the kernel log and through NVML (replace_node: taint, Event) and, one period later,
  an operator's clear annotation on the node (the agent untaints), an XID 13 through NVML only,
  5,000 rx_drops on one EFA device, and a 20,000-line kernel-log flood with ten XIDs in it.
Every ``--sample-every`` seconds it records the agent's RSS and CPU time. At the end it prints the
samples, the RSS growth after the first ten minutes (or the first half of a shorter soak) as a
least-squares slope in MiB per hour, the CPU share, and whether every injected XID was counted.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from bench.bench_footprint import move_counters
from bench.common import machine, mib, table
from tests.support.floods import append_flood
from tests.support.live_agent import AgentProcess, HoldingKubeFake, write_kubeconfig

NODE = "gpu-node-0"
COUNTER_PERIOD = 10.0


def slope_mib_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, KiB) points, in MiB per hour."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var * 3600 / 1024


class Faults:
    """The injections, in turn; counts the XIDs it put in so the end can check none was lost."""

    def __init__(self, demo, fake) -> None:
        self.demo = demo
        self.fake = fake
        self.step = 0
        self.xids = 0
        self.log: list[str] = []

    def next(self) -> None:
        from healthagent.demo import stub_nvml
        from healthagent.effects.node_desired import CLEAR_ANNOTATION

        kind = self.step % 5
        if kind == 0:
            self.demo.inject_xid(self.step % 8, 95, via="both")  # one fault, two reporters: counted once
            self.xids += 1
            self.log.append("XID 95 (kernel log + NVML)")
        elif kind == 1:
            if self.fake is not None:
                token = f"soak-{self.step}"
                self.fake.update_node(NODE, lambda n: n["metadata"].setdefault("annotations", {}).update(
                    {CLEAR_ANNOTATION: token}))
            self.log.append("operator clear")
        elif kind == 2:
            stub_nvml.inject_xid(self.demo.scenario, self.step % 8, 13)
            self.xids += 1
            self.log.append("XID 13 (NVML)")
        elif kind == 3:
            self.demo.bump_efa_counter(self.demo.efa_devices[self.step % 32], "rx_drops", 5000)
            self.log.append("5,000 rx_drops")
        else:
            flood = append_flood(self.demo.kernel_log, self.demo.gpu_pci_bus_ids, 20_000, 2_000)
            self.xids += flood.xids
            self.log.append(f"20,000-line flood, {flood.xids} XIDs")
        self.step += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--fault-every", type=float, default=60.0)
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--dry-run", action="store_true", help="no API server: Kubernetes in dry-run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import stub_nvml_env

    print(f"soak for {args.minutes:g} min, a fault every {args.fault_every:g} s; {machine()}")
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        work = Path(tmp)
        demo = build_demo_root(work / "root")
        fake = None if args.dry_run else HoldingKubeFake().start()
        try:
            if fake is not None:
                fake.seed_nodes(20)
                kube = dict(kube="kubeconfig", kubeconfig=write_kubeconfig(fake.url, work / "kubeconfig"))
            else:
                kube = dict(kube="dry-run")
            agent = AgentProcess(dict(host_root=demo.root, node_name=NODE, state_file=work / "state.json",
                                      expected_gpus=8, expected_efa_devices=32, log_level="WARNING", **kube),
                                 work / "agent.log", env=stub_nvml_env(demo.scenario, work / "cache" / "healthagent"))
            faults = Faults(demo, fake)
            try:
                agent.wait_metric(lambda s: s.value("healthagent_efa_devices") == 32, what="a first cycle")
                samples = run(agent, demo, faults, args)
                final = agent.wait_metric(lambda s: s.total("healthagent_xid_errors_total") >= faults.xids,
                                          timeout=120, what="every injected XID counted")
                counted = final.total("healthagent_xid_errors_total")
                alive = agent.proc.poll() is None
            finally:
                agent.close()
            report(samples, args, faults, counted, alive, fake)
        finally:
            if fake is not None:
                fake.stop()


def run(agent: AgentProcess, demo, faults: Faults, args) -> list[tuple[float, int, int, float]]:
    """(seconds, RSS KiB, peak KiB, CPU seconds) every ``sample_every``."""
    started = time.monotonic()
    end = started + args.minutes * 60
    next_counters = next_fault = next_sample = started
    samples = []
    step = 0
    while (now := time.monotonic()) < end:
        if now >= next_counters:
            move_counters(demo, step)
            step += 1
            next_counters += COUNTER_PERIOD
        if now >= next_fault:
            faults.next()
            next_fault += args.fault_every
        if now >= next_sample:
            samples.append((now - started, agent.rss_kib(), agent.hwm_kib(), agent.cpu_seconds()))
            next_sample += args.sample_every
        time.sleep(max(0.0, min(next_counters, next_fault, next_sample, end) - time.monotonic()))
    samples.append((time.monotonic() - started, agent.rss_kib(), agent.hwm_kib(), agent.cpu_seconds()))
    return samples


def report(samples, args, faults: Faults, counted: float, alive: bool, fake) -> None:
    every = max(1, len(samples) // 20)
    print(table(["t (s)", "RSS", "peak RSS", "CPU s"],
                [[f"{t:.0f}", mib(rss), mib(peak), f"{cpu:.1f}"] for t, rss, peak, cpu in samples[::every]]))
    warm = min(600.0, samples[-1][0] / 2)
    after_warm = [(t, rss) for t, rss, _, _ in samples if t >= warm]
    cpu = (samples[-1][3] - samples[0][3]) / max(1e-9, samples[-1][0] - samples[0][0])
    print(table(["figure", "value"], [
        ["RSS at the first sample / at the end", f"{mib(samples[0][1])} / {mib(samples[-1][1])}"],
        ["peak RSS", mib(max(p for _, _, p, _ in samples))],
        [f"RSS slope after {warm:.0f} s (least squares)", f"{slope_mib_per_hour(after_warm):+.2f} MiB/hour"],
        ["CPU (process time / wall)", f"{100 * cpu:.2f}% of one core"],
        ["faults injected", f"{len(faults.log)} ({', '.join(sorted(set(faults.log)))})"],
        ["XIDs injected / counted", f"{faults.xids} / {counted:.0f}"],
        ["API requests (fake server)", len(fake.requests()) if fake is not None else "dry-run"],
        ["agent still running", alive],
    ]))


if __name__ == "__main__":
    main()
