"""API cost at fleet scale: requests one agent makes per hour in steady state and per fault.

    .venv/bin/python -m bench.bench_api_cost [--nodes 2000] [--real-seconds 150]

Two measurements of the same code, both counted on the fake API server's request log
(``tests/support/kubefake/``), through the real ``kubernetes`` client:

1. simulated hour: ``NodeEffects`` (what the agent's effects worker drives) reconciled every 5 s of
   a simulated clock, the worker's retry cadence, with the verdict the real classifier gives every
   10 s (the NVML/EFA interval): one healthy hour; then an XID 95 (a real kernel-log record through
   the real parser and classifier) and the 15 minutes after it, against a healthy hour's 15 minutes.
   A simulated clock covers the effects' own timers (resync, NoExecute grace, budget re-count);
   whatever runs on real time (the node watch, re-opened when the server ends it after its
   ``timeoutSeconds``; the worker's own wait) is not in it: the watch's re-opens are added from
   the range the code asks for, and checked in:
2. real run: the whole agent (``AgentRuntime``, default settings) for ``--real-seconds`` of wall
   time healthy, then for the same time after an XID 95 appended to its kernel log; the steady
   count is scaled to an hour.

Requests are grouped by what they are: GET node, LIST nodes (the budget's shared GPU node count),
WATCH nodes, PATCH node (labels, taint), PATCH node/status (conditions), POST event, and the
disruption budget's Leases (LIST leases, POST/PUT/GET lease: a slot taken, re-written after the
node write, given back). Extrapolation to a fleet is printed for ``--nodes`` agents.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.common import machine, table
from healthagent.config import Settings, load_settings
from tests.support.live_agent import HoldingKubeFake, write_kubeconfig

NODE = "gpu-node-0"
BOOT_ID = "2c1c6f9e-4f0e-4a55-9d1e-7f1a2b3c4d5e"
HOUR = 3600.0
RETRY_SECONDS = 5.0  # EffectsWorker's default cadence
VERDICT_SECONDS = 10.0  # NVML/EFA default interval: a fresh verdict this often
FAULT_WINDOW = 900.0
XID_RECORD = ("4,9001,7300000000,-;NVRM: Xid (PCI:0000:86:00): 95, pid='<unknown>', name=<unknown>, "
              "Uncontained: FBHUB. RST: Yes, D-RST: No")


def kind_of(method: str, path: str, query: dict) -> str:
    if path.startswith("/apis/events.k8s.io"):
        return f"{method} event"
    if path.startswith("/apis/coordination.k8s.io"):
        listing = path.endswith("/leases") and method == "GET"
        return "GET leases (list)" if listing else f"{method} lease"
    if path.endswith("/status"):
        return f"{method} node/status"
    if path == "/api/v1/nodes":
        return "WATCH nodes" if query.get("watch") in ("true", "1") else f"{method} nodes (list)"
    return f"{method} node"


def count(fake) -> Counter:
    return Counter(kind_of(r.method, r.path, r.query) for r in fake.requests())


def writes_of(counts: Counter) -> int:
    return sum(n for kind, n in counts.items() if kind.split()[0] in ("POST", "PUT", "PATCH", "DELETE"))


# -- 1. simulated clock ----------------------------------------------------------------------------

def simulated(tmp: Path) -> tuple[Counter, Counter, Counter]:
    """(requests in a healthy hour, in 15 healthy minutes, in the 15 minutes after an XID 95)."""
    from healthagent.effects.kube import NodeEffects
    from healthagent.effects.state import StateStore
    from healthagent.model import Collection
    from healthagent.policy.catalog import load_catalog
    from healthagent.policy.classify import Classifier
    from healthagent.policy.settings import Policy
    from healthagent.sources.kernel_log.offline import iter_events

    with HoldingKubeFake() as fake:
        fake.seed_nodes(20)
        settings = Settings(node_name=NODE, kube="kubeconfig", state_file=str(tmp / "sim-state.json"))
        store = StateStore(settings.state_file)
        store.load()
        effects = NodeEffects(settings, fake.api_client(), store)
        classifier = Classifier(Policy(), load_catalog(Policy()))
        t = 1_800_000_000.0
        verdict = classifier.observe(Collection(timestamp=t)).verdict
        effects.startup(t, BOOT_ID)

        def run(seconds: float, first_xids: tuple = ()) -> Counter:
            nonlocal t, verdict
            fake.reset_log()
            xids = first_xids
            end = t + seconds
            next_verdict = t
            while t < end:
                if t >= next_verdict or xids:
                    verdict = classifier.observe(Collection(timestamp=t, xids=xids)).verdict
                    xids = ()
                    next_verdict = t + VERDICT_SECONDS
                effects.reconcile(verdict, t, BOOT_ID)
                t += RETRY_SECONDS
            return count(fake)

        try:
            run(120.0)  # settle: the first reconcile writes the healthy labels and conditions once
            hour = run(HOUR)
            quarter = run(FAULT_WINDOW)
            event = next(iter_events([XID_RECORD], t))
            fault = run(FAULT_WINDOW, first_xids=(event,))
        finally:
            close = getattr(effects, "close", None)
            if close is not None:
                close()
        return hour, quarter, fault


# -- 2. the real agent on the wall clock -----------------------------------------------------------

def watch_cadence() -> tuple[int, int] | None:
    """The server-side ``timeoutSeconds`` range the effects' node watch asks for (it re-opens the
    watch when the server ends it), or None when the effects have no watch."""
    try:
        from healthagent.effects import node_watch
    except ImportError:
        return None
    return tuple(node_watch.WATCH_TIMEOUT_SECONDS)


def real(tmp: Path, seconds: float) -> tuple[Counter, Counter, list]:
    """(requests in ``seconds`` healthy, requests in ``seconds`` after an XID 95, the watch
    requests made since the agent started, as their timeoutSeconds)."""
    from healthagent.demo.node import build_demo_root
    from healthagent.wiring import AgentRuntime

    demo = build_demo_root(tmp / "root")
    with HoldingKubeFake() as fake:
        fake.seed_nodes(20)
        settings = load_settings(env={}, flags=dict(
            host_root=str(demo.root), kube="kubeconfig", node_name=NODE, nvml="false",
            kubeconfig=str(write_kubeconfig(fake.url, tmp / "kubeconfig")),
            state_file=str(tmp / "real-state.json"), listen="127.0.0.1:0", log_level="WARNING"))
        runtime = AgentRuntime(settings)
        runtime.start()
        try:
            deadline = time.monotonic() + 60
            while runtime.agent.effects_worker.reconciles < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(2 * RETRY_SECONDS)  # past the first reconcile's writes
            started_log = fake.requests()
            fake.reset_log()
            time.sleep(seconds)
            steady = count(fake)
            started_log += fake.requests()
            fake.reset_log()
            demo.inject_xid(3, 95, via="kmsg")
            time.sleep(seconds)
            fault = count(fake)
            started_log += fake.requests()
        finally:
            runtime.stop()
        watches = [int(r.query.get("timeoutSeconds") or 0) for r in started_log
                   if kind_of(r.method, r.path, r.query) == "WATCH nodes"]
    return steady, fault, watches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--real-seconds", type=float, default=150.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    print(f"API requests of one agent; {machine()}")
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        os.environ.setdefault("XDG_CACHE_HOME", str(Path(tmp) / "cache"))
        hour, quarter, fault = simulated(Path(tmp))
        extra = fault - quarter
        kinds = sorted(set(hour) | set(fault))
        print("\n1. simulated clock (NodeEffects every 5 s, a fresh verdict every 10 s)")
        print(table(["request", "healthy hour", "15 min healthy", "15 min after XID 95", "due to the fault"],
                    [[k, hour.get(k, 0), quarter.get(k, 0), fault.get(k, 0), extra.get(k, 0)] for k in kinds]))
        print(f"steady: {sum(hour.values())} requests/hour ({writes_of(hour)} writes); "
              f"per fault: {sum(extra.values())} requests ({writes_of(extra)} writes)")
        steady, after, watches = real(Path(tmp), args.real_seconds)
        scale = HOUR / args.real_seconds
        kinds = sorted(set(steady) | set(after))
        print(f"\n2. real agent, {args.real_seconds:.0f} s healthy then {args.real_seconds:.0f} s after XID 95")
        print(table(["request", f"{args.real_seconds:.0f} s healthy", "per hour (scaled)",
                     f"{args.real_seconds:.0f} s after XID 95"],
                    [[k, steady.get(k, 0), f"{steady.get(k, 0) * scale:.0f}", after.get(k, 0)] for k in kinds]))
        print(f"watch requests since the agent started: {len(watches)}, timeoutSeconds {watches}")
        cadence = watch_cadence()
        per_hour = float(sum(hour.values()))
        if cadence is not None:
            # The simulated hour passes in seconds of real time, so the watch's re-opens (the server
            # ends each watch after timeoutSeconds, drawn uniformly from the range) are added here.
            rewatch = HOUR / ((cadence[0] + cadence[1]) / 2)
            print(f"the node watch is re-opened every {cadence[0]}-{cadence[1]} s (server-side timeoutSeconds): "
                  f"{HOUR / cadence[1]:.0f}-{HOUR / cadence[0]:.0f}, about {rewatch:.0f} watch requests/hour, "
                  "one open at a time")
            per_hour += rewatch
        print(f"\nfleet of {args.nodes} nodes: {per_hour:.0f} requests/hour/node steady = "
              f"{per_hour * args.nodes:,.0f}/hour = {per_hour * args.nodes / HOUR:.1f}/s, "
              f"{writes_of(hour) * args.nodes} writes"
              + (f", {args.nodes} watches open" if cadence is not None else "")
              + f"; a fault costs {sum(extra.values())} requests on its node")


if __name__ == "__main__":
    main()
