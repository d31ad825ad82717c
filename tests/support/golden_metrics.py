"""The demo node's whole ``/metrics`` in one fixed state: the renderer behind the golden files.

Modelled on node_exporter's end-to-end test (a fixture tree, one scrape, a committed expected
file). ``tests/telemetry/test_golden_metrics.py`` compares what ``render_in_fresh_process`` returns
with the committed ``tests/fixtures/metrics/demo-node.prom`` (text format 0.0.4) and
``demo-node.openmetrics`` (OpenMetrics 1.0) byte for byte; ``tests/fixtures/metrics/regenerate.py``
writes them from the very same function, so the test and the script cannot drift.

After an intended change to what a scrape shows (a metric, a label, a help text, the demo node,
the scripted fault), regenerate from the repo root and review the diff like any other change:

    python -m tests.fixtures.metrics.regenerate   # or: python tests/fixtures/metrics/regenerate.py
    git diff tests/fixtures/metrics/

What runs is the real agent: the ``AgentRuntime`` that ``healthagent run`` builds, on the bundled
demo host root (32 EFA devices in sysfs, a /dev/kmsg-format log, 8 x H100 through the stub
``libnvidia-ml.so.1`` compiled with ``cc`` by ``stub_setup.use_stub_nvml``), with its own HTTP
server scraped over loopback and the ``Accept`` header choosing the format, so the bytes are
exactly what Prometheus would receive. The script: a healthy cycle; then XID 94 on GPU 3 in the
kernel log with the uncorrectable ECC error and pending row remap NVML shows for it, and a cycle;
a training job reporting and shrinking after the fault; a last cycle that publishes what the
effects reached. Nothing in the output is masked; every value that would vary is fixed at its
source instead:

- wall clock: the runtime's clock (the loop's and the effects worker's) and the training
  intake's are one ``FakeClock`` moved by hand, and the loop is driven by calling
  ``Agent.cycle()`` (no loop thread, no timers). The HTTP server's liveness clock stays real: it
  only answers /healthz;
- Kubernetes: dry-run (deterministic: no API server, and dry-run never counts writes); its
  effects thread is real, so the script waits until it has tainted for the fault, stops it, and
  only then runs the cycle whose snapshot is scraped;
- the demo root's ``/proc/stat`` btime and boot id are rewritten to fixed values (the builder
  derives them from ``time.time()`` and ``uuid4``), so kernel-log record times are fixed;
- ``healthagent_collect_duration_seconds``: the loop measures each collection with
  ``time.monotonic()``, which has no parameter; ``healthagent.agent``'s ``time`` is swapped for a
  shim whose ``monotonic()`` advances exactly ``COLLECT_SECONDS`` per call (a power of two, so
  sums are exact), i.e. every collection "takes" 3.90625 ms;
- ``*_created`` of that histogram: prometheus_client stamps each label set with ``time.time()``
  when it is first observed; ``prometheus_client.metrics``' ``time`` is swapped the same way,
  to the fake clock;
- ``healthagent_build_info``: a fixed version, so a release does not rewrite the golden file.

pynvml and the stub library keep process-global state (an init refcount and the scenario path
read at the first ``nvmlInit``), so the rendering always runs in a fresh interpreter
(``python -m tests.support.golden_metrics``): a test that ran earlier in the same process cannot
leak its NVML scenario into the golden file.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

from healthagent.demo.node import UPTIME_SECONDS, DemoNode

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "tests" / "fixtures" / "metrics"
REGENERATE = "python -m tests.fixtures.metrics.regenerate"

NOW = 1_760_000_000.0  # 2025-10-09T08:53:20Z, the telemetry tests' FakeClock start
CYCLE_SECONDS = 10.0  # between the scripted cycles; the NVML and EFA intervals, so both collect each time
# /proc/stat btime. ``DemoNode.inject_xid`` stamps a record at the demo's uptime (plus the real
# seconds since the build), so the XID lands about 4.3 s after NOW: between the first two cycles.
BOOT_TIME = int(NOW - UPTIME_SECONDS) + 5
BOOT_ID = "0f4c2a7e-5b1d-4e8a-9c3f-6d2b8a1e7f05"
VERSION = "0.0.0-golden"
COLLECT_SECONDS = 2.0 ** -8  # what every collection "takes" (see the module docstring)
JOB = "llama-golden"
WAIT_SECONDS = 60.0  # for the effects worker thread: generous, a bound on a hang only

OPENMETRICS_ACCEPT = "application/openmetrics-text; version=1.0.0; charset=utf-8"


@dataclass(frozen=True)
class GoldenFile:
    """One committed exposition: its file name and the ``Accept`` header that asks for it."""

    name: str
    accept: str | None  # None: no Accept header, as Prometheus' text-format fallback

    @property
    def path(self) -> Path:
        return GOLDEN_DIR / self.name


GOLDEN_FILES: tuple[GoldenFile, ...] = (
    GoldenFile("demo-node.prom", None),
    GoldenFile("demo-node.openmetrics", OPENMETRICS_ACCEPT),
)


# -- the fixed state ------------------------------------------------------------------------------

def _fix_boot(root: Path) -> None:
    """Pin what ``build_demo_root`` takes from the wall clock and ``uuid4``: btime, boot id."""
    stat = root / "proc" / "stat"
    stat.write_text(re.sub(r"(?m)^btime \d+$", f"btime {BOOT_TIME}", stat.read_text(encoding="ascii")),
                    encoding="ascii")
    (root / "proc" / "sys" / "kernel" / "random" / "boot_id").write_text(BOOT_ID + "\n", encoding="ascii")


def _baseline(scenario: Path) -> None:
    """Counters a node has after months in service: some corrected ECC, a few PCIe replays."""
    from healthagent.demo import stub_nvml

    for gpu, field, value in ((1, "ecc_aggregate_corrected", 12), (6, "ecc_volatile_corrected", 2),
                              (6, "ecc_aggregate_corrected", 9), (6, "pcie_replay", 3),
                              (4, "remapped_rows_correctable", 1)):
        stub_nvml.set_gpu_field(scenario, gpu, field, value)


def _fault(node: DemoNode) -> None:
    """The demo's fault: XID 94 (contained memory error) on GPU 3, with the uncorrectable ECC error
    and the pending row remap NVML shows for it."""
    from healthagent.demo import stub_nvml

    for field, value in (("ecc_volatile_uncorrected", 1), ("ecc_aggregate_uncorrected", 1),
                         ("ecc_volatile_corrected", 4), ("ecc_aggregate_corrected", 4),
                         ("remapped_rows_uncorrectable", 1), ("remap_pending", True)):
        stub_nvml.set_gpu_field(node.scenario, 3, field, value)
    node.inject_xid(3, 94)


def _training_reports() -> list[dict[str, Any]]:
    """A 16-rank job as this node's rank 0 reports it: rendezvous, three steps of 1.5 s, then the
    re-rendezvous at 8 ranks after the fault (a shrink right after a node action: reason fault)."""
    reports: list[dict[str, Any]] = [{"type": "rendezvous", "job": JOB, "world_size": 16,
                                      "timestamp": NOW + 1.0}]
    for step in (1, 2, 3):
        reports.append({"type": "step", "job": JOB, "rank": 0, "world_size": 16, "step": step,
                        "tokens": 16 * 4096, "samples": 16, "step_seconds": 1.5,
                        "timestamp": NOW + 1.0 + 1.5 * step})
    reports.append({"type": "rendezvous", "job": JOB, "world_size": 8, "reason": "node_failure",
                    "timestamp": NOW + 9.0})
    return reports


# -- what cannot take a clock parameter -----------------------------------------------------------

class _TimeShim(types.SimpleNamespace):
    """Stands in for the ``time`` module inside one module: the named functions are replaced,
    everything else is the real module's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@contextmanager
