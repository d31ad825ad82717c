"""Timed steps taken at their time: the grace's end, and a budget slot coming free.

The real ``EffectsWorker`` drives ``NodeEffects`` on the decision clock (monotonic, from T0) with
a retry interval of an hour, so a step taken sooner came from the due time the effects named
(``KubeStatus.due_at``) or from a watch's wake-up, never from a timer. Nothing asserts how long
anything took: the tests assert which reconcile took the step, and wait for the step itself.
"""

from __future__ import annotations

import time
from typing import Callable

import pytest

from healthagent.effects.budget_watch import SlotWatch
from healthagent.effects.worker import EffectsWorker
from healthagent.model import KubeStatus
from tests.effects.budget_helpers import NODE, cluster, effects  # noqa: F401 (cluster: a fixture)
from tests.effects.helpers import HEALTHY, T0, TAINT_KEY, XID95, settings_for, start_effects, wait_for
from tests.effects.test_budget_race_real import slot_holders
from tests.effects.test_scenarios import XID79
from tests.support.clusters import RealCluster, ensure_namespace
from tests.support.gated_source import LONG

HOUR = 3600.0


def decision_clock() -> Callable[[], float]:
    """A clock that never jumps, reading T0 now."""
    base = time.monotonic()
    return lambda: T0 + time.monotonic() - base


def recorded(node_effects) -> list[tuple[float, KubeStatus]]:
    """(decision time, status) of every reconcile ``node_effects`` runs from now on."""
    seen: list[tuple[float, KubeStatus]] = []
    reconcile = node_effects.reconcile

    def recording(verdict, now, boot_id, health=(), wall=None):
        status = reconcile(verdict, now, boot_id, health=health, wall=wall)
        seen.append((now, status))
        return status

    node_effects.reconcile = recording
    return seen


def test_noexecute_is_written_by_the_first_reconcile_at_the_graces_end(tmp_path, cluster):  # noqa: F811
    """The NoSchedule's grace is 1 s and the worker's retry an hour: the effects name the grace's
    end as due, the worker reconciles then, and that reconcile, the first at or past the end,
    writes NoExecute. The delay after the grace is the reconcile's own (its requests)."""
    node_effects = start_effects(settings_for(tmp_path, NODE, replace_noexecute_grace_seconds=1.0), cluster)
    seen = recorded(node_effects)
    clock = decision_clock()
    worker = EffectsWorker(node_effects, "boot-1", clock=clock, wall=clock, retry_seconds=HOUR)
    worker.start()
    try:
        worker.submit(XID95)
        wait_for(lambda: effects(cluster).get(NODE) == "NoExecute", LONG, "NoExecute after the grace")
    finally:
        worker.stop(LONG)
    tainted_at, first = seen[0]
    assert first.taint_effect == "NoSchedule" and first.due_at == tainted_at + 1.0
    step = next(i for i, (_, status) in enumerate(seen) if status.taint_effect == "NoExecute")
    assert seen[step][0] >= first.due_at and all(now < first.due_at for now, _ in seen[:step])
    assert seen[step][1].due_at is None  # nothing timed is left


def test_a_due_time_the_last_reconcile_reached_waits_for_the_retry():
    """A held node's grace is over and it could not take its step: that due time is past for the
    reconcile that saw it, so the worker waits its retry (or the next look), never a busy loop."""
    class Held:
        mode = "dry-run"

    worker = EffectsWorker(Held(), "boot-1", clock=lambda: T0 + 10.0, retry_seconds=5.0)
    worker._reconciled_at = T0 + 9.0
    worker.status = KubeStatus(due_at=T0 + 8.0)
    assert worker._until_next() == 5.0
    worker.status = KubeStatus(due_at=T0 + 9.5)  # came during the last reconcile: at once
    assert worker._until_next() == 0.0
    worker.status = KubeStatus(due_at=T0 + 12.0)
    assert worker._until_next() == 2.0
    worker.status = KubeStatus(due_at=T0 + 600.0)
    assert worker._until_next() == 5.0


@pytest.mark.integration
def test_a_held_node_takes_a_freed_slot_at_once_not_at_its_next_look(control_plane, unique_name, tmp_path):
    """One slot (budget_max_nodes=1), held by a peer that took its step (XID 79: NoExecute, no
    grace here); this node is held at NoSchedule, its agent has judged the peer live, and its
    next timed look is minutes away. The peer reboots healthy and gives the slot back: the watch
    on the budget's Leases wakes this node's effects, which look within a second and take their
    step. On the real API server."""
    from kubernetes import client

    real = RealCluster(control_plane, unique_name("freed") + "-")
    namespace = unique_name("budget")
    ensure_namespace(client.CoreV1Api(real.api_client()), namespace)
    try:
        me, peer_name = real.seed(3)[:2]

        def agent(name: str, **kwargs):
            made = start_effects(settings_for(tmp_path / name, name, budget_node_selector=real.budget_selector,
                                              budget_namespace=namespace, budget_max_nodes=1,
                                              replace_noexecute_grace_seconds=0.0), real, **kwargs)
            return made

        peer = agent(peer_name)
        peer.startup(T0 - 1, "boot-1")
        assert peer.reconcile(XID79, T0, "boot-1").taint_effect == "NoExecute"
        mine = agent(me, budget_recheck_seconds=HOUR, watch=True)
        mine.startup(T0 - 1000, "boot-1")  # it has seen the peer's slot for a while: judged at its first look
        clock = decision_clock()
        worker = EffectsWorker(mine, "boot-1", clock=clock, wall=clock, retry_seconds=HOUR)
        mine.on_change = worker.wake
        worker.start()
        try:
            worker.submit(XID95)
            wait_for(lambda: worker.status.budget_blocked, LONG, "this node held at NoSchedule")
            assert mine.budget_recheck_at - clock() > 2 * LONG  # its timed look is far away
            watch: SlotWatch = mine.budget._watch
            assert watch.running
            peer.reconcile(HEALTHY, T0 + 10, "boot-2")  # rebooted, healthy: its slot goes back
            assert set(slot_holders(real, namespace).values()) == {""}
            wait_for(lambda: real_effect(real, me) == "NoExecute", LONG, "this node's step on the freed slot")
            assert not watch.running  # it holds a slot now: nothing to wait for
        finally:
            worker.stop(LONG)
        assert set(slot_holders(real, namespace).values()) == {me}
        assert mine.errors == {} and peer.errors == {}
    finally:
        real.close()


def real_effect(real: RealCluster, name: str) -> str:
    taints = [t for t in real.node(name)["spec"].get("taints") or [] if t["key"] == TAINT_KEY]
    return taints[0]["effect"] if taints else ""
