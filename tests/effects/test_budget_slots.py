"""The disruption budget's slots through NodeEffects: the real ``kubernetes`` client against the
fake API server (which keeps the Leases as the real one does: a create that exists is 409
AlreadyExists, a PUT naming an old resourceVersion is 409 Conflict).

The budget guards the disruptive step only: every node with a node action gets NoSchedule at
once, and only a node that holds a slot goes on to NoExecute after the grace; the others are held
at NoSchedule until a slot frees.

Peers are other agents' Leases and taints, written into the fake as they would be; where a peer
acts between this agent's look and its write, a hook on the agent's own Lease list runs it
there. Time is the ``now`` argument; nothing waits on a clock. The same protocol under a real race
(many agents, one real API server) is tests/effects/test_budget_race_real.py.
"""

from __future__ import annotations

import pytest

from healthagent.effects.budget import (
    GPU_NODES_ANNOTATION,
    SLOT_GRACE_SECONDS,
    Scope,
    held_lease,
    new_lease,
    released_lease,
    slot_name,
)
from healthagent.effects.api_time import rfc3339
from healthagent.effects.backend import NODE_WRITE_DEADLINE_SECONDS
from healthagent.effects.budget_guard import CONFIRM_MARGIN_SECONDS
from healthagent.effects.node_desired import CLEAR_ANNOTATION, HEALTH_LABEL, HYPERPOD_HEALTH_LABEL
from healthagent.model import Action
from tests.effects.budget_helpers import (  # noqa: F401 (cluster: a fixture)
    LEASES,
    NAMESPACE,
    NODE,
    before_write,
    cluster,
    count_gpu_nodes,
    effects,
    held_by,
    holders,
    node_lists,
    peer_holds,
    tainted,
)
from tests.effects.helpers import (HEALTHY, T0, TAINT_KEY, XID95, Wakes, cleared_by, condition, finding, our_taints,
                                   settings_for, start_effects, started, verdict)

pytestmark = pytest.mark.integration


# -- taking, holding back, giving back ---------------------------------------------------------------

