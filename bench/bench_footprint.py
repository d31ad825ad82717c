"""Footprint of the agent on the demo node: memory, CPU, cycle time, /metrics render time, series.

    .venv/bin/python -m bench.bench_footprint [--intervals 360] [--real-seconds 300] [--parts 1,2]
                                              [--agents nvml,no-nvml,kube]

The demo node is a p5.48xlarge-shaped host root: 8 x H100 through the stub NVML library, 32 EFA
devices in sysfs, a /dev/kmsg-format kernel log. Two parts:

1. an hour in fast-forward (in a child process: the agent and the counter moves, nothing else): the real ``Agent`` with
   its real sources on a simulated clock, ``--intervals`` 10 s intervals back to back (360 = one
   hour). Each interval: the EFA traffic counters of every device and two NVML fields move, one full
   cycle runs (kernel log + NVML + EFA, classify, save state; after the first, the warm objects are
   frozen as ``healthagent run`` freezes them, ``agent.freeze_warm_objects``), then ``KMSG_WAKES`` kernel-log-only
   cycles (what each wake-up by a write to the kernel log costs; an idle node has none: the loop
   sleeps until the next collection), then one /metrics render as Prometheus asks for it (its own
   Accept header, which selects OpenMetrics, and gzip, as the server sends it), and one in text
   0.0.4. It reports RSS after the first interval, after 36 (six minutes) and at the end, the peak
   (VmHWM), the median and p99 of a full cycle and of a kernel-log-only cycle (wall time, and the
   process's CPU time: the periodic sources run on worker threads under a deadline, so the loop
   thread's own time would miss them), the classification's share of a full cycle, a floor (the
   EFA files alone opened, read, closed and parsed in a bare loop, in the state the cycle found
   them: each replaced again with the same value first) and the NVML library calls one
   collection makes, /metrics render times (the first render of a new
   snapshot, and a repeat) and the series count. The process also holds this script's own work
   (moving counters), so its RSS is an upper bound; the soak script (``bench/soak.py``) measures
   the agent alone over real hours. No CPU share is computed from these warm loops: back to back
   they flatter the caches; part 2 measures it.
2. the real agent on the wall clock: ``healthagent run`` (default settings, Kubernetes in dry-run)
   for ``--real-seconds`` (default 300) while the counters move every 10 s and a scraper asks for
   /metrics every 15 s as Prometheus does; its process CPU time (from /proc) over the wall time,
   its RSS. Run with the stub NVML, with ``--no-nvml``, and a third time writing to the fake API
   server through the ``kubernetes`` client, as in a cluster (that library's share of the RSS);
   ``--agents`` picks which. ``--parts 2`` runs part 2 alone (e.g. in a worktree of older code, to
   compare its CPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_node_exporter import fetch
from bench.common import PROMETHEUS_ACCEPT, machine, median, mib, percentile, table
from tests.support.live_agent import AgentProcess, HoldingKubeFake, Scrape, proc_status_kib, write_kubeconfig

INTERVAL = 10.0
POLL = 0.1
KMSG_WAKES = 10  # kernel-log-only cycles measured per interval (wake-ups by kernel-log writes)
SCRAPE_INTERVAL = 15.0  # a common Prometheus scrape interval
MOVING_COUNTERS = ("tx_bytes", "rx_bytes", "rdma_write_bytes", "rdma_write_recv_bytes")


class SimClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def move_counters(demo, step: int) -> None:
    """What two busy training minutes do to a node: traffic counters up, GPU temperature/power wiggle."""
    from healthagent.demo import stub_nvml

    for device in demo.efa_devices:
        for counter in MOVING_COUNTERS:
            demo.bump_efa_counter(device, counter, 2_700_000_000 * 10 + step)
    gpu = step % 8
    stub_nvml.set_gpu_field(demo.scenario, gpu, "temperature_c", 55 + step % 9)
    stub_nvml.set_gpu_field(demo.scenario, gpu, "power_mw", 610_000 + 1000 * (step % 50))


def efa_files(root: Path) -> list[str]:
    """Every file the EFA source reads on the demo node each collection: the counters in the
    device's and each port's ``hw_counters`` (not ``lifespan``, a cache setting), and each port's
    ``state`` and ``phys_state``."""
    from healthagent.model import EFA_NOT_COUNTERS

    def counters(directory: str) -> list[str]:
        return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n not in EFA_NOT_COUNTERS)

    class_dir = root / "sys" / "class" / "infiniband"
    paths = []
    for entry in sorted(os.listdir(class_dir)):
        device = os.path.realpath(class_dir / entry)
        paths += counters(os.path.join(device, "hw_counters"))
        for port in sorted(os.listdir(os.path.join(device, "ports"))):
            port_dir = os.path.join(device, "ports", port)
            paths += counters(os.path.join(port_dir, "hw_counters"))
            paths += [os.path.join(port_dir, "state"), os.path.join(port_dir, "phys_state")]
    return paths


def bare_reads(paths: list[str]) -> int:
    """The floor of an EFA collection on regular files: open, read, close and parse each file,
    nothing else (no device checks, no error handling, no samples). Returns the values parsed."""
    from healthagent.sources.efa import READ_LIMIT
    from healthagent.sources.sysfs_files import parse_counter

    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
    parsed = 0
    for path in paths:
        fd = os.open(path, flags)
        try:
            raw = os.read(fd, READ_LIMIT)
        finally:
            os.close(fd)
        parsed += parse_counter(raw) is not None
    return parsed


def nvml_calls_per_collection(source, now: float) -> int:
    """How many NVML library calls one collection of ``source`` makes (each one a ctypes call
    through pynvml): counted by wrapping pynvml's functions for that one collection."""
    import pynvml

    calls = 0
    originals = {name: fn for name, fn in vars(pynvml).items() if name.startswith("nvml") and callable(fn)}

    def counting(fn):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            return fn(*args, **kwargs)
        return call

    try:
        for name, fn in originals.items():
            setattr(pynvml, name, counting(fn))
        source.collect(now)
    finally:
        for name, fn in originals.items():
            setattr(pynvml, name, fn)
    return calls


