"""The disruption budget under another node's credentials, on a real API server.

Nodes A and B, each with an agent pod and its pod-bound service-account token, the generic
overlay's RBAC and admission policies (``tests/support/access_cluster.py`` builds them). The
budget counts the two nodes: a limit of one. The agent on A runs ``NodeEffects`` with A's token;
B's token is the attacker. Whatever B writes, A gets ``NoSchedule`` at once, never more than
the limit is ``NoExecute``, and a slot B holds without a fault of its own is taken back within
a minute of A's own observation (a slot B holds under a taint it put on itself: once B has not
taken its disruptive step within the grace). With a budget per pool, B's Node is judged by its
pool label, not by the slot it wrote; HyperPod's label on a cluster without HyperPod is no
disruptive step and no hand-off.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from healthagent.effects.budget import COUNT_LEASE, SLOT_GRACE_SECONDS, Scope, counted, held_lease, new_lease, slot_name
from healthagent.effects.hyperpod import HYPERPOD_HEALTH_LABEL, HYPERPOD_PENDING_REPLACEMENT
from healthagent.effects.kube import NodeEffects
from healthagent.effects.stage import NodeSide, stage_of, started
from healthagent.effects.state import StateStore
from tests.support.access_cluster import (  # noqa: F401 (access, world: fixtures)
    NAMESPACE,
    OWN_TAINT,
    World,
    access,
    holder,
    own_taints,
    strategic,
    with_taints,
    world,
)
from tests.effects.helpers import T0, XID95, settings_for

pytestmark = pytest.mark.integration


@pytest.fixture
def agent_a(world: World, tmp_path) -> Iterator[NodeEffects]:  # noqa: F811
    """A's effects with A's token; the budget's Leases are cleared before and after (they are
    shared by every test of the server)."""
    with agent_on_a(world, tmp_path) as effects:
        yield effects


@contextlib.contextmanager
def agent_on_a(world: World, tmp_path, **overrides) -> Iterator[NodeEffects]:  # noqa: F811
    """``agent_a`` with settings ``overrides``, started once the caller's setup is in place."""
    settings = settings_for(tmp_path, world.a, budget_node_selector=f"kubernetes.io/hostname in ({world.a},{world.b})",
                            **overrides)
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


def take_as_b(world: World, index: int, at: float, holder: str | None = None) -> None:  # noqa: F811
    """B's token writes slot ``index`` in B's name (a reclaim, as admission must allow); with
    ``holder``, the administrator writes it in that name (another node's agent did)."""
    name = slot_name(index)
    current = _json(world, name)
    leases = world.admin.leases if holder else world.agent_b.leases
    body = held_lease(current if current is not None else new_lease(name, NAMESPACE, "slot"),
                      holder or world.b, at, acquired=True)
    if current is None:
        leases.create_namespaced_lease(NAMESPACE, body)
    else:
        leases.replace_namespaced_lease(name, NAMESPACE, body)


def _json(world: World, name: str) -> dict | None:  # noqa: F811
    """A Lease of the budget as the API server stores it (plain JSON), None when there is none."""
    reply = world.plane.admin_session().get(
        f"{world.plane.url}/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{name}", timeout=10)
    if reply.status_code == 404:
        return None
    reply.raise_for_status()
    return reply.json()


def slot_taken(effects: NodeEffects, start: float, until: float) -> float | None:
    """Reconcile every 5 s of the decision clock from ``start``; the time A first held a slot."""
    now = start
    while now <= until:
        effects.reconcile(XID95, now, "boot-1")
        if effects.budget.slot is not None:
            return now
        now += 5
    return None


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