def test_a_fault_takes_a_slot_then_taints_and_no_agent_lists_the_fleet(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    assert node_lists(cluster) == []  # the count is the counter's: an agent never counts
    cluster.reset_log()
    status = effects.reconcile(XID95, T0, "boot-1")
    assert tainted(cluster) == [NODE] and held_by(cluster, NODE) in ([slot_name(0)], [slot_name(1)])
    assert not status.budget_blocked and status.pending_writes == 0
    assert node_lists(cluster) == []  # no node is listed to decide
    assert [(r.method, r.path) for r in cluster.writes()] == [
        ("PATCH", f"/api/v1/nodes/{NODE}"),  # the NoSchedule, before the budget is asked
        ("POST", LEASES),  # then the slot, created by the first node to take it
        ("PATCH", f"/api/v1/nodes/{NODE}/status"),
        ("PUT", f"{LEASES}/{held_by(cluster, NODE)[0]}"),  # settled: the slot re-written with the taint on
        ("POST", "/apis/events.k8s.io/v1/namespaces/default/events")]
    peer = started(tmp_path / "peer", cluster, node="gpu-node-1")
    peer.reconcile(XID95, T0, "boot-1")  # the second slot: the counter's 20 nodes allow 2
    assert len(held_by(cluster, "gpu-node-1")) == 1 and node_lists(cluster) == []


def test_a_steady_state_asks_nothing_of_the_budget(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    cluster.reset_log()
    effects.reconcile(XID95, T0 + 10, "boot-1")
    effects.reconcile(XID95, T0 + 50, "boot-1")
    assert cluster.requests() == []


@pytest.mark.parametrize("fraction,max_nodes,peers,allowed", [
    (0.10, None, 1, True),
    (0.10, None, 2, False),   # the 3rd node of 20 at 10% is held back
    (0.10, 1, 1, False),
    (0.50, None, 9, True),
    (0.50, None, 10, False),
])
def test_budget_on_twenty_nodes(tmp_path, cluster, fraction, max_nodes, peers, allowed):
    for i in range(peers):
        peer_holds(cluster, i, f"gpu-node-{i + 1}")
    agent = started(tmp_path, cluster, budget_max_fraction=fraction, budget_max_nodes=max_nodes)
    status = agent.reconcile(XID95, T0, "boot-1")
    node = cluster.node(NODE)
    assert effects(cluster)[NODE] == "NoSchedule"  # slot or not: new pods stay off the faulty GPU at once
    assert bool(held_by(cluster, NODE)) is allowed
    assert status.budget_blocked is (not allowed) and status.budget_blocked_total == (0 if allowed else 1)
    assert node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    assert condition(node, "GpuHealthy")["status"] == "False"
    reasons = sorted(e["reason"] for e in cluster.events())
    assert reasons == (["GPU_XID"] if allowed else ["GPU_XID", "TaintBlockedByBudget"])
    if not allowed:
        (event,) = [e for e in cluster.events() if e["reason"] == "TaintBlockedByBudget"]
        assert f"slots_held={peers} limit={peers} gpu_nodes=20" in event["note"]
        assert "NoSchedule" in event["note"] and "waits for a slot" in event["note"]
    # the grace is over: only a node with a slot takes the disruptive step
    status = agent.reconcile(XID95, T0 + 120, "boot-1")
    assert effects(cluster)[NODE] == ("NoExecute" if allowed else "NoSchedule")
    assert status.taint_effect == effects(cluster)[NODE] and status.budget_blocked is (not allowed)


def test_a_held_node_looks_again_later_and_less_often_then_takes_a_freed_slot_and_escalates(tmp_path, cluster):
    for i in (0, 1):
        peer_holds(cluster, i, f"gpu-node-{i + 1}")
    agent = started(tmp_path, cluster)
    # the stretch alone: no held slot comes of age meanwhile (that look: tests/effects/test_budget_trust.py)
    agent.budget._reclaim.next_judgement = lambda memory, view, now: None
    agent.reconcile(XID95, T0, "boot-1")
    first = agent.budget_recheck_at
    assert T0 + 15 <= first <= T0 + 45  # 30 s, jittered
    cluster.reset_log()
    status = agent.reconcile(XID95, first - 1, "boot-1")
    assert status.budget_blocked and cluster.requests() == []  # held and steady: no request at all
    status = agent.reconcile(XID95, first, "boot-1")
    assert status.budget_blocked and status.budget_blocked_total == 1  # one episode
    assert len(cluster.requests("GET", LEASES)) == 1
    second = agent.budget_recheck_at
    assert first + 30 <= second <= first + 90  # held twice in a row: 60 s, jittered
    status = agent.reconcile(XID95, second, "boot-1")
    assert second + 60 <= agent.budget_recheck_at <= second + 180  # then 120 s
    assert status.taint_effect == "NoSchedule"
    # a peer is repaired: its agent gives its slot back
    repaired = started(tmp_path / "peer", cluster, node="gpu-node-2")
    repaired.reconcile(verdict(finding("GPU_ROW_REMAP_PENDING", Action.REBOOT_NODE, xids=())), T0, "boot-1")
    cluster.update_node("gpu-node-2", lambda n: n["spec"].update(taints=[]))
    repaired.reconcile(HEALTHY, T0 + 1, "boot-1")
    assert held_by(cluster, "gpu-node-2") == []
    status = agent.reconcile(XID95, max(agent.budget_recheck_at, T0 + 120), "boot-1")
    assert not status.budget_blocked and held_by(cluster, NODE)
    assert status.taint_effect == "NoExecute" == effects(cluster)[NODE]  # its grace ran while it was held
    assert agent.budget_recheck_at is None
    about_this_node = [e["reason"] for e in cluster.events() if e["regarding"]["name"] == NODE]
    assert sorted(about_this_node) == ["GPU_XID", "TaintBlockedByBudget"]


def test_a_node_held_in_one_episode_looks_at_once_when_it_faults_again(tmp_path, cluster):
    """Held while every slot was taken, then healed; its next fault, with a slot free by then,
    takes it at once rather than waiting for the old episode's next look (no slot watch is left
    to hurry it: a healthy node waits for no slot)."""
    for i in (0, 1):
        peer_holds(cluster, i, f"gpu-node-{i + 1}")
    agent = started(tmp_path, cluster, replace_noexecute_grace_seconds=0.0)
    agent.budget._reclaim.next_judgement = lambda memory, view, now: None
    assert agent.reconcile(XID95, T0, "boot-1").budget_blocked
    old_look = agent.budget_recheck_at
    cluster.update_node(NODE, lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: "ticket-1"}))
    agent.reconcile(XID95, T0 + 1, "boot-1")  # no watch here: the resync reads the clear
    assert not agent.reconcile(cleared_by("ticket-1"), T0 + 2, "boot-1").budget_blocked  # policy's verdict for it
    assert our_taints(cluster.node(NODE)) == [] and agent.budget_recheck_at is None
    cluster.put_lease(NAMESPACE, released_lease(next(x for x in cluster.leases(NAMESPACE)
                                                     if x["metadata"]["name"] == slot_name(0))))
    status = agent.reconcile(verdict(finding(finding_id=2, first_seen=T0 + 3)), T0 + 3, "boot-1")
    assert T0 + 3 < old_look and status.taint_effect == "NoExecute" == effects(cluster)[NODE]
    assert held_by(cluster, NODE) == [slot_name(0)]