def fast_forward(intervals: int, work: Path) -> dict:
    """Part 1, run in a child process; returns the figures as a dict."""
    import gzip

    from prometheus_client.exposition import choose_encoder

    from healthagent.agent import freeze_warm_objects
    from healthagent.config import load_settings
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import use_stub_nvml
    from healthagent.wiring import AgentRuntime

    demo = build_demo_root(work / "root")
    use_stub_nvml(demo.scenario)
    clock = SimClock(time.time())
    settings = load_settings(env={}, flags=dict(
        host_root=str(demo.root), kube="dry-run", node_name="demo-p5-node", listen="127.0.0.1:0",
        state_file=str(work / "state.json"), expected_gpus=8, expected_efa_devices=32, log_level="WARNING"))
    runtime = AgentRuntime(settings, clock=clock)
    agent = runtime.agent
    agent.start_effects()
    telemetry = runtime.telemetry

    full_wall, full_cpu, idle_wall, idle_cpu, classify, floor = [], [], [], [], [], []
    paths = efa_files(demo.root)
    observe = agent.classifier.observe

    observed: list[float] = []

    def timed_observe(collection):
        started = time.perf_counter()
        try:
            return observe(collection)
        finally:
            observed.append(time.perf_counter() - started)

    agent.classifier.observe = timed_observe
    render_first, render_repeat, render_text, sources = [], [], [], {"nvml": [], "efa": [], "kmsg": []}
    openmetrics, openmetrics_type = choose_encoder(PROMETHEUS_ACCEPT)
    text, text_type = choose_encoder("text/plain;version=0.0.4")

    def scrape(encoder, content_type) -> bytes:
        """What the server does for one scrape: render, then gzip at level 1."""
        body = telemetry.exposition(encoder, content_type)
        gzip.compress(body, compresslevel=1)
        return body

    rss = {}
    series = 0
    for step in range(intervals):
        move_counters(demo, step)
        clock.now += POLL
        for item in agent.scheduled:
            item.next_due = 0.0  # due: the simulated 10 s have passed
        started, started_cpu = time.perf_counter(), time.process_time()
        agent.cycle()
        full_wall.append(time.perf_counter() - started)
        full_cpu.append(time.process_time() - started_cpu)
        classify.extend(observed[-1:])  # the full cycle's own (kernel-log wakes with nothing new do not classify)
        observed.clear()
        for name in sources:
            sources[name].append(agent._health[name].duration_seconds)
        for item in agent.scheduled:
            item.next_due = float("inf")  # the rest of the interval: kernel log only
        for _ in range(KMSG_WAKES):
            clock.now += POLL
            started, started_cpu = time.perf_counter(), time.process_time()
            agent.cycle()
            idle_wall.append(time.perf_counter() - started)
            idle_cpu.append(time.process_time() - started_cpu)
        clock.now += INTERVAL - POLL * (KMSG_WAKES + 1)  # the rest of the 10 s: the histories' windows see real spacing
        # The floor, in the state the cycle found: the same values written again (the files
        # replaced as the cycle found them, nothing new for the agent), then the bare reads.
        move_counters(demo, step)
        started = time.perf_counter()
        bare_reads(paths)
        floor.append(time.perf_counter() - started)
        started = time.perf_counter()
        scrape(openmetrics, openmetrics_type)
        if step:  # the very first scrape encodes everything once; after that, only what changed
            render_first.append(time.perf_counter() - started)
        started = time.perf_counter()
        scrape(openmetrics, openmetrics_type)
        render_repeat.append(time.perf_counter() - started)
        agent.cycle()  # a fresh snapshot (the kernel-log cycle), so text renders new data too
        started = time.perf_counter()
        body = scrape(text, text_type)
        if step:
            render_text.append(time.perf_counter() - started)
        if step == 0:
            freeze_warm_objects()  # what the agent's loop does after its first cycle
            rss["first"] = proc_status_kib(os.getpid(), "VmRSS")
            series = Scrape(body.decode()).series()
        if step == min(35, intervals - 1):
            rss["six_minutes"] = proc_status_kib(os.getpid(), "VmRSS")
    rss["end"] = proc_status_kib(os.getpid(), "VmRSS")
    rss["peak"] = proc_status_kib(os.getpid(), "VmHWM")
    verdict = agent.verdict.action.value
    nvml = next(item.source.source for item in agent.scheduled if item.source.name == "nvml")
    nvml_calls = nvml_calls_per_collection(nvml, clock.now + INTERVAL)
    agent.shutdown(grace_seconds=5)
    return {"intervals": intervals, "rss_kib": rss, "series": series, "verdict": verdict,
            "full_wall": full_wall, "full_cpu": full_cpu, "idle_wall": idle_wall, "idle_cpu": idle_cpu,
            "classify": classify, "floor": floor, "efa_files": len(paths),
            "nvml_calls": nvml_calls,
            "render_first": render_first, "render_repeat": render_repeat, "render_text": render_text,
            "sources": sources}


