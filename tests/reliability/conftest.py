"""Fixtures of the reliability suite: the demo node, the fake API server, the agent in-process.

Every test here drives the real agent (``AgentRuntime``, what ``healthagent run`` starts, or the
command itself in a subprocess) with its real sources on the demo node (``build_demo_root``),
through the real ``kubernetes`` client to the fake API server, and checks what an operator would:
the node object, the Events, the agent's /metrics (parsed with ``prometheus_client.parser``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest

from healthagent.config import load_settings
from tests.reliability.helpers import NODE
from tests.support.live_agent import HoldingKubeFake, write_kubeconfig
from tests.support.nvml_stub import NO_CC


@pytest.fixture(scope="session")
def stub_cache(tmp_path_factory) -> Path:
    """One XDG cache for the whole suite, so the stub libnvidia-ml.so.1 is compiled once."""
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture
def needs_cc() -> None:
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)


@pytest.fixture
def fake():
    """The fake API server with 20 GPU nodes (see tests/support/kubefake/ for what it leaves out)."""
    with HoldingKubeFake() as server:
        server.seed_nodes(20)
        yield server


@pytest.fixture
def demo(tmp_path):
    from healthagent.demo.node import build_demo_root

    return build_demo_root(tmp_path / "root")


# How soon the effects reconcile again by themselves (the product's DEFAULT_RETRY_SECONDS is 5 s):
# a test that fails a write (a 500, a 409 storm, the server down) waits for that retry, and it is
# the same reconcile at either interval.
EFFECTS_RETRY_SECONDS = 0.2


@pytest.fixture
def start_agent(tmp_path, demo, fake, stub_cache, monkeypatch) -> Callable:
    """``start_agent(**flags)``: an ``AgentRuntime`` on the demo node writing to the fake API server,
    started; stopped at the end of the test. NVML is off unless ``nvml="true"`` (then the stub).
    The effects retry after ``EFFECTS_RETRY_SECONDS``."""
    from healthagent.demo.stub_setup import use_stub_nvml
    from healthagent.wiring import AgentRuntime

    runtimes = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(stub_cache))
    monkeypatch.setenv("HEALTHAGENT_STUB_NVML_SCENARIO", str(demo.scenario))

    def start(**flags) -> AgentRuntime:
        values = dict(host_root=str(demo.root), kube="kubeconfig", node_name=NODE, nvml="false",
                      kubeconfig=str(write_kubeconfig(fake.url, tmp_path / "kubeconfig")),
                      state_file=str(tmp_path / "state" / "state.json"), listen="127.0.0.1:0",
                      expected_efa_devices=32)
        values.update(flags)
        if values["nvml"] == "true":
            use_stub_nvml(demo.scenario)
        runtime = AgentRuntime(load_settings(env={}, flags=values))
        runtime.agent.effects_worker.retry_seconds = EFFECTS_RETRY_SECONDS
        runtime.start()
        runtimes.append(runtime)
        return runtime

    yield start
    for runtime in runtimes:
        runtime.stop()
