"""The wiring (``healthagent/wiring.py``): what the settings ask for is what gets built and joined,
and the production path never compiles a library or changes the environment (only the demo and
the tests put the stub NVML library in place, ``healthagent/demo/stub_setup.py``).

Real parts: ``AgentRuntime`` on the bundled demo host root, with Kubernetes off or in dry-run.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from healthagent.config import load_settings
from healthagent.demo.node import build_demo_root
from healthagent.demo.stub_nvml import SCENARIO_ENV
from healthagent.effects.worker import EffectsWorker
from healthagent.model import KubeStatus
from healthagent.wiring import AgentRuntime, build_sources


def settings_for(tmp_path: Path, **flags):
    node = build_demo_root(tmp_path / "host")
    values = {"host_root": str(node.root), "listen": "127.0.0.1:0", "node_name": "n1",
              "state_file": str(tmp_path / "state.json")}
    values.update(flags)
    return load_settings(env={}, flags=values)


@contextmanager
def built(tmp_path: Path, **flags) -> Iterator[AgentRuntime]:
    """An ``AgentRuntime`` built (not started) on a fresh demo root, taken apart afterwards."""
    runtime = AgentRuntime(settings_for(tmp_path, **flags))
    try:
        yield runtime
    finally:
        runtime.agent.shutdown(grace_seconds=5)
        runtime.server.stop()


def test_building_the_agent_with_nvml_compiles_nothing_and_sets_no_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(SCENARIO_ENV, raising=False)
    before = dict(os.environ)
    with built(tmp_path, nvml="true", kube="dry-run") as runtime:
        assert runtime.agent.nvml is not None  # NVML is asked for and built...
        assert dict(os.environ) == before  # ...without pointing anything at the demo's scenario
        assert not (tmp_path / "cache").exists()  # and without compiling the stub


def test_dry_run_effects_get_a_worker_that_the_node_watch_wakes(tmp_path):
    with built(tmp_path, nvml="false", kube="dry-run") as runtime:
        worker = runtime.agent.effects_worker
        assert isinstance(worker, EffectsWorker)
        runtime.agent.wake.clear()
        worker._effects.on_change()  # what the node watch calls when the node changed
        assert worker._changed.is_set() and runtime.agent.wake.is_set()  # the worker and the loop
        assert runtime.agent.node_clear == worker._effects.pending_clear  # the loop reads the node
        assert runtime.agent.kube_status == KubeStatus(mode="dry-run")
        boot_id = tmp_path / "host" / "proc" / "sys" / "kernel" / "random" / "boot_id"
        assert runtime.agent.boot_id == boot_id.read_text().strip()
        # p5.48xlarge by its firmware: 8 GPUs; EFA devices only when configured (or asked of the table)
        assert (runtime.agent.expected_gpus, runtime.agent.expected_efa_devices) == (8, None)


def test_kube_off_builds_no_effects_at_all(tmp_path):
    with built(tmp_path, nvml="false", kube="off") as runtime:
        assert runtime.agent.effects_worker is None
        assert runtime.agent.kube_status == KubeStatus(mode="off")


def test_the_sources_are_what_the_settings_ask_for(tmp_path):
    sources = build_sources(settings_for(tmp_path, nvml="false", dcgm_url="http://127.0.0.1:9/metrics"))
    try:
        assert [item.source.name for item in sources.scheduled] == ["efa", "rdma", "pcie_aer", "dcgm"]
        assert sources.nvml is None and sources.kernel_log.name == "kmsg"
        assert [source.name for source in sources.all()] == ["efa", "rdma", "pcie_aer", "dcgm", "kmsg"]
    finally:
        for source in sources.all():
            source.close()


def test_policy_gets_the_boot_time_on_the_decision_clock_and_the_reading_intervals(tmp_path):
    """The boot is the moment the decision clock's monotonic part read zero: its epoch, kept with
    the boot id. A policy file whose window cannot hold its count at the configured interval
    stops the build with the one line that names it."""
    import pytest

    from healthagent.policy.settings import PolicyError
    from healthagent.wiring import build_classifier

    with built(tmp_path, nvml="false", kube="off") as runtime:
        assert runtime.agent.boot_time == runtime.state.get("clock")["epoch"]
        assert runtime.agent.clock.epoch == runtime.agent.boot_time
    policy = tmp_path / "policy.yaml"
    policy.write_text("findings:\n  EFA_RX_DROPS: {count: 3, window: 40s}\n", encoding="utf-8")
    settings = load_settings(env={}, flags={"policy_file": str(policy), "efa_interval_seconds": "20"})
    assert build_classifier(settings).policy.rule("EFA_RX_DROPS").window == 40.0
    with pytest.raises(PolicyError, match=r"^findings.EFA_RX_DROPS.window: .* at least 60s"):
        build_classifier(load_settings(env={}, flags={"policy_file": str(policy), "efa_interval_seconds": "30"}))