@pytest.mark.parametrize("clear", ["annotation", "healed"])
def test_the_slot_goes_back_when_the_taint_comes_off(tmp_path, cluster, clear):
    effects = started(tmp_path, cluster)
    reboot = verdict(finding("GPU_ROW_REMAP_PENDING", Action.REBOOT_NODE, xids=()))
    effects.reconcile(reboot if clear == "healed" else XID95, T0, "boot-1")
    assert held_by(cluster, NODE)
    if clear == "annotation":
        cluster.update_node(NODE, lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: "ticket-1"}))
        effects.reconcile(XID95, T0 + 61, "boot-1")  # the resync reads the node (no watch here)
        effects.reconcile(cleared_by("ticket-1"), T0 + 62, "boot-1")  # policy's verdict for the clear
    else:
        effects.reconcile(HEALTHY, T0 + 600, "boot-2")
    assert our_taints(cluster.node(NODE)) == [] and held_by(cluster, NODE) == []
    assert list(holders(cluster).values()) == [""]  # the Lease stays, free for the next node


def test_a_taint_removed_by_hand_gives_the_slot_back(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    cluster.update_node(NODE, lambda n: n["spec"].update(taints=[]))
    effects.reconcile(XID95, T0 + 61, "boot-1")  # the resync reads the node
    assert held_by(cluster, NODE) == []


def test_a_holder_escalates_past_a_shrunk_limit_and_clearing_never_asks(tmp_path, cluster):
    agent = started(tmp_path, cluster)
    agent.reconcile(XID95, T0, "boot-1")
    peer_holds(cluster, 5, "gpu-node-1")
    peer_holds(cluster, 6, "gpu-node-2")  # now three slots are held with a limit of two
    cluster.reset_log()
    assert agent.reconcile(XID95, T0 + 120, "boot-1").taint_effect == "NoExecute"  # it holds its slot
    (own,) = held_by(cluster, NODE)
    # it does not ask again: a guarded re-write of its own slot confirms it before the disruptive step
    assert cluster.requests("GET", LEASES) == []
    assert [(r.method, r.path) for r in cluster.writes()][:2] == [("PUT", f"{LEASES}/{own}"),
                                                                 ("PATCH", f"/api/v1/nodes/{NODE}")]
    other = started(tmp_path / "peer", cluster, node="gpu-node-1")
    cluster.update_node("gpu-node-1", lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: "t"}))
    status = other.reconcile(cleared_by("t"), T0 + 61, "boot-1")
    assert our_taints(cluster.node("gpu-node-1")) == [] and not status.budget_blocked
    assert held_by(cluster, "gpu-node-1") == []