def _fixed_time(clock: Callable[[], float]) -> Iterator[None]:
    """Fix the two clock reads that take no parameter (see the module docstring)."""
    ticks = iter(range(1, 1 << 40))
    agent_time = _TimeShim(monotonic=lambda: next(ticks) * COLLECT_SECONDS)
    created_time = _TimeShim(time=clock)
    import prometheus_client.metrics

    import healthagent.agent

    with mock.patch.object(healthagent.agent, "time", agent_time), \
            mock.patch.object(prometheus_client.metrics, "time", created_time):
        yield


# -- rendering ------------------------------------------------------------------------------------

def _wait(predicate: Callable[[], bool], what: str) -> None:
    """Poll a condition another thread makes true; the bound is against a hang, not a timing."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _get(url: str, accept: str | None) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=30) as reply:
        if reply.headers.get("Content-Encoding"):
            raise RuntimeError(f"unexpected Content-Encoding {reply.headers['Content-Encoding']}")
        return reply.read()


def _post(url: str, reports: list[dict[str, Any]]) -> None:
    request = urllib.request.Request(url, data=json.dumps(reports).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        if reply.status != 202:
            raise RuntimeError(f"training intake answered {reply.status}: {reply.read()!r}")


def render_demo_node(workdir: Path) -> dict[str, bytes]:
    """Build the demo node in ``workdir``, run the scripted cycles, scrape every golden format.

    Must run in a process that has not used NVML yet (see the module docstring); use
    ``render_in_fresh_process``. Returns {golden file name: exposition bytes}.
    """
    from healthagent import wiring
    from healthagent.config import load_settings
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import use_stub_nvml
    from healthagent.training import intake as training_intake
    from healthagent.telemetry.server import TRAINING_PATH
    from healthagent.wiring import AgentRuntime
    from tests.telemetry.harness import FakeClock

    node = build_demo_root(workdir / "host")
    _fix_boot(node.root)
    _baseline(node.scenario)
    use_stub_nvml(node.scenario)
    settings = load_settings(env={}, flags={
        "host_root": str(node.root), "kube": "dry-run", "listen": "127.0.0.1:0",
        "state_file": str(workdir / "state.json"), "node_name": "demo-p5-node",
        "nvml_interval_seconds": CYCLE_SECONDS, "efa_interval_seconds": CYCLE_SECONDS,
        # A bound on a hang only: a slow machine must not turn a collection into "hung".
        "source_timeout_seconds": 120,
        "training_intake": "open",  # the reports below carry no token; the scrape is the subject
    })
    clock = FakeClock(NOW)
    with ExitStack() as stack:
        stack.enter_context(_fixed_time(clock))
        # AgentRuntime hands its clock to the loop and the effects worker but builds the intake
        # with the wall clock (job wall time would then count real microseconds between reports).
        # The version is fixed too, so a release does not rewrite the golden files.
        with mock.patch.object(wiring, "TrainingIntake",
                               partial(training_intake.TrainingIntake, clock=clock)), \
                mock.patch.object(wiring, "__version__", VERSION):
            runtime = AgentRuntime(settings, clock=clock)
        agent, server = runtime.agent, runtime.server
        server.start()  # the HTTP server alone: the loop is driven below, cycle by cycle
        stack.callback(server.stop)
        agent.server = server  # as ``Agent.run`` sets it (its error tally is exported)
        agent.start_effects()
        stack.callback(agent.shutdown)
        worker = agent.effects_worker
        assert worker is not None, "kube=dry-run builds effects"
        url = f"http://127.0.0.1:{server.port}"

        agent.cycle()  # healthy: 8 GPUs, 32 EFA devices, the boot log without XIDs
        _wait(lambda: worker.reconciles >= 1, "the first dry-run reconcile")
        _fault(node)
        clock.advance(CYCLE_SECONDS)
        agent.cycle()  # XID 94 from the kernel log, GPU 3's counters from NVML
        _wait(lambda: worker.status.taint_effect == "NoSchedule", "the dry-run taint")
        worker.stop(WAIT_SECONDS)  # nothing changes the kube status after this
        _post(f"http://127.0.0.1:{server.intake_port}" + TRAINING_PATH, _training_reports())
        clock.advance(CYCLE_SECONDS)
        agent.cycle()  # publishes the kube status the worker reached
        return {golden.name: _get(url + "/metrics", golden.accept) for golden in GOLDEN_FILES}


def render_in_fresh_process(cache_dir: Path | None = None) -> dict[str, bytes]:
    """``render_demo_node`` in a new interpreter (``python -m tests.support.golden_metrics``).

    ``cache_dir`` is where the stub NVML library is compiled (``XDG_CACHE_HOME``); None keeps the
    caller's. The child reads no ``HEALTHAGENT_*`` variable: the demo root's own scenario is used.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHAGENT_")}
    if cache_dir is not None:
        env["XDG_CACHE_HOME"] = str(cache_dir)
    proc = subprocess.run([sys.executable, "-m", "tests.support.golden_metrics"], cwd=REPO_ROOT,
                          env=env, capture_output=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"rendering the demo node failed (exit {proc.returncode}):\n"
                           f"{proc.stderr.decode(errors='replace')[-6000:]}")
    data = json.loads(proc.stdout)
    return {name: text.encode("utf-8") for name, text in data.items()}