def test_every_slot_held_by_another_node_forever_is_taken_back_within_a_minute(world, agent_a):  # noqa: F811
    """B's token holds every slot (0..9; the limit is 1) with a renewTime in 2099: A gets
    NoSchedule at once and, B having no fault, slot 0 within a minute of A's own first look;
    B's spare slots are cleared, one a look."""
    for index in range(10):
        take_as_b(world, index, 4_070_908_800.0)  # 2099-01-01
    agent_a.reconcile(XID95, T0, "boot-1")
    assert effect_of(world) == "NoSchedule"
    taken = slot_taken(agent_a, T0 + 5, T0 + 300)
    assert taken is not None and taken - T0 <= 60, taken
    assert agent_a.budget.slot.index == 0
    assert settle(agent_a, taken, T0 + 300, world) is not None  # its grace over: A takes its step
    assert own_taints(world, world.b) == []


def test_a_slot_squatted_under_a_self_made_taint_is_taken_back_after_the_grace(world, agent_a):  # noqa: F811
    """B puts the agent's NoSchedule on itself (its token may) and holds every slot: B counts
    once, and loses the slot once it has held it past the grace (120 s) without a disruptive
    step. Never more than one node NoExecute."""
    with_taints(world, world.b, lambda taints: [*taints, dict(OWN_TAINT)], apis=world.agent_b)
    for index in range(10):
        take_as_b(world, index, 4_070_908_800.0)
    agent_a.reconcile(XID95, T0, "boot-1")
    assert effect_of(world) == "NoSchedule"
    taken = slot_taken(agent_a, T0 + 5, T0 + 400)
    assert taken is not None and 120 + SLOT_GRACE_SECONDS <= taken - T0 <= 120 + 60 + 30, taken
    assert [t["effect"] for t in own_taints(world, world.b)] == ["NoSchedule"]


def test_a_slot_leaked_by_a_deleted_node_with_a_clock_a_day_ahead_is_taken_back(world, agent_a):  # noqa: F811
    """An agent whose clock ran a day ahead took the one slot; its Node was deleted (the normal
    end of a replacement). A reclaims it within a minute of its own first look."""
    gone = f"{world.b}-gone"
    take_as_b(world, 0, T0 + 86_400, holder=gone)  # no such Node
    agent_a.reconcile(XID95, T0, "boot-1")
    assert effect_of(world) == "NoSchedule"
    taken = slot_taken(agent_a, T0 + 5, T0 + 300)
    assert taken is not None and taken - T0 <= 60, taken


def test_a_nodes_token_cannot_raise_the_limit(world, agent_a):  # noqa: F811
    """The counter (its own service account) counts A and B: a limit of one. B takes the slot and
    its own NoExecute (its token may: B takes itself out, and that is the limit), then tries to
    raise the limit with its token: rewrite the count to 100000 in its own name, the counter's
    or nobody's. Each is refused by the count policy; the count stays the counter's, and A stays
    held at NoSchedule."""
    from kubernetes.client.exceptions import ApiException

    from healthagent.budget_counter import BudgetCounter
    from healthagent.effects.backend import ApiBackend

    selector = f"kubernetes.io/hostname in ({world.a},{world.b})"
    BudgetCounter(ApiBackend(world.counter.core.api_client, ""), NAMESPACE, selector).round(T0)
    assert _count(world) == "2"
    with_taints(world, world.b, lambda taints: [*taints, {**OWN_TAINT, "effect": "NoExecute"}], apis=world.agent_b)
    take_as_b(world, 0, T0)
    lease = _json(world, COUNT_LEASE)
    assert lease is not None
    for holder in (world.b, "healthagent-budget-counter", ""):
        forged = counted(lease, 100000, selector, T0)
        forged["spec"]["holderIdentity"] = holder
        forged["metadata"].pop("managedFields", None)
        with pytest.raises(ApiException) as refused:
            world.agent_b.leases.replace_namespaced_lease(COUNT_LEASE, NAMESPACE, forged)
        assert refused.value.status == 403, refused.value
    assert _count(world) == "2"
    assert settle(agent_a, T0, T0 + 300, world) is None  # never NoExecute: B is the limit
    assert agent_a.budget.slot is None and effect_of(world) == "NoSchedule"