# -- exact under a race --------------------------------------------------------------------------------

def test_two_agents_racing_for_the_last_slot_one_wins_the_other_holds_back(tmp_path, cluster):
    peer_holds(cluster, 0, "gpu-node-5")
    agent = started(tmp_path, cluster)
    rival = started(tmp_path / "rival", cluster, node="gpu-node-6")
    # between this agent's look and its write, the rival takes the one free slot
    before_write(agent, lambda: rival.reconcile(XID95, T0, "boot-1"))
    status = agent.reconcile(XID95, T0, "boot-1")
    assert held_by(cluster, "gpu-node-6") == [slot_name(1)] and held_by(cluster, NODE) == []
    assert effects(cluster) == {"gpu-node-5": "NoExecute", "gpu-node-6": "NoSchedule", NODE: "NoSchedule"}
    assert status.budget_blocked and status.budget_blocked_total == 1
    conflicts = [r for r in cluster.writes(LEASES) if r.status == 409]
    assert len(conflicts) == 1  # this agent's write for slot 1: AlreadyExists or Conflict
    # past the grace only the two holders may go on: never three with a limit of two
    rival.reconcile(XID95, T0 + 120, "boot-1")
    assert agent.reconcile(XID95, T0 + 120, "boot-1").taint_effect == "NoSchedule"
    assert effects(cluster)["gpu-node-6"] == "NoExecute"
    assert [e for e in cluster.events() if e["reason"] == "Cleared"] == []


def steal(cluster, lease) -> None:
    """gpu-node-7 takes ``lease`` (a reclaim, or a forged write with its token) and taints itself."""
    cluster.put_lease(NAMESPACE, held_lease(lease, "gpu-node-7", T0 + 1, acquired=True))
    cluster.update_node("gpu-node-7", lambda n: n["spec"].update(taints=[
        {"key": TAINT_KEY, "value": "replace_node", "effect": "NoSchedule"}]))


def test_a_slot_taken_from_the_node_before_its_disruptive_step_means_no_disruptive_step(tmp_path, cluster):
    """The confirm right before NoExecute (the grace is over) finds the slot in another node's
    name: this node never gets NoExecute, and says so."""
    agent = started(tmp_path, cluster, budget_max_nodes=1, replace_noexecute_grace_seconds=60.0)
    status = agent.reconcile(XID95, T0, "boot-1")  # NoSchedule, and a slot taken for the step ahead
    assert status.taint_effect == "NoSchedule" and held_by(cluster, NODE) == [slot_name(0)]
    steal(cluster, next(le for le in cluster.leases(NAMESPACE) if le["metadata"]["name"] == slot_name(0)))
    cluster.reset_log()
    status = agent.reconcile(XID95, T0 + 60, "boot-1")
    node_writes = [r.body for r in cluster.writes(f"/api/v1/nodes/{NODE}") if not r.path.endswith("/status")]
    assert "NoExecute" not in str(node_writes)
    assert effects(cluster) == {"gpu-node-7": "NoSchedule", NODE: "NoSchedule"} and status.budget_blocked
    assert agent.errors.get("budget_slot_lost") == 1


