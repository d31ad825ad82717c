"""A running agent for the reliability suite and the benchmarks: as a subprocess or in-process,
its /metrics parsed, its process measured, and a fake API server that can hold a write.

Shared by ``tests/reliability`` and ``bench/`` so a figure in docs/benchmarks.md and a test in CI
drive the agent the same way:

- ``AgentProcess`` starts the real ``python -m healthagent run`` (the DaemonSet's command) with the
  flags given, finds its HTTP port in its log, and can scrape it, read its RSS/CPU from /proc,
  signal it (SIGTERM, SIGKILL) and wait for it;
- ``HoldingKubeFake`` is the fake API server (``tests/support/kubefake/``, see there what the fake
  leaves out of Kubernetes) with one more switch: hold the next matching request until the test
  lets it through (applied, as a write whose reply was lost) or fails it (never applied). That is
  how a test kills the agent "between deciding and writing";
- ``Scrape`` is one /metrics reply parsed with ``prometheus_client.parser``;
- ``wait_until`` polls a condition with a generous deadline (a bound, never a measurement).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.kubefake import KubeFake
from tests.support.wait import wait_for as wait_until  # noqa: F401  (the benches and tests import it from here)

REPO_ROOT = Path(__file__).resolve().parents[2]
_PAGE_KIB = os.sysconf("SC_PAGESIZE") // 1024
_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_kubeconfig(server_url: str, path: Path) -> Path:
    """A kubeconfig with one cluster (no TLS, no credentials: the fake has no authentication)."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server_url}}],
        "users": [{"name": "agent", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


# -- /metrics ----------------------------------------------------------------------------------------

class Scrape:
    """One /metrics body, parsed by ``prometheus_client.parser`` (samples keep their full names)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    @classmethod
    def of(cls, port: int, timeout: float = 10.0) -> "Scrape":
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as reply:
            return cls(reply.read().decode("utf-8"))

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the one sample with exactly these labels; None when absent."""
        found = [s.value for s in self.samples if s.name == name and s.labels == labels]
        if len(found) > 1:
            raise AssertionError(f"{name}{labels}: {len(found)} samples")
        return found[0] if found else None

    def total(self, name: str, **labels: str) -> float:
        """Sum over the samples of ``name`` whose labels include these."""
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def series(self, prefix: str = "healthagent_") -> int:
        return sum(1 for s in self.samples if s.name.startswith(prefix))


def scrape_or_none(port: int) -> Scrape | None:
    """A scrape, or None while the server is not answering (a starting or restarting agent)."""
    try:
        return Scrape.of(port, timeout=5.0)
    except OSError:
        return None


# -- /proc -------------------------------------------------------------------------------------------

def proc_status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/PID/status (``VmRSS``, ``VmHWM``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def proc_cpu_seconds(pid: int | str = "self", task: int | None = None) -> float:
    """User + system CPU seconds of a process (or one of its threads) from /proc."""
    path = f"/proc/{pid}/task/{task}/stat" if task is not None else f"/proc/{pid}/stat"
    with open(path, encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def proc_rss_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * _PAGE_KIB


# -- the agent as a process --------------------------------------------------------------------------

class AgentProcess:
    """``python -m healthagent run`` as the DaemonSet runs it, with its stderr in a log file."""

    def __init__(self, flags: dict[str, Any], log_path: Path, env: dict[str, str] | None = None,
                 python: str | None = None) -> None:
        """``python``: the interpreter to run (default this one), e.g. a venv holding only what
        the production image installs."""
        flags = dict(flags)
        if str(flags.get("listen", "127.0.0.1:0")).endswith(":0"):
            # a port picked here, so the log level does not matter; the race with another
            # process binding it in between is one nobody on a test machine loses
            flags["listen"] = f"127.0.0.1:{free_port()}"
        self.port = int(str(flags["listen"]).rsplit(":", 1)[1])
        # The training intake has a port of its own (default 9412): a free one too, so agents of
        # tests running side by side never compete for it.
        self.intake_port = free_port()
        argv = [python or sys.executable, "-m", "healthagent", "run", "--set",
                f"training_listen=127.0.0.1:{self.intake_port}"]
        for key, value in flags.items():
            if value is None or value is False:
                continue
            argv.append("--" + key.replace("_", "-"))
            if value is not True:
                argv.append(str(value))
        self.argv = argv
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env.pop("HEALTHAGENT_STUB_NVML_SCENARIO", None)
        full_env.update(env or {})
        full_env["PYTHONUNBUFFERED"] = "1"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=full_env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_log(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """Wait for a log line matching ``pattern`` (fails at once if the process died)."""
        regex = re.compile(pattern)

        def seen():
            match = regex.search(self.log())
            if match is None and self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode} before logging {pattern!r}:\n"
                                     + self.log()[-4000:])
            return match

        return wait_until(seen, timeout, f"log line {pattern!r}")

    def scrape(self) -> Scrape:
        return Scrape.of(self.port)

    def wait_metric(self, predicate: Callable[[Scrape], bool], timeout: float = 60.0,
                    what: str = "metric") -> Scrape:
        def check():
            scrape = scrape_or_none(self.port)
            return scrape if scrape is not None and predicate(scrape) else None

        return wait_until(check, timeout, what, interval=0.05)

    def rss_kib(self) -> int:
        return proc_status_kib(self.pid, "VmRSS")

    def hwm_kib(self) -> int:
        return proc_status_kib(self.pid, "VmHWM")

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.pid)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Stop the process if it still runs (SIGTERM, then SIGKILL) and close the log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


# -- a fake API server that can hold a request ---------------------------------------------------------

@dataclass
class Hold:
    """One held request: ``arrived`` is set when it reached the server; ``release`` decides its fate."""

    matches: Callable[[str, str, Any], bool]
    arrived: threading.Event
    _go: threading.Event
    apply: bool = True
    answer: int = 0  # stored, but answered with this status (a 504 at the API server's deadline)
    method: str = ""
    path: str = ""
    body: Any = None

    def release(self, apply: bool = True, answer: int = 0) -> None:
        """Let it through (``apply``: the server stores it) or fail it with a 500 (never stored);
        ``answer``: stored, and answered with that status all the same (a write that landed after
        the API server's deadline answered 504 Timeout)."""
        self.apply, self.answer = apply, answer
        self._go.set()


class HoldingKubeFake(KubeFake):
    """``KubeFake`` plus ``hold(matches)``: the next request ``matches(method, path, body)`` accepts
    waits inside the server until the test releases it. The HTTP conversation is real: the client
    is stuck waiting for a reply, exactly as with a slow API server; a killed client never hears it."""

    def __init__(self, host: str = "127.0.0.1", hold_limit_seconds: float = 120.0) -> None:
        super().__init__(host)
        self._holds: list[Hold] = []
        self._hold_limit = hold_limit_seconds

    def hold(self, matches: Callable[[str, str, Any], bool]) -> Hold:
        entry = Hold(matches=matches, arrived=threading.Event(), _go=threading.Event())
        with self._lock:
            self._holds.append(entry)
        return entry

    def stop(self) -> None:
        """Stop serving; a request still held is failed, so no handler thread waits out its limit."""
        with self._lock:
            holds = list(self._holds)
        for entry in holds:
            if not entry._go.is_set():
                entry.release(apply=False)
        super().stop()

    def handle(self, method: str, path: str, query: dict[str, str], content_type: str,
               body: Any, accept: str = "") -> tuple[int, Any]:
        with self._lock:
            entry = next((h for h in self._holds if not h.arrived.is_set() and h.matches(method, path, body)),
                         None)
            if entry is not None:
                entry.method, entry.path, entry.body = method, path, body
                entry.arrived.set()
        if entry is not None:
            entry._go.wait(self._hold_limit)
            if not entry.apply:
                return 500, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500,
                             "reason": "InternalError", "message": "held by the test and failed"}
            if entry.answer:
                super().handle(method, path, query, content_type, body, accept)
                return entry.answer, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": entry.answer,
                                      "reason": "Timeout", "message": "stored, answered after the deadline"}
        return super().handle(method, path, query, content_type, body, accept)


def taint_write(taint_key: str) -> Callable[[str, str, Any], bool]:
    """Matches the PATCH of the node object that carries the agent's taint (a JSON patch whose
    taint list, or a strategic-merge patch whose ``spec.taints``, holds the agent's key)."""
    def matches(method: str, path: str, body: Any) -> bool:
        if method != "PATCH" or not re.fullmatch(r"/api/v1/nodes/[^/]+", path):
            return False
        if isinstance(body, list):
            taints = [t for op in body if isinstance(op, dict) and op.get("op") == "add"
                      and op.get("path") == "/spec/taints" for t in op.get("value") or []]
        elif isinstance(body, dict):
            taints = (body.get("spec") or {}).get("taints") or []
        else:
            return False
        return any(isinstance(t, dict) and t.get("key") == taint_key for t in taints)

    return matches


def owned_taints(node: dict, taint_key: str) -> list[dict]:
    return [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") == taint_key]