POOL = "example.com/pool"
PENDING_REPLACEMENT = {"metadata": {"labels": {HYPERPOD_HEALTH_LABEL: HYPERPOD_PENDING_REPLACEMENT}}}


def test_a_slot_of_another_pool_written_by_a_node_that_took_itself_out_is_taken_back(world, tmp_path):  # noqa: F811
    """The budget counts per pool: A in pool-a, B in pool-b. B's token takes B out (its own
    NoExecute, one node of pool-b's limit) and writes pool-a's one slot in B's name, which
    admission must allow (a node may reclaim any slot). A judges B by B's Node as the API server
    has it, not by the slot B wrote: B is not in pool-a, so A takes the slot back and goes out
    after its grace. B counts in one pool, not in every pool."""
    for name, pool in ((world.a, "pool-a"), (world.b, "pool-b")):
        strategic(world, name, {"metadata": {"labels": {POOL: pool}}}, apis=world.admin)
    with agent_on_a(world, tmp_path, budget_scope_label=POOL) as agent:
        scope = agent.budget.scope
        assert scope == Scope(POOL, "pool-a")
        with_taints(world, world.b, lambda taints: [*taints, {**OWN_TAINT, "effect": "NoExecute"}], apis=world.agent_b)
        forged = held_lease(new_lease(slot_name(0, scope), NAMESPACE, "slot", scope), world.b, T0, acquired=True)
        world.agent_b.leases.create_namespaced_lease(NAMESPACE, forged)  # 201: in B's own name
        status = agent.reconcile(XID95, T0, "boot-1")
        assert effect_of(world) == "NoSchedule" and status.budget_blocked
        out = settle(agent, T0 + 5, T0 + 400, world)
        assert out is not None and out - T0 <= 120 + 60, out
        assert holder(world, slot_name(0, scope)) == world.a
        assert [t["effect"] for t in own_taints(world, world.b)] == ["NoExecute"]  # B is pool-b's business


def test_hyperpods_label_written_by_a_node_without_hyperpod_neither_keeps_a_slot_nor_hands_off(world, agent_a):  # noqa: F811
    """No HyperPod here (``hyperpod_labels`` off). B's token puts the agent's NoSchedule and
    HyperPod's UnschedulablePendingReplacement on B and holds the one slot: no engine reads that
    label, so it is no disruptive step and B's squat ends as a bare NoSchedule's would, after the
    grace. A's token writes the same label on A: A's stage stays cordoned, never handed_off to an
    engine the cluster does not run."""
    with_taints(world, world.b, lambda taints: [*taints, dict(OWN_TAINT)], apis=world.agent_b)
    strategic(world, world.b, PENDING_REPLACEMENT, apis=world.agent_b)
    take_as_b(world, 0, T0)
    agent_a.reconcile(XID95, T0, "boot-1")
    strategic(world, world.a, PENDING_REPLACEMENT)  # A's own token, on A
    status = agent_a.reconcile(XID95, T0 + 1, "boot-1")
    assert effect_of(world) == "NoSchedule" and (status.engine, status.disruptive) == ("", False)
    side = NodeSide(status.taint_action, status.disruptive, status.engine)
    history = started(T0 - 10, T0 - 10).advance("cordoned", "GPU_XID", T0, T0)
    assert stage_of(XID95, status.taint_effect, status.budget_blocked, side, history, T0 + 1, 120.0) == \
        ("cordoned", "GPU_XID")
    taken = slot_taken(agent_a, T0 + 5, T0 + 400)
    assert taken is not None and 120 + SLOT_GRACE_SECONDS <= taken - T0 <= 120 + 60 + 30, taken
    assert agent_a.budget.slot.index == 0


def _count(world: World) -> str | None:  # noqa: F811
    return ((_json(world, COUNT_LEASE) or {}).get("metadata") or {}).get("annotations", {}).get(
        "healthagent.io/gpu-nodes")