def test_a_slot_reclaimed_before_the_write_landed_sends_the_node_back_to_held_noschedule(tmp_path, cluster):
    """The slot is taken, and before this agent's write lands another node takes it (a reclaim
    that judged it stale, a forged write). With no grace that write was NoExecute and HyperPod's
    replacement value; the re-write of the slot after it (settle) finds the slot lost, and the
    next reconcile, due at once, takes both back: NoSchedule, held, Schedulable."""
    agent = started(tmp_path, cluster, budget_max_nodes=1, replace_noexecute_grace_seconds=0.0,
                    hyperpod_labels=True)
    wakes = Wakes()
    agent.on_change = wakes
    store = agent.budget._store
    real_create = store.create

    def create_then_lose_it(body):
        written = real_create(body)
        steal(cluster, written)
        store.create = real_create
        return written

    store.create = create_then_lose_it
    agent.reconcile(XID95, T0, "boot-1")
    assert held_by(cluster, "gpu-node-7") == [slot_name(0)] and held_by(cluster, NODE) == []
    assert wakes.count == 1  # the rollback is due at once
    status = agent.reconcile(XID95, T0 + 1, "boot-1")
    node_writes = [r.body for r in cluster.writes(f"/api/v1/nodes/{NODE}") if not r.path.endswith("/status")]
    assert len(node_writes) == 3  # NoSchedule first, NoExecute with the replacement value, then back
    assert effects(cluster) == {"gpu-node-7": "NoSchedule", NODE: "NoSchedule"}
    assert cluster.node(NODE)["metadata"]["labels"][HYPERPOD_HEALTH_LABEL] == "Schedulable"
    assert status.budget_blocked and status.pending_writes == 0 and status.taint_effect == "NoSchedule"
    assert [e["reason"] for e in cluster.events() if e["reason"] in ("Cleared", "TaintBlockedByBudget")] == [
        "TaintBlockedByBudget"]
    status = agent.reconcile(XID95, T0 + 5, "boot-1")  # held: it waits for its next look
    assert status.budget_blocked and effects(cluster)[NODE] == "NoSchedule"


# -- restarts and taints without a slot ---------------------------------------------------------------

