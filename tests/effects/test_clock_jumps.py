"""Durations that lead to a node action run on a clock that does not jump.

The wall clock is stepped an hour forward and an hour back during a 60 s NoExecute grace: the
NoExecute still lands 60 s after NoSchedule by the decision clock, while what the API server
reads (``timeAdded``) carries wall time. One XID 94 reported by both the kernel log and NVML after
a +1 h step is one count and one Event: both are stamped on the decision clock. The decision
clock itself survives a restart within a boot and starts afresh on a new boot. A lost state file
with the wall clock hours ahead restarts the grace in full at first sight: ``timeAdded`` is shown,
never measured against.

Real parts: the fake API server over the real ``kubernetes`` client for the grace; the demo host
root, the stub ``libnvidia-ml.so.1`` compiled with ``cc`` and the real state store for the XID.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from healthagent.clock import DecisionClock, fresh_epoch, restore_epoch, saved_epoch
from healthagent.effects.api_time import parse_rfc3339
from tests.effects.helpers import T0, XID95, our_taints, settings_for, start_effects
from tests.support.wait import wait_for

NODE = "gpu-node-0"
GRACE = 60.0


def restore(saved, boot_id: str) -> float:
    return restore_epoch(saved, boot_id, fallback=-1.0)


def test_the_epoch_continues_within_a_boot_and_starts_afresh_on_another():
    kept = saved_epoch("boot-a", 1_700_000_000.25)
    assert restore(kept, "boot-a") == 1_700_000_000.25
    assert restore(kept, "boot-b") == -1.0  # a new boot: a fresh epoch
    assert restore(kept, "") == -1.0  # no boot id: continuation cannot be proven
    for bad in (None, [], {"boot_id": "boot-a"}, {"boot_id": "boot-a", "epoch": "soon"},
                {"boot_id": "boot-a", "epoch": True}, {"boot_id": "boot-a", "epoch": float("nan")},
                {"boot_id": "boot-a", "epoch": -5}):
        assert restore(bad, "boot-a") == -1.0, bad


def test_the_decision_clock_moves_only_with_the_monotonic_clock():
    ticks = iter([10.0, 12.5])
    clock = DecisionClock(epoch=1000.0, monotonic=lambda: next(ticks))
    assert clock() == 1010.0 and clock() == 1012.5
    wall = [5000.0]
    assert fresh_epoch(wall=lambda: wall[0], monotonic=lambda: 40.0) == 4960.0


@pytest.mark.parametrize("step", [+3600.0, -3600.0], ids=["wall +1h", "wall -1h"])
def test_noexecute_lands_after_the_grace_whatever_the_wall_clock_did(tmp_path, fake, step):
    fake.seed_nodes(20)
    effects = start_effects(settings_for(tmp_path, NODE, replace_noexecute_grace_seconds=GRACE), fake)
    effects.startup(T0 - 1, "boot-1", wall=T0 - 1)
    effects.reconcile(XID95, T0, "boot-1", wall=T0)
    taint = our_taints(fake.node(NODE))
    assert [t["effect"] for t in taint] == ["NoSchedule"]
    assert parse_rfc3339(taint[0]["timeAdded"]) == pytest.approx(T0, abs=1)  # wall time, for people
    landed = None
    for elapsed in range(5, 90):  # the worker re-reconciles every few seconds; here every second
        effects.reconcile(XID95, T0 + elapsed, "boot-1", wall=T0 + elapsed + step)  # stepped at 5 s
        if [t["effect"] for t in our_taints(fake.node(NODE))] == ["NoExecute"]:
            landed = elapsed
            break
    assert landed is not None and GRACE <= landed <= GRACE + 15


def test_a_restart_within_the_grace_keeps_it_after_a_wall_step(tmp_path, fake):
    fake.seed_nodes(20)
    settings = settings_for(tmp_path, NODE, replace_noexecute_grace_seconds=GRACE)
    first = start_effects(settings, fake)
    first.startup(T0 - 1, "boot-1", wall=T0 - 1)
    first.reconcile(XID95, T0, "boot-1", wall=T0)
    again = start_effects(settings, fake)  # the agent restarted 10 s in; the wall clock jumped 1 h
    again.startup(T0 + 10, "boot-1", wall=T0 + 3610)
    again.reconcile(XID95, T0 + 11, "boot-1", wall=T0 + 3611)
    assert [t["effect"] for t in our_taints(fake.node(NODE))] == ["NoSchedule"]
    again.reconcile(XID95, T0 + GRACE, "boot-1", wall=T0 + GRACE + 3600)
    assert [t["effect"] for t in our_taints(fake.node(NODE))] == ["NoExecute"]


def test_a_lost_state_file_and_a_wall_clock_hours_ahead_restart_the_grace_in_full(tmp_path, fake):
    fake.seed_nodes(20)
    settings = settings_for(tmp_path, NODE, replace_noexecute_grace_seconds=GRACE)
    first = start_effects(settings, fake)
    first.startup(T0 - 1, "boot-1", wall=T0 - 1)
    first.reconcile(XID95, T0, "boot-1", wall=T0)
    assert [t["effect"] for t in our_taints(fake.node(NODE))] == ["NoSchedule"]
    shutil.rmtree(tmp_path / "state")  # the state file is lost, and with it the decision clock's epoch
    hours = 6 * 3600.0  # the wall clock stepped six hours ahead: the new run's clock starts from it
    again = start_effects(settings, fake)
    seen = T0 + hours + 10  # first sight of the taint on the new run's decision clock
    again.startup(seen, "boot-1", wall=seen)
    for elapsed in (0, 1, GRACE / 2, GRACE - 1):
        again.reconcile(XID95, seen + elapsed, "boot-1", wall=seen + elapsed)
        assert [t["effect"] for t in our_taints(fake.node(NODE))] == ["NoSchedule"], elapsed
    again.reconcile(XID95, seen + GRACE, "boot-1", wall=seen + GRACE)
    assert [t["effect"] for t in our_taints(fake.node(NODE))] == ["NoExecute"]


def test_one_xid_from_the_kernel_log_and_nvml_after_a_wall_step_is_one_count_and_one_event(
        tmp_path: Path, monkeypatch):
    from healthagent.config import load_settings
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import use_stub_nvml
    from healthagent.wiring import AgentRuntime

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HEALTHAGENT_STUB_NVML_SCENARIO", raising=False)
    node = build_demo_root(tmp_path / "host")
    use_stub_nvml(node.scenario)
    settings = load_settings(env={}, flags={
        "host_root": str(node.root), "kube": "dry-run", "listen": "127.0.0.1:0", "nvml": "true",
        "state_file": str(tmp_path / "state" / "state.json"), "node_name": "n1"})
    running = AgentRuntime(settings)  # the decision clock's epoch is taken here
    agent = running.agent
    effects = running.agent.effects_worker._effects
    try:
        agent.cycle()
        effects.startup(agent.clock(), agent.boot_id)
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 3600.0)  # NTP steps the clock
        taken = []  # what the loop drained from NVML's event queue
        drain = agent.nvml.take_events

        def take_and_note():
            events = drain()
            taken.extend(events)
            return events

        agent.nvml.take_events = take_and_note
        node.inject_xid(3, 94, via="both")

        def nvml_reported() -> bool:
            agent.cycle()
            return any(e.xid == 94 for e in taken)

        wait_for(nvml_reported, what="NVML's XID 94 event to reach the loop")
        assert any(e.source == "nvml" for e in taken)
        xid94 = [c for c in agent.xids.snapshot() if c.xid == 94]
        assert sum(c.count for c in xid94) == 1, xid94  # the kernel log's record and NVML's event paired
        assert len([f for f in agent.verdict.findings if 94 in f.xids]) == 1
        effects.reconcile(agent.verdict, agent.clock(), agent.boot_id, wall=time.time())
        detected = [k for k in effects.ledger.to_state()["emitted"] if k.startswith("finding/")]
        assert len(detected) == 1 and not effects.ledger.outbox, detected
    finally:
        running.agent.shutdown(grace_seconds=5)
        running.server.stop()
