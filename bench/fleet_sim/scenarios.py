"""The scenarios of a simulated fleet, each measured over its own window.

``Sim`` sets the fleet up (nodes, access objects, counter, full agents, the other nodes'
watches) and runs: ``steady`` (nothing happens: the cost of the fleet at rest), ``burst`` (faults
spread over a time, optionally with an API server restart in the middle) and ``clear`` (an
operator clears every tainted node). Each returns a ``Result`` of figures; nothing in it judges
wall-clock time: what must hold (never more than the limit out, every faulty node tainted,
bytes per decision under a bound) is for the caller to check."""

from __future__ import annotations

import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import percentile
from bench.fleet_sim.agents import Counter, Fleet
from bench.fleet_sim.cluster import (
    apply_api_priority,
    apply_generic_access,
    create_nodes,
    ensure_namespace,
    shed_watchers,
)
from bench.fleet_sim.observe import Meter, TaintLog, Window
from bench.fleet_sim.watchers import PassiveWatches
from tests.support.envtest import ControlPlane

WAIT_SECONDS = 600.0  # the longest any scenario waits for its outcome (a bound, not a measurement)


@dataclass(frozen=True)
class Preset:
    nodes: int
    agents: int  # simulated in full; every other node has its watch only
    faults: int  # per burst
    limit: int  # budget_max_nodes (budget_max_fraction 0.1)
    steady_seconds: float
    burst_seconds: float  # the "in 60 s" burst
    restart_burst_seconds: float


PRESETS = {
    "small": Preset(nodes=60, agents=30, faults=20, limit=3, steady_seconds=3, burst_seconds=3,
                    restart_burst_seconds=4),
    "1k": Preset(nodes=1_000, agents=200, faults=200, limit=10, steady_seconds=30, burst_seconds=30,
                 restart_burst_seconds=10),
    "10k": Preset(nodes=10_000, agents=1_000, faults=1_000, limit=10, steady_seconds=600, burst_seconds=60,
                  restart_burst_seconds=30),
}


@dataclass
class Result:
    name: str
    window: Window
    faults: int = 0
    tainted: int = 0  # faulty nodes that reached NoSchedule (or NoExecute)
    to_noschedule: list = field(default_factory=list)  # seconds from fault to the taint, per node
    all_tainted_seconds: float | None = None  # from the first fault to the last node tainted
    to_noexecute: list = field(default_factory=list)  # slot holders: fault to NoExecute
    most_noexecute: int = 0
    limit: int = 0
    decisions: int = 0  # lists of the budget's Leases (one per look)
    cleared: int = 0
    to_clean: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    agent_watch_opens: int = 0  # the full agents' node watch requests in the window
    passive_watch_opens: int = 0  # the other nodes' watch requests in the window
    agent_errors: dict = field(default_factory=dict)  # the full agents' error kinds counted in the window
    shed_watchers: int = 0  # watchers the API server closed as unresponsive in the window
    counter_bytes: int = 0  # what the budget counter read in the window (fleet upkeep, not a decision)
    counter_lists: int = 0  # its Lease lists in the window (not decisions)

    @property
    def refused(self) -> dict:
        """Requests answered 429 (API Priority and Fairness), by "VERB resource"."""
        return {f"{verb} {resource}": v for (metric, verb, resource), v in self.window.api.items() if metric == "429"}

    def bytes_where(self, verbs: tuple[str, ...], resources: tuple[str, ...] = ()) -> float:
        return sum(v for (metric, verb, resource), v in self.window.api.items()
                   if metric == "bytes" and verb in verbs and (not resources or resource in resources))

    @property
    def bytes_per_decision(self) -> float | None:
        """Every byte the API server sent for LIST and GET (leases, nodes, events) per look, less
        what the budget counter read (its count of the fleet each interval is upkeep whether or
        not anything is decided: the steady state shows it)."""
        sent = self.bytes_where(("LIST", "GET"), ("leases", "nodes", "events")) - self.counter_bytes
        return max(0.0, sent) / self.decisions if self.decisions else None

    def summary(self, values: list) -> str:
        if not values:
            return "-"
        return (f"p50 {percentile(values, 0.5) * 1000:,.0f} ms, p99 {percentile(values, 0.99) * 1000:,.0f} ms, "
                f"max {max(values) * 1000:,.0f} ms")