def test_a_restarted_agent_finds_its_slot_and_takes_no_second(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    again = started(tmp_path, cluster)
    again.reconcile(XID95, T0 + 10, "boot-1")
    assert len(held_by(cluster, NODE)) == 1
    assert again.budget.slot is not None and again.budget.slot.name == held_by(cluster, NODE)[0]


@pytest.mark.parametrize("lands", [False, True])
def test_a_restart_keeps_a_slot_its_last_runs_write_may_still_land_under(tmp_path, cluster, lands):
    """The last run took the slot and stopped with its NoExecute PATCH queued at the API server:
    the node holds a slot and shows no taint. The restart gives that slot back only once the
    write's deadline has passed; a write that lands meanwhile keeps it, so no second node can
    take the slot beside a NoExecute."""
    peer_holds(cluster, 0, NODE, tainted=False)
    agent = start_effects(settings_for(tmp_path, NODE, budget_max_nodes=1, replace_noexecute_grace_seconds=0.0),
                          cluster)
    agent.startup(T0, "boot-1")
    assert held_by(cluster, NODE) == [slot_name(0)]  # not at once: the old write may be in flight
    if lands:
        taint = {"key": TAINT_KEY, "value": "replace_node", "effect": "NoExecute", "timeAdded": rfc3339(T0 - 1)}
        cluster.update_node(NODE, lambda n: n["spec"].update(taints=[taint]))
        agent.reconcile(XID95, T0 + NODE_WRITE_DEADLINE_SECONDS + 10, "boot-1")  # it adopts the taint
        assert effects(cluster) == {NODE: "NoExecute"} and held_by(cluster, NODE) == [slot_name(0)]
        peer = started(tmp_path / "peer", cluster, node="gpu-node-7", budget_max_nodes=1,
                       replace_noexecute_grace_seconds=0.0)
        assert peer.reconcile(XID95, T0 + 30, "boot-1").budget_blocked
        return
    agent.reconcile(HEALTHY, T0 + NODE_WRITE_DEADLINE_SECONDS - 1, "boot-1")
    assert held_by(cluster, NODE) == [slot_name(0)]
    agent.reconcile(HEALTHY, T0 + NODE_WRITE_DEADLINE_SECONDS + CONFIRM_MARGIN_SECONDS, "boot-1")
    assert held_by(cluster, NODE) == []  # past the deadline: nothing can land under it any more


def test_a_slot_taken_before_a_crash_cannot_let_a_second_node_through(tmp_path, cluster):
    """The last run took a slot and stopped before its node write landed: the node holds a slot
    and carries no taint. The restart's give-back fails (500), and while this agent believes it
    holds the slot another node reclaims it (it judged it stale: no taint). The restarted agent's
    NoExecute must not stand beside the reclaimer's: the slot is re-written after the write and
    the node goes back to held NoSchedule."""
    peer_holds(cluster, 0, NODE, tainted=False)
    agent = start_effects(settings_for(tmp_path, NODE, budget_max_nodes=1, replace_noexecute_grace_seconds=0.0),
                          cluster)
    store = agent.budget._store
    real_replace = store.replace

    def give_back_fails(body):
        store.replace = real_replace
        cluster.fail_next(1, 500)
        return real_replace(body)

    store.replace = give_back_fails
    agent.startup(T0 - 1, "boot-1")
    assert agent.budget.slot is not None and held_by(cluster, NODE) == [slot_name(0)]
    peer_holds(cluster, 0, "gpu-node-7", at=T0, effect="NoSchedule")  # the reclaim, with its taint
    status = agent.reconcile(XID95, T0, "boot-1")
    assert effects(cluster) == {"gpu-node-7": "NoSchedule", NODE: "NoSchedule"}
    assert status.budget_blocked and status.taint_effect == "NoSchedule"
    assert held_by(cluster, NODE) == []


def test_a_noexecute_without_a_slot_takes_one_at_start_and_stays_when_none_is_free(tmp_path, cluster):
    """A NoExecute from a version before the budget (or put on by hand) takes a slot at start so it
    counts; with every slot held it stays on the node (its pods are gone already) and the agent
    asks again later. A NoSchedule without a slot takes none at start: its first decision asks."""
    taint = {"key": TAINT_KEY, "value": "replace_node", "effect": "NoExecute", "timeAdded": rfc3339(T0 - 900)}
    cluster.update_node(NODE, lambda n: n["spec"].update(taints=[taint]))
    started(tmp_path, cluster)
    assert held_by(cluster, NODE) and effects(cluster) == {NODE: "NoExecute"}
    cluster.update_node("gpu-node-3", lambda n: n["spec"].update(taints=[taint]))
    cluster.update_node("gpu-node-4", lambda n: n["spec"].update(taints=[dict(taint, effect="NoSchedule")]))
    for i in (0, 1):
        if not holders(cluster).get(slot_name(i)):
            peer_holds(cluster, i, f"gpu-node-{i + 1}")
    late = started(tmp_path / "late", cluster, node="gpu-node-3")
    assert held_by(cluster, "gpu-node-3") == [] and effects(cluster)["gpu-node-3"] == "NoExecute"
    status = late.reconcile(XID95, T0, "boot-1")
    assert not status.budget_blocked and effects(cluster)["gpu-node-3"] == "NoExecute"
    cluster.reset_log()
    started(tmp_path / "older", cluster, node="gpu-node-4")
    assert [r.method for r in cluster.writes(LEASES)] == []  # NoSchedule alone takes no slot at start


# -- the count -----------------------------------------------------------------------------------------

def test_the_counters_new_count_is_the_limit_at_the_next_look(tmp_path, cluster):
    """The fleet grows to 30 GPU nodes: until the counter counts again the limit stays 2 (the
    last count stands), after it 3. The agents never count."""
    for i in (0, 1):
        peer_holds(cluster, i, f"gpu-node-{i + 1}")
    cluster.seed_nodes(10, prefix="new-")
    effects = started(tmp_path, cluster)
    assert effects.reconcile(XID95, T0, "boot-1").budget_blocked and node_lists(cluster) == []
    count_gpu_nodes(cluster, at=T0 + 60)
    cluster.reset_log()
    status = effects.reconcile(XID95, effects.budget_recheck_at, "boot-1")
    assert not status.budget_blocked and held_by(cluster, NODE) == [slot_name(2)]
    assert node_lists(cluster) == []


def test_without_a_count_the_limit_is_the_smallest(tmp_path, fake):
    fake.seed_nodes(20)  # no counter has run
    peer_holds(fake, 0, "gpu-node-1")
    effects = started(tmp_path, fake)
    assert effects.reconcile(XID95, T0, "boot-1").budget_blocked and held_by(fake, NODE) == []


# -- failures: fail closed, counted, never raised -------------------------------------------------------

@pytest.mark.parametrize("status,kind", [(500, "budget_count_failed"), (403, "rejected_403")])
def test_a_budget_that_cannot_be_read_holds_the_node_at_noschedule(tmp_path, cluster, status, kind):
    agent = started(tmp_path, cluster, replace_noexecute_grace_seconds=0.0)
    store = agent.budget._store
    real_list = store.list

    def failing_look(*args, **kwargs):  # the node is read first; the look at the budget's Leases fails
        store.list = real_list
        cluster.fail_next(1, status=status)
        return real_list(*args, **kwargs)

    store.list = failing_look
    result = agent.reconcile(XID95, T0, "boot-1")
    assert effects(cluster) == {NODE: "NoSchedule"} and result.budget_blocked  # fails closed, not open
    counts = {**agent.errors, **agent.api_errors}
    assert counts.get(kind) == 1
    result = agent.reconcile(XID95, T0 + 5, "boot-1")  # the next reconcile looks again
    assert effects(cluster) == {NODE: "NoExecute"} and not result.budget_blocked and held_by(cluster, NODE)


def test_a_slot_that_cannot_be_given_back_now_is_given_back_later(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(finding("GPU_ROW_REMAP_PENDING", Action.REBOOT_NODE, xids=())), T0, "boot-1")
    store = effects.budget._store
    real_replace = store.replace
    failures = []

    def failing_once(body):
        if not failures:
            failures.append(body)
            from healthagent.effects.backend import ApiUnavailable
            raise ApiUnavailable("connection refused")
        return real_replace(body)

    store.replace = failing_once
    effects.reconcile(HEALTHY, T0 + 600, "boot-2")
    assert our_taints(cluster.node(NODE)) == [] and held_by(cluster, NODE)  # healing first
    effects.reconcile(HEALTHY, T0 + 700, "boot-2")
    assert held_by(cluster, NODE) == []


def test_dry_run_asks_no_budget_at_all(tmp_path):
    effects = start_effects(settings_for(tmp_path, NODE, kube="dry-run"), None)
    effects.startup(T0 - 1, "boot-1")
    status = effects.reconcile(XID95, T0, "boot-1")
    assert status.taint_effect == "NoSchedule" and not status.budget_blocked


# -- a budget per pool ----------------------------------------------------------------------------------

POOL = "karpenter.sh/nodepool"


def test_a_scope_label_gives_each_pool_its_own_share(tmp_path, fake):
    """Karpenter and managed node groups refuse to repair more than 20% of one pool, so the budget
    can be counted per pool: 10% of pool a (10 nodes) is 1, of pool b (20 nodes) 2, and a node
    without the label counts with the others that have none."""
    gpu = {"nvidia.com/gpu.present": "true"}
    fake.seed_nodes(10, prefix="a-", labels={**gpu, POOL: "a"})
    fake.seed_nodes(20, prefix="b-", labels={**gpu, POOL: "b"})
    fake.seed_nodes(10, prefix="none-", labels=gpu)
    count_gpu_nodes(fake, POOL)

    def agent(node):
        made = started(tmp_path / node, fake, node=node, replace_noexecute_grace_seconds=0.0,
                       budget_scope_label=POOL)
        made.reconcile(XID95, T0, "boot-1")
        return made

    for node in ("a-0", "a-1", "b-0", "b-1", "b-2", "none-0", "none-1"):
        agent(node)
    assert {n: e for n, e in effects(fake).items() if e == "NoExecute"}.keys() == {"a-0", "b-0", "b-1", "none-0"}
    assert effects(fake)["a-1"] == effects(fake)["b-2"] == effects(fake)["none-1"] == "NoSchedule"
    counts = {lease["metadata"]["annotations"].get("healthagent.io/budget-scope-value"):
              lease["metadata"]["annotations"][GPU_NODES_ANNOTATION]
              for lease in fake.leases(NAMESPACE) if lease["metadata"]["name"].endswith("-count")}
    assert counts == {f"{POOL}=a": "10", f"{POOL}=b": "20", f"{POOL}=": "10"}
    assert all(lease["metadata"]["name"].startswith("healthagent-budget-p") for lease in fake.leases(NAMESPACE))


def test_a_scope_label_that_is_no_label_key_stops_start_up(tmp_path):
    from healthagent.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match=r"^budget_scope_label: 'karpenter sh' is not a label key; use a label"):
        load_settings(env={}, flags={"budget_scope_label": "karpenter sh", "state_file": str(tmp_path / "s")})