MAX_DIFF_LINES = 200  # a failure shows this much of the diff; the rest is counted


def golden_mismatch(golden: GoldenFile, scraped: bytes) -> str | None:
    """None when ``scraped`` is the committed file byte for byte; else what differs (a unified
    diff, golden file first) and how to regenerate."""
    if not golden.path.is_file():
        return (f"{golden.path.relative_to(REPO_ROOT)} does not exist; write it with: {REGENERATE}")
    expected = golden.path.read_bytes()
    if expected == scraped:
        return None
    relative = golden.path.relative_to(REPO_ROOT)
    diff = list(difflib.unified_diff(
        expected.decode("utf-8", "replace").splitlines(keepends=True),
        scraped.decode("utf-8", "replace").splitlines(keepends=True),
        fromfile=f"{relative} (committed)", tofile="the demo node's /metrics (now)", n=2))
    if not diff:  # bytes that are not UTF-8 differ, and decode to the same replacement characters
        diff = [f"same lines, different bytes: {len(expected)} committed, {len(scraped)} scraped\n"]
    shown = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                    for line in diff[:MAX_DIFF_LINES])
    if len(diff) > MAX_DIFF_LINES:
        shown += f"... {len(diff) - MAX_DIFF_LINES} more diff lines\n"
    return (f"{relative} differs from the demo node's /metrics (- committed, + now):\n{shown}\n"
            f"If the change is intended, regenerate and review the diff:\n"
            f"    {REGENERATE}\n    git diff {relative.parent}/")


def main() -> int:
    """Child side of ``render_in_fresh_process``: JSON {file name: exposition} on stdout."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="healthagent-golden-") as tmp:
        rendered = render_demo_node(Path(tmp))
    sys.stdout.write(json.dumps({name: body.decode("utf-8") for name, body in rendered.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
