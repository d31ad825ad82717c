"""Scrape the real HTTP endpoint of a running agent on the demo node.

Everything is real: ``AgentRuntime`` (the object ``healthagent run`` starts) on the bundled demo
host root (32 EFA devices in a sysfs tree, a /dev/kmsg-format log, 8 x H100 through the stub
``libnvidia-ml.so.1`` compiled with ``cc``), Kubernetes in dry-run, ranks reporting through the
real client, and an XID appended to the kernel log. Every sample is parsed with
``prometheus_client.parser`` and checked against the contract table.
"""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import pytest

from healthagent.config import load_settings
from healthagent.training.access import job_token
from healthagent.training.client import TrainingReporter
from tests.support.wait import wait_for
from tests.telemetry.contract import CONTRACT, EXTRAS, parse, sample_value
from tests.support.nvml_stub import NO_CC

pytestmark = pytest.mark.integration

# May have no samples on the demo node: no NVSwitch in the scenario; H100s report row remapping,
# not page retirement (NVML says NOT_SUPPORTED, which the exporter leaves absent, never 0);
# Kubernetes in dry-run makes no API writes; a healthy source counts no errors.
NO_SAMPLES_ON_THE_DEMO_NODE = {"sxid_errors_total", "gpu_retired_pages", "gpu_retired_pages_pending",
                               "kube_writes_total", "source_errors_total",
                               "budget_limit", "budget_slots_held"}  # dry-run never reads the budget
KEY = "0123456789abcdef-training-key-0123456789"


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return parse(reply.read().decode())


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch):
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import use_stub_nvml
    from healthagent.wiring import AgentRuntime

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HEALTHAGENT_STUB_NVML_SCENARIO", raising=False)
    node = build_demo_root(tmp_path / "host")
    use_stub_nvml(node.scenario)
    settings = load_settings(env={}, flags={
        "host_root": str(node.root), "kube": "dry-run", "listen": "127.0.0.1:0",
        "state_file": str(tmp_path / "state.json"), "node_name": "demo-p5-node", "expected_gpus": 8,
        "expected_efa_devices": len(node.efa_devices), "nvml_interval_seconds": 0.2,
        "efa_interval_seconds": 0.2, "training_token": KEY,
    })
    running = AgentRuntime(settings)
    running.start()
    yield running, node
    running.stop()


def test_a_running_agent_on_the_demo_node_exports_the_contract(runtime):
    running, node = runtime
    port = running.server.port
    wait_for(lambda: running.agent.cycles > 1 and running.telemetry.snapshot is not None
               and len(running.telemetry.snapshot.efa) == 32 and len(running.telemetry.snapshot.gpus) == 8,
               what="the agent to read 8 GPUs and 32 EFA devices")
    node.inject_xid(3, 79)
    # The intake is closed by default: the job's token (derived from the key) opens it for "llama".
    reporter = TrainingReporter(job="llama", url=f"http://127.0.0.1:{running.server.intake_port}", rank=0,
                                world_size=64, token=job_token(KEY, "llama"))
    reporter.report_rendezvous(64)
    for step in range(1, 6):
        reporter.report_step(step, tokens=4096, samples=8, step_seconds=1.0)
    reporter.close(timeout=30)
    assert reporter.stats().delivered == 6
    wait_for(lambda: any(79 in f.xids for f in running.agent.verdict.findings), what="XID 79 to be found")
    wait_for(lambda: running.telemetry.snapshot.verdict is not None
               and running.telemetry.snapshot.verdict.action.value != "none", what="the verdict to be published")

    families = scrape(port)
    snapshot = running.telemetry.snapshot
    optional = NO_SAMPLES_ON_THE_DEMO_NODE
    for name, kind, labels in CONTRACT + EXTRAS:
        full = "healthagent_" + name
        assert full in families, f"{full} not exported"
        got_kind, label_sets, samples = families[full]
        assert got_kind == kind, full
        assert samples or name in optional, f"{full} has no samples"
        if samples:
            assert label_sets == {tuple(sorted(labels))}, full
    exported = {n for n in families if not n.endswith("_created")}
    assert exported == {"healthagent_" + name for name, _, _ in CONTRACT + EXTRAS}

    every = [s for _, _, samples in families.values() for s in samples]
    assert sample_value(every, "healthagent_node_action", action=snapshot.verdict.action.value) == 1
    gpu3 = next(g for g in snapshot.gpus if g.index == 3)
    assert sample_value(every, "healthagent_xid_errors_total", gpu="3", uuid=gpu3.uuid, xid="79") == 1
    assert sample_value(every, "healthagent_efa_devices") == 32
    assert sample_value(every, "healthagent_efa_devices_expected") == 32
    assert sample_value(every, "healthagent_gpus_expected") == 8
    assert sample_value(every, "healthagent_training_steps_total", job="llama") == 5
    assert sample_value(every, "healthagent_training_world_size", job="llama") == 64
    assert sample_value(every, "healthagent_source_up", source="kmsg") == 1
    assert "healthagent_efa_lifespan_total" not in families


def test_probes_of_a_running_agent(runtime):
    running, _ = runtime
    port = running.server.port
    wait_for(lambda: running.agent.cycles > 0)

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code

    wait_for(lambda: status("/readyz") == 200, what="/readyz (dry-run is ready after one cycle)")
    assert status("/healthz") == 200
