"""What a user watching the fleet would see, and the control plane's own figures.

``TaintLog`` is one watch on every GPU node (from a list's version, in the API server's order,
resumed after an API server restart): when each node first showed the agent's NoSchedule and
NoExecute and when it lost the taint, on the bench's monotonic clock, and the most nodes with
NoExecute at any moment (the budget, counted as a user would). ``Meter`` reads the API server's
``/metrics`` (requests and response bytes by verb and resource) and /proc of kube-apiserver, etcd
and the bench itself (the agents), over a window that may span an API server restart."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from bench.bench_api_scale import GPU_SELECTOR, TAINT_KEY, delta, scrape
from bench.fleet_sim.cluster import etcd_size, plane_pids, process_figures
from tests.support.envtest import ControlPlane


def effect_of(node: dict) -> str:
    effects = {t.get("effect") for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") == TAINT_KEY}
    return "NoExecute" if "NoExecute" in effects else next(iter(effects), "")


class TaintLog:
    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane
        self._session = plane.admin_session()
        self._cond = threading.Condition()
        self.effects: dict[str, str] = {}
        self.first: dict[tuple[str, str], float] = {}  # (node, effect or "clean") -> first time seen since reset
        self.most_noexecute = 0
        self.restarts = 0
        self._stop = False
        self._version = ""
        self._thread = threading.Thread(target=self._run, name="taint-log", daemon=True)
        self._thread.start()
        with self._cond:
            self._cond.wait_for(lambda: bool(self._version), 120)

    def _list(self) -> None:
        reply = self._session.get(f"{self._plane.url}/api/v1/nodes", timeout=300,
                                  params={"labelSelector": GPU_SELECTOR, "resourceVersion": "0"})
        reply.raise_for_status()
        body = reply.json()
        with self._cond:
            for node in body["items"]:
                self._saw(node["metadata"]["name"], effect_of(node), time.monotonic())
            self._version = body["metadata"]["resourceVersion"]
            self._cond.notify_all()

    def _run(self) -> None:
        while not self._stop:
            try:
                if not self._version:
                    self._list()
                self._follow()
            except Exception:  # an API server restart: resume (or list again) a moment later
                self.restarts += 1
                time.sleep(0.5)

    def _follow(self) -> None:
        params = {"watch": "true", "labelSelector": GPU_SELECTOR, "resourceVersion": self._version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": "1800"}
        with self._session.get(f"{self._plane.url}/api/v1/nodes", params=params, stream=True,
                               timeout=(10, 1900)) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines(chunk_size=None):
                if self._stop:
                    return
                if not line:
                    continue
                event = json.loads(line)
                node = event.get("object") or {}
                if event.get("type") == "ERROR":
                    self._version = ""
                    return
                version = (node.get("metadata") or {}).get("resourceVersion")
                if event.get("type") != "BOOKMARK":
                    effect = "" if event.get("type") == "DELETED" else effect_of(node)
                    with self._cond:
                        self._saw(node["metadata"]["name"], effect, time.monotonic())
                        self._cond.notify_all()
                self._version = version or self._version

    def _saw(self, name: str, effect: str, at: float) -> None:
        if effect:
            self.effects[name] = effect
        else:
            self.effects.pop(name, None)
        self.first.setdefault((name, effect or "clean"), at)
        self.most_noexecute = max(self.most_noexecute, self.noexecute())

    def noexecute(self) -> int:
        return sum(1 for effect in self.effects.values() if effect == "NoExecute")

    def reset(self) -> None:
        """A new scenario: first times and the most NoExecute start again from what is now."""
        with self._cond:
            self.first = {}
            self.most_noexecute = self.noexecute()

    def wait(self, done, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: done(self), timeout)

    def stop(self) -> None:
        self._stop = True


@dataclass
class Window:
    """Figures of one scenario's window."""

    api: dict = field(default_factory=dict)  # (metric, verb, resource) -> value
    seconds: float = 0.0
    cpu: dict = field(default_factory=dict)  # process -> CPU seconds in the window
    rss: dict = field(default_factory=dict)  # process -> resident bytes at the end
    etcd_bytes: int = 0


class Meter:
    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane
        self._begin: tuple[dict, float, dict] | None = None
        self._carried: dict = {}
        self._cpu_carried: dict = {}

    def _processes(self) -> dict[str, tuple[float, int]]:
        import os

        out = {name: process_figures(pid) for name, pid in plane_pids(self._plane).items()}
        out["agents (bench process)"] = process_figures(os.getpid())
        return out

    def start(self) -> None:
        self._carried, self._cpu_carried = {}, {}
        self._begin = (scrape(self._plane), time.monotonic(), self._processes())

    def before_restart(self) -> None:
        """The API server is about to go: bank what its counters say so far (they start at 0 again)."""
        assert self._begin is not None
        api, at, procs = self._begin
        now = self._processes()
        for key, value in delta(scrape(self._plane), api).items():
            self._carried[key] = self._carried.get(key, 0.0) + value
        if "kube-apiserver" in procs:
            self._cpu_carried["kube-apiserver"] = now["kube-apiserver"][0] - procs["kube-apiserver"][0]
        self._begin = ({}, at, {k: v for k, v in procs.items() if k != "kube-apiserver"})

    def after_restart(self) -> None:
        assert self._begin is not None
        _, at, procs = self._begin
        procs = dict(procs)
        procs["kube-apiserver"] = self._processes()["kube-apiserver"]
        self._begin = (scrape(self._plane), at, procs)

    def stop(self) -> Window:
        assert self._begin is not None
        api, at, procs = self._begin
        window = delta(scrape(self._plane), api)
        for key, value in self._carried.items():
            window[key] = window.get(key, 0.0) + value
        now = self._processes()
        cpu = {name: now[name][0] - procs[name][0] + self._cpu_carried.get(name, 0.0) for name in now if name in procs}
        return Window(api=window, seconds=time.monotonic() - at, cpu=cpu,
                      rss={name: figures[1] for name, figures in now.items()}, etcd_bytes=etcd_size(self._plane))