@pytest.mark.parametrize("label", ["healthagent.io/pool", "sagemaker.amazonaws.com/node-health-status"])
def test_a_scope_label_a_node_may_write_on_itself_stops_start_up(tmp_path, label):
    """The admission policy lets each node's agent write these labels on its own node: a pool read
    from one of them would be the node's own choice, and the holder judgement reads the pool there."""
    from healthagent.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match=r"^budget_scope_label: .* may write on its own node.*; use a label"):
        load_settings(env={}, flags={"budget_scope_label": label, "state_file": str(tmp_path / "s")})


def test_a_slot_held_by_a_node_of_another_pool_is_taken_back(tmp_path, fake, caplog):
    """b-0 (pool b) took itself out with its own NoExecute and writes pool a's one slot in its
    name: as a holder of pool a it is judged by its Node's pool label, not by the slot it wrote,
    and pool a's faulty node takes the slot once it has seen it a while, with no disruptive step
    of its own yet to lose."""
    gpu = {"nvidia.com/gpu.present": "true"}
    fake.seed_nodes(10, prefix="a-", labels={**gpu, POOL: "a"})
    fake.seed_nodes(10, prefix="b-", labels={**gpu, POOL: "b"})
    pool_a = Scope(POOL, "a")
    fake.put_lease(NAMESPACE, held_lease(new_lease(slot_name(0, pool_a), NAMESPACE, "slot", pool_a), "b-0",
                                         T0 - 600, acquired=True))
    fake.update_node("b-0", lambda n: n["spec"].update(taints=[
        {"key": TAINT_KEY, "value": "replace_node", "effect": "NoExecute"}]))
    agent = start_effects(settings_for(tmp_path, "a-0", budget_scope_label=POOL), fake)
    agent.startup(T0 - SLOT_GRACE_SECONDS - 1, "boot-1")  # seen unchanged for the slot grace
    with caplog.at_level("WARNING"):
        status = agent.reconcile(XID95, T0, "boot-1")
    assert not status.budget_blocked and held_by_in(fake, "a-0") == [slot_name(0, pool_a)]
    assert "not in this budget's pool karpenter.sh/nodepool='a' (its label says 'b')" in caplog.text


def held_by_in(fake, node):
    """The slots (of any pool) held in ``node``'s name."""
    return [lease["metadata"]["name"] for lease in fake.leases(NAMESPACE)
            if "-slot-" in lease["metadata"]["name"] and (lease.get("spec") or {}).get("holderIdentity") == node]


def test_a_node_whose_start_up_could_not_read_it_counts_in_its_own_pool(tmp_path, fake):
    """The API server did not answer at start, so the agent never read its pool label there: its
    first question reads it from the node it steps against, and takes pool a's slot, not the slot
    of the nodes without the label."""
    fake.seed_nodes(10, prefix="a-", labels={"nvidia.com/gpu.present": "true", POOL: "a"})
    agent = start_effects(settings_for(tmp_path, "a-0", budget_scope_label=POOL), fake)
    fake.fail_next(1, 503)
    agent.startup(T0 - 1, "boot-1")
    assert agent.api_errors.get("unavailable") == 1
    assert not agent.reconcile(XID95, T0, "boot-1").budget_blocked
    assert held_by_in(fake, "a-0") == [slot_name(0, Scope(POOL, "a"))]
