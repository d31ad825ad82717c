"""What a user watching the fleet would see, and the control plane's own figures.

``TaintLog`` is one watch on every GPU node, in a process of its own (from a list's version, in
the API server's order, resumed after an API server restart): when each node first showed the agent's NoSchedule and
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


def watch_gpu_nodes(url: str, tls: tuple[str, str, str], sink) -> None:
    """The observer's own process: list the GPU nodes, then watch them from the list's version
    (resumed after a cut, listed again after a 410), sending ``(name, effect, at)`` for every
    change and ``("", "restart", at)`` after each cut. ``at`` is this process's monotonic clock,
    which Linux shares between processes, so the bench compares it with the faults' times."""
    import requests

    session = requests.Session()
    session.trust_env = False
    session.verify, session.cert = tls[0], (tls[1], tls[2])
    version = ""
    while True:
        try:
            if not version:
                reply = session.get(f"{url}/api/v1/nodes", timeout=300,
                                    params={"labelSelector": GPU_SELECTOR, "resourceVersion": "0"})
                reply.raise_for_status()
                body = reply.json()
                sink.send([(n["metadata"]["name"], effect_of(n), time.monotonic()) for n in body["items"]])
                version = body["metadata"]["resourceVersion"]
                sink.send([("", "listed", time.monotonic())])
            params = {"watch": "true", "labelSelector": GPU_SELECTOR, "resourceVersion": version,
                      "allowWatchBookmarks": "true", "timeoutSeconds": "1800"}
            with session.get(f"{url}/api/v1/nodes", params=params, stream=True, timeout=(10, 1900)) as reply:
                reply.raise_for_status()
                for line in reply.iter_lines(chunk_size=None):
                    if not line:
                        continue
                    event = json.loads(line)
                    node = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        version = ""
                        break
                    if event.get("type") != "BOOKMARK":
                        effect = "" if event.get("type") == "DELETED" else effect_of(node)
                        sink.send([(node["metadata"]["name"], effect, time.monotonic())])
                    version = (node.get("metadata") or {}).get("resourceVersion") or version
        except (BrokenPipeError, EOFError):
            return
        except Exception:  # an API server restart: resume (or list again) a moment later
            try:
                sink.send([("", "restart", time.monotonic())])
            except (BrokenPipeError, OSError):
                return
            time.sleep(0.5)


class TaintLog:
    """The fleet's taints as a user watching them sees them: the watch runs in a process of its
    own, so a bench process busy with a thousand agents never delays when a change is seen."""

    def __init__(self, plane: ControlPlane) -> None:
        import multiprocessing

        self._cond = threading.Condition()
        self.effects: dict[str, str] = {}
        self.first: dict[tuple[str, str], float] = {}  # (node, effect or "clean") -> first time seen since reset
        self.most_noexecute = 0
        self._noexecute = 0
        self.restarts = 0
        self._listed = False
        context = multiprocessing.get_context("spawn")
        self._inbox, sink = context.Pipe(duplex=False)
        pki = plane.pki
        assert pki is not None
        self._process = context.Process(target=watch_gpu_nodes, name="taint-log", daemon=True, args=(
            plane.url, (str(pki.ca_cert), str(pki.admin_cert), str(pki.admin_key)), sink))
        self._process.start()
        sink.close()
        self._thread = threading.Thread(target=self._run, name="taint-log", daemon=True)
        self._thread.start()
        with self._cond:
            self._cond.wait_for(lambda: self._listed, 120)

    def _run(self) -> None:
        while True:
            try:
                batch = self._inbox.recv()
            except (EOFError, OSError):
                return
            with self._cond:
                for name, effect, at in batch:
                    if not name:
                        self.restarts += effect == "restart"
                        self._listed = self._listed or effect == "listed"
                    else:
                        self._saw(name, effect, at)
                self._cond.notify_all()

    def _saw(self, name: str, effect: str, at: float) -> None:
        self._noexecute -= self.effects.get(name) == "NoExecute"
        if effect:
            self.effects[name] = effect
        else:
            self.effects.pop(name, None)
        self._noexecute += effect == "NoExecute"
        self.first.setdefault((name, effect or "clean"), at)
        self.most_noexecute = max(self.most_noexecute, self._noexecute)

    def noexecute(self) -> int:
        return self._noexecute

    def reset(self) -> None:
        """A new scenario: first times and the most NoExecute start again from what is now."""
        with self._cond:
            self.first = {}
            self.most_noexecute = self.noexecute()

    def wait(self, done, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: done(self), timeout)

    def stop(self) -> None:
        self._process.terminate()
        self._process.join(10)


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

    def _scrape(self, attempts: int = 30) -> dict:
        """The API server's /metrics, asked again for a while: a server just restarted under
        10,000 returning watches drops connections in the TLS handshake."""
        for attempt in range(attempts):
            try:
                return scrape(self._plane)
            except Exception:
                if attempt == attempts - 1:
                    raise
                time.sleep(2.0)
        raise AssertionError("unreachable")

    def _processes(self) -> dict[str, tuple[float, int]]:
        import os

        out = {name: process_figures(pid) for name, pid in plane_pids(self._plane).items()}
        out["agents (bench process)"] = process_figures(os.getpid())
        return out

    def start(self) -> None:
        self._carried, self._cpu_carried = {}, {}
        self._begin = (self._scrape(), time.monotonic(), self._processes())

    def before_restart(self) -> None:
        """The API server is about to go: bank what its counters say so far (they start at 0 again)."""
        assert self._begin is not None
        api, at, procs = self._begin
        now = self._processes()
        for key, value in delta(self._scrape(), api).items():
            self._carried[key] = self._carried.get(key, 0.0) + value
        if "kube-apiserver" in procs:
            self._cpu_carried["kube-apiserver"] = now["kube-apiserver"][0] - procs["kube-apiserver"][0]
        self._begin = ({}, at, {k: v for k, v in procs.items() if k != "kube-apiserver"})

    def after_restart(self) -> None:
        assert self._begin is not None
        _, at, procs = self._begin
        procs = dict(procs)
        procs["kube-apiserver"] = self._processes()["kube-apiserver"]
        self._begin = (self._scrape(), at, procs)

    def stop(self) -> Window:
        assert self._begin is not None
        api, at, procs = self._begin
        window = delta(self._scrape(), api)
        for key, value in self._carried.items():
            window[key] = window.get(key, 0.0) + value
        now = self._processes()
        cpu = {name: now[name][0] - procs[name][0] + self._cpu_carried.get(name, 0.0) for name in now if name in procs}
        return Window(api=window, seconds=time.monotonic() - at, cpu=cpu,
                      rss={name: figures[1] for name, figures in now.items()}, etcd_bytes=etcd_size(self._plane))
