"""The agents simulated in full: each node's ``NodeEffects`` (its node watch, its budget guard,
its writes) under the ``EffectsWorker`` the DaemonSet's loop runs, with the node's own identity,
fed verdicts as the agent's loop feeds them; and the budget counter, with its own."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from healthagent.budget_counter import BudgetCounter
from healthagent.effects.backend import ApiBackend, ApiError
from healthagent.model import Verdict
from tests.support.envtest import ControlPlane

from bench.fleet_sim.cluster import AGENT_ACCOUNT, COUNTER_ACCOUNT, GPU_SELECTOR, NAMESPACE, identity

START_THREADS = 16


class Agent:
    def __init__(self, plane: ControlPlane, name: str, folder: Path, limit: int, fraction: float) -> None:
        from healthagent.config import Settings
        from healthagent.effects.kube import NodeEffects
        from healthagent.effects.state import StateStore
        from healthagent.effects.worker import EffectsWorker

        self.name = name
        settings = Settings(node_name=name, kube="kubeconfig", kubeconfig="unused",
                            state_file=str(folder / name / "state.json"), budget_max_fraction=fraction,
                            budget_max_nodes=limit, budget_node_selector=GPU_SELECTOR, budget_namespace=NAMESPACE,
                            replace_noexecute_grace_seconds=0.0)
        store = StateStore(settings.state_file)
        store.load()
        self.effects = NodeEffects(settings, identity(plane, AGENT_ACCOUNT, name), store,
                                   request_timeout=(10.0, 60.0))
        self.worker = EffectsWorker(self.effects, "boot-1", clock=time.monotonic, wall=time.time)
        self.effects.on_change = self.worker.wake
        self.faulted_at: float | None = None
        self.watch_opens = 0  # node watch requests sent (first open, resumes, re-opens)
        open_watch = self.effects.backend.watch_own_node

        def counted(*args, **kwargs):
            self.watch_opens += 1
            return open_watch(*args, **kwargs)

        self.effects.backend.watch_own_node = counted

    def fault(self, verdict: Verdict) -> None:
        self.faulted_at = time.monotonic()
        self.worker.submit(verdict)


class Fleet:
    """The full agents; ``start`` runs each worker's startup (which opens its node watch)."""

    def __init__(self, plane: ControlPlane, names: list[str], folder: Path, limit: int, fraction: float) -> None:
        self.agents = [Agent(plane, name, folder, limit, fraction) for name in names]
        self.by_name = {a.name: a for a in self.agents}

    def start(self, timeout: float) -> float:
        """Start every worker (a few at a time, as a DaemonSet rolls out); seconds until every
        watch is live."""
        begin = time.monotonic()
        for index, agent in enumerate(self.agents):
            agent.worker.start()
            if index % START_THREADS == START_THREADS - 1:
                time.sleep(0.05)
        deadline = begin + timeout
        while not all(a.effects.watching for a in self.agents) and time.monotonic() < deadline:
            time.sleep(0.2)
        return time.monotonic() - begin

    def watching(self) -> int:
        return sum(1 for a in self.agents if a.effects.watching)

    def wait_watching(self, timeout: float) -> int:
        """Wait until every agent's node watch is live again (at most ``timeout``); how many are."""
        deadline = time.monotonic() + timeout
        while self.watching() < len(self.agents) and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.watching()

    def watch_opens(self) -> int:
        return sum(a.watch_opens for a in self.agents)

    def errors(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for agent in self.agents:
            for key, value in agent.worker.errors().items():
                if value:
                    total[key] = total.get(key, 0) + value
        return total

    def stop(self) -> None:
        with ThreadPoolExecutor(START_THREADS) as pool:
            list(pool.map(lambda a: a.worker.stop(15.0), self.agents))


class Counter:
    """The budget counter on a thread, as its Deployment runs it, with its own service account."""

    def __init__(self, plane: ControlPlane, interval: float) -> None:
        backend = ApiBackend(identity(plane, COUNTER_ACCOUNT), "")
        self._counter = BudgetCounter(backend, NAMESPACE, GPU_SELECTOR)
        self._interval = interval
        self._stop = threading.Event()
        self.rounds = self.failures = 0
        self.read_bytes = 0  # the replies it read, as compact JSON (its node Table pages, its Lease list)
        self.lease_lists = 0
        read = backend._call

        def counted(*args, **kwargs):
            reply = read(*args, **kwargs)
            self.read_bytes += len(json.dumps(reply, separators=(",", ":")))
            return reply

        backend._call = counted
        list_leases = self._counter.store.list

        def listed(*args, **kwargs):
            self.lease_lists += 1
            return list_leases(*args, **kwargs)

        self._counter.store.list = listed
        self._thread = threading.Thread(target=self._run, name="budget-counter", daemon=True)

    def round(self) -> int:
        counts = self._counter.round(time.time())
        self.rounds += 1
        return sum(counts.values())

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.round()
            except ApiError:
                self.failures += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
