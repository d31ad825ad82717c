"""The agent process killed or stopped while a write is in flight: ``healthagent run`` itself, in a
subprocess, with a kubeconfig pointing at the fake API server.

The fake holds the PATCH that carries the taint (``HoldingKubeFake.hold``), so the test knows the
agent has decided (the state file already holds the finding: the loop saves it before handing
the verdict to the effects thread) and is exactly between deciding and writing:

- SIGKILL there, then the held write is either stored (the agent never heard the reply) or failed,
  then the agent starts again on the same state file: the fault is not lost, the taint and the
  Event exist once, the XID is not counted again;
- SIGTERM there: the agent waits for the write in flight, finishes its reconcile and exits 0; a
  restart then has nothing left to write. And with an API server that never answers, SIGTERM still
  ends the process with 0 once the grace has passed.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests.reliability.helpers import NODE, TAINT_KEY, events_by_reason, our_taints
from tests.support.live_agent import AgentProcess, taint_write, wait_until, write_kubeconfig

pytestmark = [pytest.mark.reliability, pytest.mark.integration]


@pytest.fixture
def launch(demo, fake, tmp_path, stub_cache):
    """``launch(name)`` starts ``healthagent run`` on the demo node (NVML off), same state file each time."""
    started = []
    kubeconfig = write_kubeconfig(fake.url, tmp_path / "kubeconfig")

    def start(name: str) -> AgentProcess:
        agent = AgentProcess(dict(host_root=demo.root, kube="kubeconfig", kubeconfig=kubeconfig, node_name=NODE,
                                  state_file=tmp_path / "state.json", expected_efa_devices=32, no_nvml=True),
                             tmp_path / f"{name}.log", env={"XDG_CACHE_HOME": str(stub_cache)})
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.close()


def first_writes_done(fake) -> bool:
    """The first reconcile wrote the health label (its value depends on what the agent reads)."""
    return "healthagent.io/health" in (fake.node(NODE)["metadata"].get("labels") or {})


def decided_and_held(fake, demo, launch):
    """The first agent, warm, decided on an XID 95; its taint write held by the fake: (agent, hold)."""
    held = fake.hold(taint_write(TAINT_KEY))
    agent = launch("first")
    wait_until(lambda: first_writes_done(fake), what="the first agent's health label")
    demo.inject_xid(3, 95)
    assert held.arrived.wait(60), "the taint write never came"
    return agent, held


def taint_writes(fake) -> list:
    matches = taint_write(TAINT_KEY)
    return [r for r in fake.requests("PATCH") if r.status == 200 and matches(r.method, r.path, r.body)]


@pytest.mark.parametrize("write_landed", [True, False], ids=["write-stored", "write-lost"])
def test_sigkill_between_deciding_and_writing_then_restart(write_landed, demo, fake, launch, tmp_path):
    agent, held = decided_and_held(fake, demo, launch)
    saved = json.loads((tmp_path / "state.json").read_text())
    assert "GPU_XID" in json.dumps(saved["classifier"])  # decided and saved before the write

    agent.signal(signal.SIGKILL)
    assert agent.wait(30) == -signal.SIGKILL
    held.release(apply=write_landed)
    if write_landed:
        wait_until(lambda: our_taints(fake) == [("replace_node", "NoSchedule")], what="the stored write")
    else:
        wait_until(lambda: fake.requests("PATCH") and fake.requests("PATCH")[-1].status == 500,
                   what="the failed write")
        assert our_taints(fake) == []
    assert fake.events() == []  # the Event follows the node write; the kill came first
    fake.reset_log()

    again = launch("second")
    wait_until(lambda: our_taints(fake) == [("replace_node", "NoSchedule")], what="the taint after the restart")
    wait_until(lambda: events_by_reason(fake) == {"GPU_XID": 1}, what="the Event after the restart")
    after = again.wait_metric(lambda s: s.value("healthagent_kube_pending_writes") == 0
                              and s.value("healthagent_node_taint_applied") == 1, what="nothing pending")
    assert after.value("healthagent_node_action", action="replace_node") == 1  # the fault survived the kill
    assert after.total("healthagent_xid_errors_total") == 0  # the XID record was not read a second time
    assert len(taint_writes(fake)) == (0 if write_landed else 1)
    assert events_by_reason(fake) == {"GPU_XID": 1}
    assert again.proc.poll() is None


def test_sigterm_finishes_the_write_in_flight(demo, fake, launch):
    agent, held = decided_and_held(fake, demo, launch)
    agent.signal(signal.SIGTERM)
    agent.wait_log(r"signal=15 stopping")
    assert agent.proc.poll() is None  # it waits for the write in flight
    held.release(apply=True)
    assert agent.wait(60) == 0
    assert our_taints(fake) == [("replace_node", "NoSchedule")]
    assert events_by_reason(fake) == {"GPU_XID": 1}  # the reconcile in flight was finished, Event included

    fake.reset_log()
    again = launch("second")
    again.wait_metric(lambda s: s.value("healthagent_kube_reachable") == 1
                      and s.value("healthagent_node_taint_applied") == 1
                      and s.value("healthagent_kube_pending_writes") == 0, what="the restarted agent settled")
    assert taint_writes(fake) == [] and events_by_reason(fake) == {"GPU_XID": 1}


def test_sigterm_with_the_api_server_hanging_still_exits_0(demo, fake, launch):
    agent, held = decided_and_held(fake, demo, launch)
    agent.signal(signal.SIGTERM)
    assert agent.wait(90) == 0  # the grace passed; the write is abandoned, not the exit code
    held.release(apply=False)
    assert our_taints(fake) == []
