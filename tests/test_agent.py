"""The loop (``healthagent.agent``): a hung source cannot stop it, source errors stay cumulative,
and the failures the agent survives are exported as ``healthagent_internal_errors_total``.

Real parts: ``AgentRuntime`` on the bundled demo host root (a /dev/kmsg-format log, 32 EFA devices
in a sysfs tree), the real state store, classifier and exporter; NVML through the stub
``libnvidia-ml.so.1`` compiled with ``cc`` where a test says so. The agent's cycles are driven by
hand (``agent.cycle()``), so nothing waits on a clock.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from prometheus_client.exposition import generate_latest

from healthagent.agent import Scheduled
from healthagent.config import load_settings
from healthagent.demo.stub_setup import use_stub_nvml
from healthagent.model import SourceHealth
from healthagent.sources.base import DeadlineSource, SourceResult
from healthagent.wiring import AgentRuntime
from tests.support.gated_source import GatedSource
from tests.support.wait import wait_for
from tests.telemetry.contract import parse, sample_value
from tests.support.nvml_stub import NO_CC


def demo_settings(tmp_path: Path, **flags):
    from healthagent.demo.node import build_demo_root

    node = build_demo_root(tmp_path / "host")
    values = {"host_root": str(node.root), "kube": "dry-run", "listen": "127.0.0.1:0", "nvml": "false",
              "state_file": str(tmp_path / "state" / "state.json"), "node_name": "n1"}
    values.update(flags)
    return node, load_settings(env={}, flags=values)


@pytest.fixture
def runtime(tmp_path: Path):
    node, settings = demo_settings(tmp_path)
    running = AgentRuntime(settings)
    yield running, node
    running.agent.shutdown(grace_seconds=5)
    running.server.stop()


def families(running: AgentRuntime) -> dict:
    return parse(generate_latest(running.telemetry.registry).decode())


def test_periodic_sources_run_under_the_configured_deadline(tmp_path):
    _, settings = demo_settings(tmp_path, source_timeout_seconds="7.5")
    running = AgentRuntime(settings)
    try:
        wrapped = {item.source.name: item.source for item in running.agent.scheduled}
        assert isinstance(wrapped["efa"], DeadlineSource) and wrapped["efa"].timeout_seconds == 7.5
    finally:
        running.server.stop()


def test_a_hung_source_does_not_stop_the_kernel_log_or_the_verdict(runtime):
    running, node = runtime
    agent = running.agent
    gated = GatedSource()
    agent.scheduled.append(Scheduled(DeadlineSource(gated, 0.05), interval=0.0))
    agent.cycle()
    gated.gate.clear()  # the driver wedges
    try:
        node.inject_xid(3, 79)
        agent.cycle()
        agent.cycle()
        assert any(79 in f.xids for f in agent.verdict.findings)  # the fault still got through
        health = {h.source: h for h in running.telemetry.snapshot.health}
        assert health["gated"].up is False and health["gated"].detail.startswith("collect hung for ")
        assert health["gated"].errors["hung"] == 1
        assert health["kmsg"].up is True
        assert gated.calls == 2  # one stuck call; later cycles started no other
        scraped = families(running)
        assert sample_value(scraped["healthagent_source_up"][2], "healthagent_source_up", source="gated") == 0
        assert sample_value(scraped["healthagent_source_errors_total"][2], "healthagent_source_errors_total",
                            source="gated", kind="hung") == 1
    finally:
        gated.gate.set()


class RaisingSource:
    """A source with its own error tally whose collect raises after the first call (a bug)."""

    name = "flaky"

    def __init__(self) -> None:
        self.calls = 0

    def collect(self, now: float) -> SourceResult:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("a bug in the source")
        return SourceResult(health=SourceHealth(source=self.name, up=True, errors={"parse": 4}))

    def close(self) -> None:
        pass


def test_source_errors_stay_cumulative_when_collect_raises(runtime):
    running, _ = runtime
    running.agent.scheduled.append(Scheduled(RaisingSource(), interval=0.0))
    counts = []
    for _ in range(4):
        running.agent.cycle()
        flaky = next(h for h in running.telemetry.snapshot.health if h.source == "flaky")
        counts.append(dict(flaky.errors))
    # The source's own tally is kept, the raised calls add up: never a reset to {"exception": 1}.
    assert counts == [{"parse": 4}, {"parse": 4, "exception": 1}, {"parse": 4, "exception": 2},
                      {"parse": 4, "exception": 3}]
    assert flaky.up is False and "a bug in the source" in flaky.detail


def test_failures_the_agent_survives_are_exported(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the state directory should be\n")
    _, settings = demo_settings(tmp_path, state_file=str(blocker / "state.json"))
    running = AgentRuntime(settings)
    try:
        running.agent.classifier.restore_state({"version": 99})  # saved by a future agent
        running.agent.cycle()
        errors = running.telemetry.snapshot.internal_errors
        assert errors[("state", "unwritable")] >= 1  # restart safety is lost: must be visible
        scraped = families(running)["healthagent_internal_errors_total"][2]
        assert sample_value(scraped, "healthagent_internal_errors_total", component="state",
                            kind="unwritable") >= 1
        # The fixed kinds exist at 0 from the first snapshot (increase() needs the series).
        assert sample_value(scraped, "healthagent_internal_errors_total", component="loop", kind="cycle") == 0
        assert sample_value(scraped, "healthagent_internal_errors_total", component="kube",
                            kind="events_dropped") == 0
        # the API server's own condition is not an internal error: its own family, at 0 too
        api = families(running)["healthagent_kube_api_errors_total"][2]
        assert sample_value(api, "healthagent_kube_api_errors_total", kind="unavailable") == 0
        assert sample_value(scraped, "healthagent_internal_errors_total", component="policy",
                            kind="restore") == 1
    finally:
        running.server.stop()


def test_http_refusals_reach_the_snapshot(runtime):
    running, _ = runtime
    running.server.count_error("refused", "test: the connection cap was reached")
    running.agent.server = running.server  # what run() does
    running.agent.cycle()
    assert running.telemetry.snapshot.internal_errors[("http", "refused")] == 1


# -- the stub NVML wedged for real -----------------------------------------------------------------

def wedge(scenario: Path) -> Path:
    """Put a FIFO where the stub reads its scenario: its next re-read blocks in fopen() holding the
    library's lock, so every NVML call hangs, as a wedged driver's do. Returns the saved content."""
    saved = scenario.with_name("scenario.saved")
    shutil.copy(scenario, saved)
    fifo = scenario.with_name("scenario.fifo")
    os.mkfifo(fifo)
    os.replace(fifo, scenario)
    return saved


def unwedge(scenario: Path, saved: Path) -> None:
    """Let the blocked reader through: open the FIFO (the reader is in it), put the regular file
    back at the path, then feed the reader the saved scenario."""
    fd = os.open(scenario, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO if nobody reads: nothing is stuck
    try:
        restored = scenario.with_name("scenario.restored")
        shutil.copy(saved, restored)
        os.replace(restored, scenario)
        os.set_blocking(fd, True)
        os.write(fd, saved.read_bytes())
    finally:
        os.close(fd)


@pytest.mark.integration
def test_a_wedged_nvml_is_reported_hung_while_the_loop_goes_on(tmp_path, monkeypatch):
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HEALTHAGENT_STUB_NVML_SCENARIO", raising=False)
    node, settings = demo_settings(tmp_path, nvml="true", source_timeout_seconds="0.5")
    use_stub_nvml(node.scenario)
    running = AgentRuntime(settings)
    agent = running.agent
    nvml = next(item for item in agent.scheduled if item.source.name == "nvml")
    saved = None
    try:
        agent.cycle()
        assert len(agent.telemetry.snapshot.gpus) == 8
        saved = wedge(node.scenario)
        nvml.next_due = 0.0
        agent.cycle()
        wait_for(lambda: nvml.source.stuck, what="an NVML call to block on the wedged library")
        node.inject_xid(5, 79)
        for _ in range(3):
            nvml.next_due = 0.0
            agent.cycle()
        health = {h.source: h for h in agent.telemetry.snapshot.health}
        assert health["nvml"].up is False and health["nvml"].detail.startswith("collect hung for ")
        assert health["nvml"].errors["hung"] == 1
        assert any(79 in f.xids for f in agent.verdict.findings)  # the kernel log still decides
        assert agent.nvml.take_events() == []  # the loop's event drain never touches the driver
        threading.Thread(target=unwedge, args=(node.scenario, saved), daemon=True).start()
        wait_for(lambda: not nvml.source.stuck, what="the wedged call to return")
        saved = None
        nvml.next_due = 0.0
        agent.cycle()
        health = {h.source: h for h in agent.telemetry.snapshot.health}
        assert health["nvml"].up is True and health["nvml"].errors["hung"] == 1
        assert len(agent.telemetry.snapshot.gpus) == 8
    finally:
        if saved is not None:
            try:
                unwedge(node.scenario, saved)
            except OSError:
                pass
        agent.shutdown(grace_seconds=5)
        running.server.stop()


@pytest.mark.parametrize("owns_process", [True, False])
def test_the_warm_objects_are_frozen_once_after_the_first_cycle_only_by_the_process_owner(tmp_path, monkeypatch,
                                                                                         owns_process):
    """``healthagent run`` freezes what is alive after its first cycle (a full garbage collection
    would walk it all every few minutes); an agent run inside another process (the demo, tests)
    must leave that process's collector alone."""
    import healthagent.agent as agent_module

    frozen_after: list[int] = []
    _, settings = demo_settings(tmp_path, efa_interval_seconds="0.2")
    running = AgentRuntime(settings)
    monkeypatch.setattr(agent_module, "freeze_warm_objects", lambda: frozen_after.append(running.agent.cycles))
    running.start(owns_process=owns_process)
    try:
        wait_for(lambda: running.agent.cycles >= 3, what="three cycles")
    finally:
        running.stop(grace_seconds=5)
    assert frozen_after == ([1] if owns_process else [])


def test_the_loop_sleeps_at_most_idle_seconds_when_no_source_is_due(tmp_path):
    """``idle_seconds`` bounds the sleep between cycles whatever the source intervals: the liveness
    probe wants a cycle within its heartbeat timeout."""
    _, settings = demo_settings(tmp_path, efa_interval_seconds="600", idle_seconds="2.5")
    running = AgentRuntime(settings)
    try:
        running.agent.cycle()
        if running.agent.data_waiter() is None:
            pytest.skip("no inotify for the kernel-log file here: the loop polls it every kmsg_poll_seconds")
        assert 2.0 < running.agent.next_wait() <= 2.5
    finally:
        running.agent.shutdown(grace_seconds=5)
        running.server.stop()
