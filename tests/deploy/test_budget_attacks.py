"""The disruption budget under another node's credentials, on a real API server.

Nodes A and B, each with an agent pod and its pod-bound service-account token, the generic
overlay's RBAC and admission policies (``tests/deploy/test_access_real.py`` builds them). The
budget counts the two nodes: a limit of one. The agent on A runs ``NodeEffects`` with A's token;
B's token is the attacker. Whatever B writes, A gets ``NoSchedule`` at once, never more than
the limit is ``NoExecute``, and a slot B holds without a fault of its own is taken back within
a minute of A's own observation.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from healthagent.effects.budget import COUNT_LEASE, held_lease, new_lease, slot_name
from healthagent.effects.kube import NodeEffects
from healthagent.effects.state import StateStore
from tests.deploy.test_access_real import (  # noqa: F401 (access, world: fixtures)
    NAMESPACE,
    World,
    access,
    own_taints,
    world,
)
from tests.effects.helpers import T0, XID95, settings_for

pytestmark = pytest.mark.integration


@pytest.fixture
def agent_a(world: World, tmp_path) -> Iterator[NodeEffects]:  # noqa: F811
    """A's effects with A's token; the budget's Leases are cleared before and after (they are
    shared by every test of the server)."""
    settings = settings_for(tmp_path, world.a, budget_node_selector=f"kubernetes.io/hostname in ({world.a},{world.b})")
    clear_budget(world)
    store = StateStore(settings.state_file)
    store.load()
    effects = NodeEffects(settings, world.agent.core.api_client, store, request_timeout=(5.0, 30.0))
    effects.startup(T0 - 1, "boot-1")
    try:
        yield effects
    finally:
        effects.close()
        clear_budget(world)


def clear_budget(world: World) -> None:  # noqa: F811
    for lease in world.admin.leases.list_namespaced_lease(NAMESPACE).items:
        if lease.metadata.name.startswith("healthagent-budget-") and not lease.metadata.name.startswith(
                f"healthagent-budget-slot-{world.slot}"):
            world.admin.leases.delete_namespaced_lease(lease.metadata.name, NAMESPACE)


def effect_of(world: World) -> str:  # noqa: F811
    (taint,) = own_taints(world)
    return taint["effect"]


def take_as_b(world: World, index: int, at: float) -> None:  # noqa: F811
    """B's token writes slot ``index`` in B's name (a reclaim, as admission must allow)."""
    name = slot_name(index)
    current = _json(world, name)
    if current is None:
        world.agent_b.leases.create_namespaced_lease(NAMESPACE, held_lease(
            new_lease(name, NAMESPACE, "slot"), world.b, at, acquired=True))
    else:
        world.agent_b.leases.replace_namespaced_lease(name, NAMESPACE, held_lease(current, world.b, at, acquired=True))


def _json(world: World, name: str) -> dict | None:  # noqa: F811
    """A Lease of the budget as the API server stores it (plain JSON), None when there is none."""
    reply = world.plane.admin_session().get(
        f"{world.plane.url}/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{name}", timeout=10)
    if reply.status_code == 404:
        return None
    reply.raise_for_status()
    return reply.json()


def settle(effects: NodeEffects, start: float, until: float, world: World) -> float | None:  # noqa: F811
    """Reconcile every 5 s of the decision clock from ``start``; the time A first went NoExecute."""
    now = start
    while now <= until:
        effects.reconcile(XID95, now, "boot-1")
        if effect_of(world) == "NoExecute":
            return now
        now += 5
    return None


def test_a_slot_stolen_with_another_nodes_token_is_confirmed_lost_then_taken_back(world, agent_a):  # noqa: F811
    agent_a.reconcile(XID95, T0, "boot-1")
    assert effect_of(world) == "NoSchedule" and agent_a.budget.slot is not None
    take_as_b(world, agent_a.budget.slot.index, T0 + 10)  # B takes A's slot (admission allows a reclaim)
    status = agent_a.reconcile(XID95, T0 + 121, "boot-1")  # A's grace is over: it confirms first
    assert effect_of(world) == "NoSchedule" and status.budget_blocked
    assert agent_a.errors.get("budget_slot_lost") == 1
    out = settle(agent_a, T0 + 125, T0 + 400, world)
    assert out is not None and out - (T0 + 121) <= 60 + 180, out  # B holds it with no fault: stale
    assert own_taints(world, world.b) == []  # never more than the limit out


def test_every_slot_held_by_another_node_forever_is_taken_back(world, agent_a):  # noqa: F811
    """B's token holds the one slot with a renewTime in 2099: A gets NoSchedule at once and, B
    having no fault, the slot within a minute of A's own look plus its re-check."""
    take_as_b(world, 0, 4_070_908_800.0)  # 2099-01-01
    agent_a.reconcile(XID95, T0, "boot-1")
    assert effect_of(world) == "NoSchedule"
    out = settle(agent_a, T0 + 5, T0 + 400, world)
    assert out is not None and out - T0 <= 60 + 180, out


def test_a_count_poisoned_before_admission_heals_and_never_stops_the_taint(world, agent_a):  # noqa: F811
    """A count Lease that no agent could write now (written before the policy, or by an
    administrator) does not stop A's taint, and A's re-count replaces it."""
    lease = _json(world, COUNT_LEASE) or new_lease(COUNT_LEASE, NAMESPACE, "count")
    lease["metadata"].setdefault("annotations", {})["healthagent.io/gpu-nodes"] = "\u00b2"
    lease["metadata"].pop("managedFields", None)
    if "resourceVersion" in lease["metadata"]:
        world.admin.leases.replace_namespaced_lease(COUNT_LEASE, NAMESPACE, lease)
    else:
        world.admin.leases.create_namespaced_lease(NAMESPACE, lease)
    agent_a.reconcile(XID95, T0, "boot-1")
    assert effect_of(world) == "NoSchedule" and agent_a.errors == {}
    assert (_json(world, COUNT_LEASE) or {})["metadata"]["annotations"]["healthagent.io/gpu-nodes"] == "2"
