"""One reconcile, in order: read, step, the one budget exchange the step asks for, write, settle
(a node's first NoSchedule goes first, then the sequence runs once more for the budget).

The real ``kubernetes`` client against the fake API server; the calls are recorded where the
effects make them (the backend's node calls, the budget's Lease store, the pure step), so the test
sees the order the driver runs them in. And the effects' state is one frozen value: across
reconciles that take, confirm, conflict and give back a slot, no attribute of ``NodeEffects`` or of
its ``BudgetGuard`` is assigned but the one state value, which is a frozen dataclass.
"""

from __future__ import annotations

import dataclasses

import pytest

import healthagent.effects.kube as kube
from healthagent.effects.driver_state import DriverState
from tests.effects.budget_helpers import NODE, cluster, effects  # noqa: F401 (cluster: a fixture)
from tests.effects.helpers import HEALTHY, T0, XID95, Wakes, started

pytestmark = pytest.mark.integration

GRACE = 120.0


def recorded(agent, monkeypatch) -> list[str]:
    """The calls ``agent`` makes from now on, in order: node and Event calls, Lease calls, steps."""
    calls: list[str] = []

    def record(owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in ("read_node", "patch_node", "patch_node_status", "create_event"):
        record(agent.backend, name, name)
    for name in ("list", "create", "replace", "read"):
        record(agent.budget._store, name, f"lease.{name}")
    record(kube, "step", "step")
    return calls


def test_a_fault_that_takes_a_slot_reads_steps_once_takes_writes_once_and_settles(tmp_path, cluster, monkeypatch):
    agent = started(tmp_path, cluster, replace_noexecute_grace_seconds=GRACE)
    calls = recorded(agent, monkeypatch)
    status = agent.reconcile(XID95, T0, "boot-1")
    assert calls == [
        "read_node",  # read: a new verdict steps against a fresh node
        "step",  # step: the NoSchedule first, no budget exchange yet
        "patch_node",  # write: the taint alone
        "step",  # the sequence again, against the write's reply (no read): a slot for the step ahead
        "lease.list", "lease.create",  # the one exchange it asked for: take a slot
        "patch_node_status",  # write: the conditions (the taint is on already)
        "lease.replace",  # settle: the slot re-written with the taint on the node
        "create_event",  # then the Event queued by the reconcile
    ]
    assert effects(cluster) == {NODE: "NoSchedule"} and status.pending_writes == 0
    assert [r.method for r in cluster.requests() if r.path == f"/api/v1/nodes/{NODE}"].count("PATCH") == 1

    calls.clear()
    status = agent.reconcile(XID95, T0 + GRACE, "boot-1")  # the grace is over: the disruptive step
    assert calls[:4] == ["read_node", "step", "lease.replace", "patch_node"]  # the exchange: confirm the slot
    assert calls.count("step") == 1 and calls.count("patch_node") == 1
    assert effects(cluster) == {NODE: "NoExecute"}


def test_the_state_is_one_frozen_value_and_nothing_else_is_assigned(tmp_path, cluster):
    agent = started(tmp_path, cluster, replace_noexecute_grace_seconds=GRACE)
    agent.on_change = Wakes()  # wiring, set once as the loop's effects worker does
    assert dataclasses.fields(DriverState) and DriverState.__dataclass_params__.frozen
    before = {id(obj): dict(vars(obj)) for obj in (agent, agent.budget)}
    states = []
    for now, verdict in ((T0, XID95), (T0 + 10, XID95), (T0 + GRACE, XID95), (T0 + GRACE + 5, HEALTHY)):
        if now == T0 + 10:
            cluster.conflict_next_writes(1)
        agent.reconcile(verdict, now, "boot-1")
        states.append(agent._state)
    assert effects(cluster) == {NODE: "NoExecute"}  # a replace_node taint stays until cleared
    for obj in (agent, agent.budget):
        after = vars(obj)
        assert after.keys() == before[id(obj)].keys()
        changed = [k for k, v in after.items() if v is not before[id(obj)][k]]
        assert changed == (["_state"] if obj is agent else []), changed
    assert all(isinstance(s, DriverState) for s in states) and len({id(s) for s in states}) == len(states)
    with pytest.raises(dataclasses.FrozenInstanceError):
        states[-1].dirty = True  # type: ignore[misc]