def untainted(agent, firsts: dict) -> str:
    """Why a faulty node shows no taint: what its agent holds (for the one reading the figures)."""
    from healthagent.effects.node_desired import CLEAR_ANNOTATION, CLEAR_HANDLED_ANNOTATION, annotations_of

    record, status = agent.effects.record, agent.worker.status
    marks = annotations_of(agent.effects.node or {})
    return (f"never tainted: {agent.name} (taint recorded {record.taint}, clear to write {record.clear_to_write!r}, "
            f"removing {record.removing}, clear {marks.get(CLEAR_ANNOTATION)!r} handled "
            f"{marks.get(CLEAR_HANDLED_ANNOTATION)!r}, watching {status.watching}, pending {status.pending_writes}, "
            f"reconciles {agent.worker.reconciles}, errors {agent.worker.errors()})")


class Sim:
    def __init__(self, plane: ControlPlane, preset: Preset, seed: int = 16, api_priority: bool = True) -> None:
        """``api_priority``: apply the deploy's FlowSchema and priority level for the agents (as
        every overlay does); False: leave the agents in the built-in service-accounts schema."""
        self.plane, self.preset = plane, preset
        self.api_priority = api_priority
        self.rng = random.Random(seed)
        self._folder = tempfile.TemporaryDirectory(prefix="bench-fleet-")
        self.setup: dict[str, float] = {}

    def __enter__(self) -> "Sim":
        p = self.preset
        ensure_namespace(self.plane)
        apply_generic_access(self.plane)
        self.priority_uids = apply_api_priority(self.plane) if self.api_priority else {}
        names, self.setup["create_seconds"] = create_nodes(self.plane, p.nodes)
        self.names = names
        self.counter = Counter(self.plane, interval=60.0)
        self.setup["gpu_nodes_counted"] = self.counter.round()
        self.counter.start()
        self.log = TaintLog(self.plane)
        full = names[:p.agents]
        version = self.plane.admin_session().get(f"{self.plane.url}/api/v1/nodes", timeout=60,
                                                 params={"limit": "1"}).json()["metadata"]["resourceVersion"]
        self.passive = PassiveWatches(self.plane, names[p.agents:], version)
        self.passive.start()
        self.fleet = Fleet(self.plane, full, Path(self._folder.name), p.limit, 0.1)
        self.setup["agents_start_seconds"] = self.fleet.start(WAIT_SECONDS)
        self.setup["agents_watching"] = self.fleet.watching()
        deadline = time.monotonic() + WAIT_SECONDS
        while len(self.passive.figures.live) < p.nodes - p.agents and time.monotonic() < deadline:
            time.sleep(0.2)
        self.setup["passive_watches_live"] = len(self.passive.figures.live)
        self.meter = Meter(self.plane)
        return self

    def __exit__(self, *exc) -> None:
        self.fleet.stop()
        self.passive.stop()
        self.counter.stop()
        self.log.stop()
        self._folder.cleanup()

    # -- scenarios ---------------------------------------------------------------------------------------

    def _open_window(self) -> None:
        self.meter.start()
        self._opens = (self.fleet.watch_opens(), self.passive.figures.opened)
        self._errors = self.fleet.errors()
        self._shed = shed_watchers(self.plane)
        self._counted = (self.counter.read_bytes, self.counter.lease_lists)

    def _close_window(self, name: str, **figures) -> Result:
        result = Result(name, self.meter.stop(), limit=self.preset.limit, **figures)
        result.agent_watch_opens = self.fleet.watch_opens() - self._opens[0]
        result.passive_watch_opens = self.passive.figures.opened - self._opens[1]
        result.shed_watchers = shed_watchers(self.plane) - self._shed
        result.counter_bytes = self.counter.read_bytes - self._counted[0]
        result.counter_lists = self.counter.lease_lists - self._counted[1]
        result.agent_errors = {k: v - self._errors.get(k, 0) for k, v in self.fleet.errors().items()
                               if v - self._errors.get(k, 0) > 0}
        return result

    def steady(self, seconds: float) -> Result:
        self._open_window()
        time.sleep(seconds)
        return self._close_window("steady state")

    def burst(self, name: str, faults: int, spread: float, restart: bool = False) -> Result:
        from tests.effects.helpers import XID95

        clean = [a for a in self.fleet.agents if a.name not in self.log.effects]
        chosen = self.rng.sample(clean, min(faults, len(clean)))
        offsets = sorted(self.rng.uniform(0.0, spread) for _ in chosen)
        self.log.reset()
        self._open_window()
        begin = time.monotonic()
        restarter = None
        if restart:
            restarter = threading.Timer(spread / 2, self._restart)
            restarter.start()
        for agent, offset in zip(chosen, offsets):
            delay = begin + offset - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            agent.fault(XID95)
        if restarter is not None:
            restarter.join()
        wanted = {a.name for a in chosen}
        self.log.wait(lambda log: all((n, "NoSchedule") in log.first or (n, "NoExecute") in log.first
                                      for n in wanted) and log.noexecute() >= min(self.preset.limit, len(wanted)),
                      WAIT_SECONDS)
        self._settle()
        result = self._close_window(name, faults=len(chosen))
        firsts = self.log.first
        result.to_noschedule = [min(firsts.get((a.name, e), float("inf")) for e in ("NoSchedule", "NoExecute"))
                                - a.faulted_at for a in chosen]
        result.to_noschedule = [s for s in result.to_noschedule if s != float("inf")]
        result.tainted = len(result.to_noschedule)
        result.notes.extend(untainted(a, firsts) for a in chosen
                            if (a.name, "NoSchedule") not in firsts and (a.name, "NoExecute") not in firsts)
        if result.tainted == len(chosen) and chosen:
            last = max(min(firsts.get((a.name, e), float("inf")) for e in ("NoSchedule", "NoExecute"))
                       for a in chosen)
            result.all_tainted_seconds = last - min(a.faulted_at for a in chosen)
        result.to_noexecute = [firsts[(a.name, "NoExecute")] - a.faulted_at for a in chosen
                               if (a.name, "NoExecute") in firsts]
        result.most_noexecute = self.log.most_noexecute
        result.decisions = int(sum(v for (metric, verb, resource), v in result.window.api.items()
                                   if metric == "requests" and verb == "LIST" and resource == "leases")
                               - result.counter_lists)
        if restart:
            gone, back = self.restarted
            last = max(min(firsts.get((a.name, e), float("inf")) for e in ("NoSchedule", "NoExecute"))
                       for a in chosen)
            result.notes.append(f"API server restart: {back - gone:.1f} s from its stop to its /readyz (it serves "
                                f"before that); the last faulty node tainted {last - gone:.1f} s after the stop")
            result.notes.append(f"API server restarted {spread / 2:.0f} s into the burst; the bench's watch "
                                f"resumed {self.log.restarts} time(s); passive watch re-opens "
                                f"{self.passive.figures.failures}")
        return result

    def clear(self, name: str) -> Result:
        """An operator clears every node the agents tainted (the clear annotation, as
        ``kubectl annotate`` writes it); the agents' loop hands over the cleared verdict."""
        from healthagent.effects.node_desired import CLEAR_ANNOTATION
        from tests.effects.helpers import cleared_by

        tainted = [a for a in self.fleet.agents if a.name in self.log.effects]
        session = self.plane.admin_session()
        token = f"op-{int(time.time())}"
        self.log.reset()
        self._open_window()
        started: dict[str, float] = {}

        def clear_one(agent) -> None:
            started[agent.name] = time.monotonic()
            session.patch(f"{self.plane.url}/api/v1/nodes/{agent.name}", timeout=60,
                          headers={"Content-Type": "application/merge-patch+json"},
                          json={"metadata": {"annotations": {CLEAR_ANNOTATION: token}}}).raise_for_status()
            agent.worker.submit(cleared_by(token))

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(clear_one, tainted))
        names = {a.name for a in tainted}
        self.log.wait(lambda log: not names & set(log.effects), WAIT_SECONDS)
        self._settle()
        result = self._close_window(name)
        result.cleared = len(names - set(self.log.effects))
        result.to_clean = [self.log.first[(n, "clean")] - started[n] for n in names if (n, "clean") in self.log.first]
        result.most_noexecute = self.log.most_noexecute
        result.faults = len(names)
        return result

    def dispatched_in_level(self) -> float:
        """Requests the API server dispatched so far through the agents' FlowSchema (API Priority
        and Fairness), since its last start."""
        text = self.plane.admin_session().get(f"{self.plane.url}/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("apiserver_flowcontrol_dispatched_requests_total{")
                   and 'flow_schema="healthagent"' in line)

    def _restart(self) -> None:
        self.meter.before_restart()
        began = time.monotonic()
        self.restarted = (began, float("nan"))  # gone, and (once it is) ready again
        self.plane.restart_apiserver(ready_within=WAIT_SECONDS)
        self.restarted = (began, time.monotonic())
        self.meter.after_restart()

    def _settle(self, quiet: float = 2.0) -> None:
        """Let the agents' follow-up writes (slot re-writes, Events) land before the window closes."""
        time.sleep(quiet)