def ms_p50_p99_max(values: list[float]) -> str:
    return " / ".join(f"{v * 1000:.1f}" for v in (median(values), percentile(values, 0.99), max(values))) + " ms"


def real_run(seconds: float, nvml: bool, kube_url: str | None, work: Path, cache: Path) -> dict:
    """Part 2: the agent process on the wall clock; its CPU time over wall time and its RSS.
    ``kube_url``: write to that (fake) API server through the kubernetes client, else dry-run."""
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import stub_nvml_env

    demo = build_demo_root(work / "root")
    kube = dict(kube="kubeconfig", kubeconfig=write_kubeconfig(kube_url, work / "kubeconfig")) if kube_url \
        else dict(kube="dry-run")
    agent = AgentProcess(dict(host_root=demo.root, node_name="gpu-node-0", listen="127.0.0.1:0",
                              state_file=work / "state.json", expected_gpus=8, expected_efa_devices=32,
                              no_nvml=not nvml, **kube),
                         work / "agent.log", env=stub_nvml_env(demo.scenario, cache / "healthagent"))
    try:
        agent.wait_metric(lambda s: s.value("healthagent_efa_devices") == 32, what="a first cycle")
        cpu0, wall0 = agent.cpu_seconds(), time.monotonic()
        step, next_move, next_scrape = 0, wall0, wall0
        while (now := time.monotonic()) - wall0 < seconds:
            if now >= next_move:
                move_counters(demo, step)
                step, next_move = step + 1, next_move + INTERVAL
            if now >= next_scrape:
                fetch(agent.port)  # as Prometheus asks: its Accept header, gzip
                next_scrape += SCRAPE_INTERVAL
            time.sleep(max(0.0, min(next_move, next_scrape, wall0 + seconds) - time.monotonic()))
        cpu, wall = agent.cpu_seconds() - cpu0, time.monotonic() - wall0
        scrape = agent.scrape()
        return {"cpu_percent": 100 * cpu / wall, "rss_kib": agent.rss_kib(), "peak_kib": agent.hwm_kib(),
                "series": scrape.series(), "wall": wall}
    finally:
        agent.signal(signal.SIGTERM)
        agent.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", type=int, default=360)
    parser.add_argument("--real-seconds", type=float, default=300.0)
    parser.add_argument("--parts", default="1,2", help="1: the hour in fast-forward; 2: healthagent run")
    parser.add_argument("--agents", default="nvml,no-nvml,kube", help="part 2's runs")
    parser.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.child:
        print(json.dumps(fast_forward(args.intervals, Path(args.child))))
        return

    print(f"footprint on the demo node (8 GPUs via the stub, 32 EFA devices); {machine()}")
    with tempfile.TemporaryDirectory(prefix="bench-footprint-") as tmp:
        cache = Path(tmp) / "cache"
        env = dict(os.environ, XDG_CACHE_HOME=str(cache))
        if "1" in args.parts.split(","):
            child = subprocess.run([sys.executable, "-m", "bench.bench_footprint", "--intervals", str(args.intervals),
                                    "--child", str(Path(tmp) / "ff")], capture_output=True, text=True, env=env,
                                   check=True)
            r = json.loads(child.stdout.strip().splitlines()[-1])
            full_cpu, idle_cpu = median(r["full_cpu"]), median(r["idle_cpu"])
            rss = r["rss_kib"]
            print(f"\n1. {r['intervals']} intervals of 10 s back to back ({r['intervals'] * INTERVAL / 3600:.2f} h "
                  f"equivalent), Kubernetes dry-run, verdict at the end: {r['verdict']}")
            print(table(["figure", "value"], [
                ["RSS after the first interval", mib(rss["first"])],
                ["RSS after 36 intervals (6 min)", mib(rss["six_minutes"])],
                ["RSS at the end", mib(rss["end"])],
                ["growth from 6 min to the end", f"{(rss['end'] - rss['six_minutes']) / 1024:+.2f} MiB"],
                ["peak RSS (VmHWM)", mib(rss["peak"])],
                ["full cycle wall p50 / p99", f"{median(r['full_wall']) * 1000:.1f} / "
                                              f"{percentile(r['full_wall'], 0.99) * 1000:.1f} ms"],
                ["full cycle CPU p50", f"{full_cpu * 1000:.1f} ms"],
                ["  of which NVML / EFA / kernel log (wall p50)",
                 " / ".join(f"{median(r['sources'][s]) * 1000:.1f}" for s in ("nvml", "efa", "kmsg")) + " ms"],
                ["  the classification in a full cycle, p50", f"{median(r['classify']) * 1000:.1f} ms"],
                [f"  floor: open, read, close and parse the {r['efa_files']} EFA files alone, p50",
                 f"{median(r['floor']) * 1000:.1f} ms"],
                ["  NVML library calls in one collection (8 GPUs)", r["nvml_calls"]],
                ["kernel-log-only cycle wall / CPU p50", f"{median(r['idle_wall']) * 1e6:.0f} / {idle_cpu * 1e6:.0f} us"],
                ["/metrics after new data, Prometheus' Accept (OpenMetrics) + gzip, p50 / p99 / max",
                 ms_p50_p99_max(r["render_first"])],
                ["/metrics after new data, text 0.0.4 + gzip, p50 / p99 / max", ms_p50_p99_max(r["render_text"])],
                ["/metrics repeat (nothing changed), OpenMetrics + gzip, p50", f"{median(r['render_repeat']) * 1000:.2f} ms"],
                ["series (healthagent_*)", r["series"]],
            ]))
        if "2" not in args.parts.split(","):
            return
        rows = []
        agents = args.agents.split(",")
        with HoldingKubeFake() as fake:
            fake.seed_nodes(20)
            for key, name, nvml, url in (("nvml", "NVML (stub), dry-run", True, None),
                                         ("no-nvml", "--no-nvml, dry-run", False, None),
                                         ("kube", "NVML (stub), kubernetes client", True, fake.url)):
                if key not in agents:
                    continue
                got = real_run(args.real_seconds, nvml, url, Path(tmp) / f"real-{len(rows)}", cache)
                rows.append([name, f"{got['cpu_percent']:.2f}%", mib(got["rss_kib"]), mib(got["peak_kib"]),
                             got["series"]])
        print(f"\n2. healthagent run, default settings, {args.real_seconds:.0f} s wall clock")
        print(table(["agent", "CPU (process time / wall)", "RSS", "peak RSS", "series"], rows))


if __name__ == "__main__":
    main()
