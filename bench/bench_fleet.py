"""A fleet of GPU nodes and their agents against a real kube-apiserver + etcd: what the fleet
costs the control plane at rest, in a burst of faults and when an operator clears them, and that
the disruption budget holds throughout.

    .venv/bin/python -m bench.bench_fleet --preset small|1k|10k [--steady SECONDS] [--json PATH]

Needs ``etcd`` and ``kube-apiserver`` (``KUBEBUILDER_ASSETS``; ``tests/support/envtest.py``) and
the test extra's ``kubectl`` (to render the generic overlay's RBAC and admission policies, which
every agent request passes through). The fleet: ``nodes`` realistic GPU Node objects (~40 labels,
30 images, ~10 kB each); ``agents`` of them run the agent's effects in full (``NodeEffects`` with
its node watch under the ``EffectsWorker`` the DaemonSet runs, each as its node's service account
with the node name its pod-bound token carries); every other node's watch is opened as its agent
opens it. The budget counter runs as its own service account. Scenarios, in order: steady state;
``faults`` faults spread over ``burst_seconds``; the operator clears them; ``faults`` faults in 1 s;
cleared again; ``faults`` faults over ``restart_burst_seconds`` with the API server restarted in
the middle. NoExecute grace 0: a slot holder goes out at once (the budget's worst case).

Figures per scenario: fault -> NoSchedule p50/p99/max and the time until all are tainted; slot
holders' fault -> NoExecute; the most nodes with NoExecute at once (a watch counts, as a user
would) against the limit; requests and response bytes by verb and resource from the API
server's own ``/metrics``; bytes per budget decision; kube-apiserver, etcd and bench-process
(the agents) CPU and memory from /proc; etcd's database size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Callable

from bench.common import machine, table
from bench.fleet_sim.scenarios import PRESETS, Result, Sim
from tests.support.envtest import ControlPlane, find_assets, missing_reason

BYTES_PER_DECISION_BOUND = 20_000
WATCH_BACK_SECONDS = 120.0  # a bound on the agents' watches coming back, never a measurement


def run(preset_name: str, steady: float | None = None, restart: bool = True, api_priority: bool = True,
        progress: Callable[[Result], None] = lambda result: None) -> tuple[dict, list[Result]]:
    """Every scenario of the preset in order; ``progress`` sees each result as it comes."""
    assets = find_assets()
    if assets is None:
        raise SystemExit(missing_reason())
    preset = PRESETS[preset_name]
    if steady is not None:
        preset = dataclasses.replace(preset, steady_seconds=steady)
    with ControlPlane(assets) as plane:
        with Sim(plane, preset, api_priority=api_priority) as sim:
            steps = [lambda: sim.steady(preset.steady_seconds),
                     lambda: sim.burst(f"{preset.faults} faults in {preset.burst_seconds:.0f} s", preset.faults,
                                       preset.burst_seconds),
                     lambda: sim.clear(f"operator clears {preset.faults} nodes"),
                     lambda: sim.burst(f"{preset.faults} faults in 1 s", preset.faults, 1.0),
                     lambda: sim.clear("operator clears them again")]
            if restart:
                steps.append(lambda: sim.burst(f"{preset.faults} faults in {preset.restart_burst_seconds:.0f} s, "
                                               "API server restarted in the middle", preset.faults,
                                               preset.restart_burst_seconds, restart=True))
            results = []
            for step in steps:
                results.append(step())
                progress(results[-1])
            # every agent's watch back after the restart, within a bound (the retry's cap is 30 s)
            watching_again = sim.fleet.wait_watching(WATCH_BACK_SECONDS)
            setup = dict(sim.setup, api_priority=api_priority, agents_watching_at_end=watching_again,
                         dispatched_in_level=sim.dispatched_in_level(), agent_errors=sim.fleet.errors(),
                         counter_rounds=sim.counter.rounds,
                         passive_watch_opens=sim.passive.figures.opened, passive_events=sim.passive.figures.events)
    return {"preset": dataclasses.asdict(preset), **setup}, results


def report(setup: dict, results: list[Result]) -> None:
    preset = setup["preset"]
    print(f"{preset['nodes']:,} nodes, {preset['agents']:,} agents in full (every other node: its watch), "
          f"budget limit {preset['limit']}; the agents' FlowSchema and priority level "
          + ("applied" if setup.get("api_priority") else "left out"))
    print(f"setup: nodes created in {setup['create_seconds']:.1f} s; {setup['agents_watching']} agents watching after "
          f"{setup['agents_start_seconds']:.1f} s; {setup['passive_watches_live']} other watches live; "
          f"counter counted {setup['gpu_nodes_counted']}")
    agents = preset["agents"]
    rows = []
    for r in results:
        per = r.bytes_per_decision
        rows.append([r.name, f"{r.tainted}/{r.faults}" if not r.cleared else f"{r.cleared}/{r.faults} cleared",
                     r.summary(r.to_noschedule if not r.cleared else r.to_clean),
                     f"{r.all_tainted_seconds:.2f} s" if r.all_tainted_seconds is not None else "-",
                     r.summary(r.to_noexecute), f"{r.most_noexecute} (limit {r.limit})",
                     f"{r.decisions}", f"{per / 1e3:.1f} kB" if per is not None else "-"])
    print(table(["scenario", "tainted", "fault -> NoSchedule (clear -> clean)", "all tainted after",
                 "holders: fault -> NoExecute", "most NoExecute", "decisions", "bytes / decision"], rows))
    for r in results:
        w = r.window
        print(f"\n{r.name}: {w.seconds:.1f} s; CPU s (share of one core): " + ", ".join(
            f"{name} {cpu:.1f} ({cpu / w.seconds * 100:.0f}%)" for name, cpu in w.cpu.items())
            + "; memory: " + ", ".join(f"{name} {rss / 2**20:,.0f} MiB" for name, rss in w.rss.items())
            + f"; etcd db {w.etcd_bytes / 2**20:,.1f} MiB")
        for note in r.notes:
            print(f"  {note}")
        print(f"  the budget counter (upkeep, left out of bytes per decision): read {r.counter_bytes / 1e6:,.2f} MB, "
              f"listed the Leases {r.counter_lists} time(s)")
        print(f"  watch requests: agents {r.agent_watch_opens:,} ({r.agent_watch_opens / agents:.1f} per agent), "
              f"other nodes {r.passive_watch_opens:,}; answered 429: "
              + (", ".join(f"{k} {v:,.0f}" for k, v in sorted(r.refused.items())) or "none")
              + f"; watchers the API server shed: {r.shed_watchers:,}"
              + "; queued (API Priority and Fairness): " + (", ".join(
                  f"{level} {count:,.0f} requests, mean wait "
                  f"{w.api.get(('apf_wait_sum', level, schema), 0) / count:.3f} s"
                  for (metric, level, schema), count in sorted(w.api.items())
                  if metric == "apf_wait_count" and schema in ("healthagent", "service-accounts") and count) or "none")
              + "; agents' errors: " + (", ".join(f"{k} {v}" for k, v in sorted(r.agent_errors.items())) or "none"))
        rows = [[f"{verb} {resource}", f"{w.api.get(('requests', verb, resource), 0):,.0f}",
                 f"{w.api.get(('bytes', verb, resource), 0) / 1e6:,.2f} MB"]
                for (metric, verb, resource) in sorted(k for k in w.api if k[0] == "requests")
                if resource in ("nodes", "nodes/status", "leases", "events")]
        print(table(["request", "count", "response bytes"], rows))
    last = results[-1].window
    bench_cpu = sum(r.window.cpu.get("agents (bench process)", 0.0) for r in results)
    seconds = sum(r.window.seconds for r in results)
    print(f"\nagents (the bench process: {agents} full agents, every other node's watch, the observer): "
          f"{last.rss.get('agents (bench process)', 0) / 2**20 / agents:.1f} MiB and "
          f"{bench_cpu / seconds / agents * 1000:.2f} ms CPU per second per full agent (upper bounds)")
    print(f"agents watching at the end: {setup['agents_watching_at_end']} of {agents}; requests dispatched "
          f"through the agents' FlowSchema since the API server's last start: {setup['dispatched_in_level']:,.0f}")
    print(f"agent errors: {setup['agent_errors'] or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steady", type=float, help="seconds of steady state (the preset's otherwise)")
    parser.add_argument("--no-restart", action="store_true", help="leave out the API server restart scenario")
    parser.add_argument("--no-api-priority", action="store_true",
                        help="leave out the deploy's FlowSchema and priority level for the agents")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops etcd and the API server
    print(machine(), flush=True)
    setup, results = run(args.preset, args.steady, restart=not args.no_restart,
                         api_priority=not args.no_api_priority,
                         progress=lambda r: print(f"done: {r.name}: tainted {r.tainted}/{r.faults}, cleared "
                                                  f"{r.cleared}, most NoExecute {r.most_noexecute}", flush=True))
    report(setup, results)
    if args.json:
        args.json.write_text(json.dumps({"setup": setup, "results": [
            {**dataclasses.asdict(r), "window": {**dataclasses.asdict(r.window),
                                                  "api": {" ".join(k): v for k, v in r.window.api.items()}}}
            for r in results]}, indent=1, default=str))


if __name__ == "__main__":
    main()
