"""Detection to taint: from an XID on the demo node to the agent's taint stored by the API server.

    .venv/bin/python -m bench.bench_detection [--runs 200] [--full-cycle-every 4]
                                              [--paths kmsg,nvml,both]

Each run starts the real agent (``AgentRuntime``, what ``healthagent run`` starts) at default
settings (NVML's XID event thread, the effects worker as it is) on a fresh demo node (8 x H100
through the stub NVML library, 32 EFA devices), talking through the real ``kubernetes`` client to
the fake API server (``tests/support/kubefake/``) seeded with 20 GPU nodes. Once the agent is
warm (first reconcile done, NVML event set built) it injects XID 95 on GPU 3:

  kmsg         the driver's record appended to the demo node's kernel log, a regular file
               (``DemoNode.inject_xid(via="kmsg")``); a record written to the machine's real
               ``/dev/kmsg`` cannot stand in for it: the kernel files every record from user
               space under facility ``user``, and the agent takes only the kernel's
  nvml         an XID event through the stub library (``via="nvml"``)
  both         both at once, as a real driver reports an XID (file + NVML)

Two kinds of run, in turn: every ``--full-cycle-every``-th run injects *during a full cycle*: the
bench makes every periodic source due, rings the loop's wake-up and injects the moment the first
periodic source (NVML) starts collecting, so the XID arrives just after the kernel log was read
and waits for NVML + EFA + classification + the state file before the next read. The bench learns
that moment from a proxy it puts in front of that source (``CycleStart``), nothing in the agent.
The other runs wait a random 0-100 ms after the agent is warm and inject (anywhere in the idle
time between collections).

The clock starts when the injection call is made (the agent, woken by the write, may act before
the call returns: with both, the record is in the log before the event is in the scenario) and
stops at the moment the fake API server stored the PATCH that carries the taint
(its request log stamps a request after the store, before the reply is sent). The split shows
where the time goes: until the agent's first API request (detect, classify, save state, hand off)
and from there to the stored taint (LIST nodes for the budget, PATCH). p99 is nearest-rank.
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

from bench.common import machine, median, percentile, table
from healthagent.config import load_settings
from tests.support.live_agent import HoldingKubeFake, taint_write, wait_until, write_kubeconfig

NODE = "gpu-node-0"
TAINT_KEY = "healthagent.io/unhealthy"
XID = 95
GPU = 3


class CycleStart:
    """A bench-side proxy in front of the first periodic source: sets ``started`` when that source
    starts collecting, that is when a full cycle has read the kernel log and begun its periodic
    sources."""

    def __init__(self, source) -> None:
        self.source = source
        self.name = source.name
        self.started = threading.Event()

    def collect(self, now: float):
        self.started.set()
        return self.source.collect(now)

    def close(self) -> None:
        self.source.close()


def one_run(path: str, full_cycle: bool, work: Path, cache: Path) -> tuple[float, float]:
    """(seconds to the stored taint, seconds to the agent's first API request after the XID)."""
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import use_stub_nvml
    from healthagent.wiring import AgentRuntime

    shutil.rmtree(work, ignore_errors=True)
    demo = build_demo_root(work / "root")
    use_stub_nvml(demo.scenario, cache / "healthagent")
    with HoldingKubeFake() as fake:
        fake.seed_nodes(20)
        settings = load_settings(env={}, flags=dict(
            host_root=str(demo.root), kube="kubeconfig", node_name=NODE,
            kubeconfig=str(write_kubeconfig(fake.url, work / "kubeconfig")),
            state_file=str(work / "state.json"), listen="127.0.0.1:0", log_level="WARNING"))
        runtime = AgentRuntime(settings)
        hook = CycleStart(runtime.agent.scheduled[0].source)
        runtime.agent.scheduled[0].source = hook
        runtime.start()
        try:
            agent = runtime.agent
            wait_until(lambda: agent.effects_worker.reconciles >= 1 and agent.nvml.event_thread is not None,
                       what="a warm agent")
            agent.nvml.event_thread.wait_built(1, 60)
            stored = taint_write(TAINT_KEY)
            fake.reset_log()
            if full_cycle:
                hook.started.clear()
                for item in agent.scheduled:
                    item.next_due = 0.0  # every periodic source due now
                agent.wake.set()
                if not hook.started.wait(30):
                    raise RuntimeError("the full cycle did not start")
            else:
                time.sleep(random.uniform(0.0, 0.1))
            injected = time.time()  # before the call: the agent may act before it returns
            demo.inject_xid(GPU, XID, via=path)
            taint = wait_until(lambda: next((r for r in fake.requests("PATCH") if r.status == 200 and
                                             stored(r.method, r.path, r.body)), None),
                               what="the taint on the API server", interval=0.002)
            first = min(r.at for r in fake.requests())
            # ``at`` is stamped after the server handled a request; the first request's own time
            # is at most its handling time earlier, well under a millisecond on the fake.
            return taint.at - injected, first - injected
        finally:
            runtime.stop()


def summary(name: str, totals: list[float], detects: list[float]) -> list[str]:
    return [name, str(len(totals)), f"{percentile(totals, 0.5) * 1000:.0f}",
            f"{percentile(totals, 0.99) * 1000:.0f}", f"{max(totals) * 1000:.0f}", f"{min(totals) * 1000:.0f}",
            f"{median(detects) * 1000:.0f}", f"{median(t - d for t, d in zip(totals, detects)) * 1000:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per path")
    parser.add_argument("--full-cycle-every", type=int, default=4,
                        help="every Nth run injects during a full cycle (0: none)")
    parser.add_argument("--paths", default="kmsg,nvml,both")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    random.seed(1)
    paths = args.paths.split(",")
    if "kmsg-device" in paths:
        raise SystemExit("kmsg-device: a record written to /dev/kmsg from user space is facility user, which the "
                         "agent never takes for the driver's; a driver XID cannot be injected that way")
    print(f"detection to taint, XID {XID} on GPU {GPU}, {args.runs} runs per path, every "
          f"{args.full_cycle_every or 'no'}th during a full cycle; {machine()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-detection-") as tmp:
        cache = Path(tmp) / "cache"
        for path in paths:
            runs: list[tuple[bool, float, float]] = []
            for n in range(args.runs):
                full = bool(args.full_cycle_every) and n % args.full_cycle_every == args.full_cycle_every - 1
                total, detect = one_run(path, full, Path(tmp) / f"run-{path}-{n}", cache)
                runs.append((full, total, detect))
                shutil.rmtree(Path(tmp) / f"run-{path}-{n}", ignore_errors=True)
            for name, chosen in (("all", runs), ("idle", [r for r in runs if not r[0]]),
                                 ("full cycle", [r for r in runs if r[0]])):
                if chosen:
                    rows.append(summary(f"{path}: {name}", [r[1] for r in chosen], [r[2] for r in chosen]))
            print(table(["path: runs", "n", "p50 ms", "p99 ms", "max ms", "min ms", "median to 1st request ms",
                         "median 1st request to taint ms"], rows[-3:]), flush=True)
    print()
    print(table(["path: runs", "n", "p50 ms", "p99 ms", "max ms", "min ms", "median to 1st request ms",
                 "median 1st request to taint ms"], rows))
    print("p99 is nearest-rank: of 200 runs, the 198th fastest; of 100 or fewer, the slowest.")


if __name__ == "__main__":
    main()
