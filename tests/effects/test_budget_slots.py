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
    COUNT_LEASE,
    COUNT_MAX_AGE_SECONDS,
    GPU_NODES_ANNOTATION,
    SLOT_GRACE_SECONDS,
    claimed_count,
    counted,
    held_lease,
    new_lease,
    slot_name,
)
from healthagent.effects.budget_guard import LIVE_HOLDER_SECONDS
from healthagent.effects.node_desired import CLEAR_ANNOTATION, HEALTH_LABEL, HYPERPOD_HEALTH_LABEL
from healthagent.effects.api_time import rfc3339
from healthagent.model import Action
from tests.effects.helpers import (HEALTHY, T0, TAINT_KEY, XID95, cleared_by, condition, finding, our_taints, settings_for,
                                   start_effects, started, verdict)

pytestmark = pytest.mark.integration

NODE = "gpu-node-0"
NAMESPACE = "healthagent"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"


@pytest.fixture
def cluster(fake):
    fake.seed_nodes(20)  # 10% of 20 GPU nodes: a limit of 2
    return fake


def peer_holds(fake, index, name, tainted=True, at=T0 - 600, value="replace_node"):
    """Peer ``name``'s agent holds slot ``index`` (taken at ``at``) and, ``tainted``, its taint."""
    lease = held_lease(new_lease(slot_name(index), NAMESPACE, "slot"), name, at, acquired=True)
    fake.put_lease(NAMESPACE, lease)
    if tainted:
        taint = {"key": TAINT_KEY, "value": value, "effect": "NoSchedule", "timeAdded": rfc3339(at)}
        fake.update_node(name, lambda n: n["spec"].update(taints=[taint]))


def holders(fake):
    """Slot name -> holder, for every slot Lease (free ones: "")."""
    return {lease["metadata"]["name"]: (lease.get("spec") or {}).get("holderIdentity") or ""
            for lease in fake.leases(NAMESPACE) if lease["metadata"]["name"] != COUNT_LEASE}


def held_by(fake, node):
    return [name for name, holder in holders(fake).items() if holder == node]


def tainted(fake):
    return sorted(n["metadata"]["name"] for n in fake.nodes() if our_taints(n))


def effects(fake):
    """Node name -> the effect of the agent's taint, for every node that carries one."""
    return {n["metadata"]["name"]: our_taints(n)[0]["effect"] for n in fake.nodes() if our_taints(n)}


def node_lists(fake):
    """LISTs of nodes other than the watch's own-node list (fieldSelector)."""
    return [r.query for r in fake.requests("GET", "/api/v1/nodes")
            if r.path == "/api/v1/nodes" and "fieldSelector" not in r.query]


def before_write(effects, action):
    """Run ``action`` once, right after this agent's next look at the budget's Leases: a peer (or
    the API server) acting between this agent's look and its write."""
    store = effects.budget._store
    real_list = store.list
    done = []

    def look(*args, **kwargs):
        items = real_list(*args, **kwargs)
        if not done:
            done.append(True)
            action()
        return items

    store.list = look


# -- taking, holding back, giving back ---------------------------------------------------------------

def test_a_fault_takes_a_slot_then_taints_and_the_fleet_count_is_shared(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    count = next(lease for lease in cluster.leases(NAMESPACE) if lease["metadata"]["name"] == COUNT_LEASE)
    assert count["metadata"]["annotations"][GPU_NODES_ANNOTATION] == "20"  # counted once, at start
    (table,) = node_lists(cluster)
    assert table == {"labelSelector": "nvidia.com/gpu.present=true", "resourceVersion": "0", "includeObject": "None"}
    cluster.reset_log()
    status = effects.reconcile(XID95, T0, "boot-1")
    assert tainted(cluster) == [NODE] and held_by(cluster, NODE) in ([slot_name(0)], [slot_name(1)])
    assert not status.budget_blocked and status.pending_writes == 0
    assert node_lists(cluster) == []  # no node is listed to decide
    assert [(r.method, r.path) for r in cluster.writes()] == [
        ("POST", LEASES),  # the slot, created by the first node to take it
        ("PATCH", f"/api/v1/nodes/{NODE}"),  # the taint
        ("PUT", f"{LEASES}/{held_by(cluster, NODE)[0]}"),  # the slot re-written after the taint landed
        ("PATCH", f"/api/v1/nodes/{NODE}/status"),
        ("POST", "/apis/events.k8s.io/v1/namespaces/default/events")]
    peer = started(tmp_path / "peer", cluster, node="gpu-node-1")  # the count is fresh: not again
    assert peer and node_lists(cluster) == []


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
    # it does not ask again: one GET of its own slot confirms it before the disruptive step
    assert [r.path for r in cluster.requests("GET", LEASES)] == [f"{LEASES}/{own}"]
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
    assert effects(cluster) == {"gpu-node-5": "NoSchedule", "gpu-node-6": "NoSchedule", NODE: "NoSchedule"}
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
    """The confirming read right before NoExecute finds the slot in another node's name: this node
    never gets NoExecute, and says so."""
    agent = started(tmp_path, cluster, budget_max_nodes=1, replace_noexecute_grace_seconds=0.0)
    store = agent.budget._store
    real_create = store.create

    def create_then_lose_it(body):
        written = real_create(body)
        steal(cluster, written)
        return written

    store.create = create_then_lose_it
    status = agent.reconcile(XID95, T0, "boot-1")
    node_writes = [r.body for r in cluster.writes(f"/api/v1/nodes/{NODE}") if not r.path.endswith("/status")]
    assert len(node_writes) == 1 and "NoExecute" not in str(node_writes)
    assert effects(cluster) == {"gpu-node-7": "NoSchedule", NODE: "NoSchedule"} and status.budget_blocked
    assert agent.errors.get("budget_slot_lost") == 1


def test_a_slot_reclaimed_before_the_write_landed_sends_the_node_back_to_held_noschedule(tmp_path, cluster):
    """The slot is taken and confirmed, and before this agent's write lands another node reclaims
    it (it judged the slot stale). With no grace that write was NoExecute and HyperPod's
    replacement value; the re-write of the slot after it fails, and both go back: NoSchedule,
    held, Schedulable."""
    agent = started(tmp_path, cluster, budget_max_nodes=1, replace_noexecute_grace_seconds=0.0,
                    hyperpod_labels=True)
    store = agent.budget._store
    real_read = store.read

    def confirm_then_lose_it(name):
        confirmed = real_read(name)
        steal(cluster, confirmed)
        store.read = real_read
        return confirmed

    store.read = confirm_then_lose_it
    status = agent.reconcile(XID95, T0, "boot-1")
    assert held_by(cluster, "gpu-node-7") == [slot_name(0)] and held_by(cluster, NODE) == []
    node_writes = [r.body for r in cluster.writes(f"/api/v1/nodes/{NODE}") if not r.path.endswith("/status")]
    assert len(node_writes) == 2  # NoExecute with the replacement value, then back
    assert effects(cluster) == {"gpu-node-7": "NoSchedule", NODE: "NoSchedule"}
    assert cluster.node(NODE)["metadata"]["labels"][HYPERPOD_HEALTH_LABEL] == "Schedulable"
    assert status.budget_blocked and status.pending_writes == 0 and status.taint_effect == "NoSchedule"
    assert [e["reason"] for e in cluster.events() if e["reason"] in ("Cleared", "TaintBlockedByBudget")] == [
        "TaintBlockedByBudget"]
    status = agent.reconcile(XID95, T0 + 5, "boot-1")  # held: it waits for its next look
    assert status.budget_blocked and effects(cluster)[NODE] == "NoSchedule"


# -- stale holders -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,reclaimed", [
    ("holder node deleted", True),
    ("holder without taint, slot seen unchanged for longer than the grace", True),
    ("holder without taint, slot first seen just now (a decision in flight)", False),
    ("holder node deleted, slot first seen just now", False),
    ("holder without taint, slot rewritten within the grace", False),
    ("holder with its taint", False),
])
def test_a_full_budget_reclaims_only_a_stale_slot_after_one_get_of_its_holder(tmp_path, cluster, case,
                                                                               reclaimed):
    """A slot's age is how long THIS agent has seen it at one version, on its own clock: the
    times the holder wrote in the Lease (here an hour old, or far in the future) count for
    nothing, so a forged or skewed ``renewTime`` neither frees a slot early nor holds it."""
    peer_holds(cluster, 0, "gpu-node-1")
    young = "just now" in case
    peer_holds(cluster, 1, "gpu-node-2", tainted="with its taint" in case or "deleted" in case,
               at=T0 + 86400 if young else T0 - 3600)
    if "deleted" in case:
        cluster.delete_node("gpu-node-2")
    agent = start_effects(settings_for(tmp_path, NODE), cluster)
    agent.startup(T0 - (0 if young else SLOT_GRACE_SECONDS + 1), "boot-1")  # the agent's first look
    if "rewritten" in case:  # the holder wrote its slot again (same old renewTime): a new version
        lease = next(x for x in cluster.leases(NAMESPACE) if x["metadata"]["name"] == slot_name(1))
        cluster.put_lease(NAMESPACE, held_lease(lease, "gpu-node-2", T0 - 3600, acquired=False))
        agent.startup(T0 - 1, "boot-1")  # a second look sees that version for the first time
    agent.budget._rng.choice = lambda seq: seq[-1]  # judge gpu-node-2's slot
    cluster.reset_log()
    status = agent.reconcile(XID95, T0, "boot-1")
    assert effects(cluster)[NODE] == "NoSchedule" and (held_by(cluster, NODE) == [slot_name(1)]) is reclaimed
    assert status.budget_blocked is (not reclaimed)
    holder_reads = [r for r in cluster.requests("GET", "/api/v1/nodes/") if r.path.endswith("gpu-node-2")]
    judged = not young and "rewritten" not in case
    assert len(holder_reads) == int(judged) and node_lists(cluster) == []  # a young slot is not judged


def test_a_live_holder_is_not_read_again_for_a_while(tmp_path, cluster):
    for i in (0, 1):
        peer_holds(cluster, i, f"gpu-node-{i + 1}")
    effects = start_effects(settings_for(tmp_path, NODE), cluster)
    effects.startup(T0 - SLOT_GRACE_SECONDS - 1, "boot-1")  # both slots seen unchanged past the grace
    effects.reconcile(XID95, T0, "boot-1")
    for _ in range(2):  # two more looks within LIVE_HOLDER_SECONDS
        assert effects.budget_recheck_at < T0 + LIVE_HOLDER_SECONDS
        effects.reconcile(XID95, effects.budget_recheck_at, "boot-1")
    reads = [r.path for r in cluster.requests("GET", "/api/v1/nodes/") if r.path != f"/api/v1/nodes/{NODE}"]
    assert sorted(reads) == ["/api/v1/nodes/gpu-node-1", "/api/v1/nodes/gpu-node-2"]  # each once
    assert effects.reconcile(XID95, effects.budget_recheck_at, "boot-1").budget_blocked


def test_a_deleted_node_gives_its_slot_back(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    assert held_by(cluster, NODE)
    cluster.delete_node(NODE)
    effects.reconcile(XID95, T0 + 61, "boot-1")  # the read says 404
    assert effects.api_errors.get("node_not_found") == 1
    assert held_by(cluster, NODE) == []


# -- restarts and taints without a slot ---------------------------------------------------------------

def test_a_restarted_agent_finds_its_slot_and_takes_no_second(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    again = started(tmp_path, cluster)
    again.reconcile(XID95, T0 + 10, "boot-1")
    assert len(held_by(cluster, NODE)) == 1
    assert again.budget.slot is not None and again.budget.slot.name == held_by(cluster, NODE)[0]


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
    peer_holds(cluster, 0, "gpu-node-7", at=T0)  # the reclaim, with its taint
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

def test_an_old_count_is_counted_again_after_a_decision_and_only_once(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    later = T0 + COUNT_MAX_AGE_SECONDS + 5
    cluster.seed_nodes(10, prefix="new-")  # the fleet grew: 30 GPU nodes
    cluster.reset_log()
    effects.reconcile(XID95, later, "boot-1")  # decides with the old count, then counts again
    assert len(node_lists(cluster)) == 1
    count = next(lease for lease in cluster.leases(NAMESPACE) if lease["metadata"]["name"] == COUNT_LEASE)
    assert count["metadata"]["annotations"][GPU_NODES_ANNOTATION] == "30"
    peer = start_effects(settings_for(tmp_path / "peer", "gpu-node-1"), cluster)
    peer.startup(later + 1, "boot-1")
    peer.reconcile(XID95, later + 1, "boot-1")
    assert len(node_lists(cluster)) == 1  # fresh for everyone else


def test_a_count_claimed_by_another_agent_is_left_to_it(tmp_path, cluster):
    lease = claimed_count(new_lease(COUNT_LEASE, NAMESPACE, "count"), "gpu-node-9", T0 - 2)
    cluster.put_lease(NAMESPACE, lease)
    effects = started(tmp_path, cluster)
    assert node_lists(cluster) == []  # gpu-node-9 is counting
    effects.reconcile(XID95, T0, "boot-1")
    assert tainted(cluster) == [NODE]  # no count yet: the smallest limit, 1, still allows one


# -- failures: fail closed, counted, never raised -------------------------------------------------------

@pytest.mark.parametrize("status,kind", [(500, "budget_count_failed"), (403, "rejected_403")])
def test_a_budget_that_cannot_be_read_holds_the_node_at_noschedule(tmp_path, cluster, status, kind):
    agent = started(tmp_path, cluster, replace_noexecute_grace_seconds=0.0)
    cluster.fail_next(1, status=status)  # the look at the budget's Leases
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


# -- Leases any node could have written: parsed defensively, never trusted past what is plausible -------

def poisoned_count(fake, nodes: str, at: float = T0 - 5, **spec: str) -> None:
    lease = counted(new_lease(COUNT_LEASE, NAMESPACE, "count"), 20, "nvidia.com/gpu.present=true", at)
    lease["metadata"]["annotations"][GPU_NODES_ANNOTATION] = nodes
    lease["spec"].update(spec)
    fake.put_lease(NAMESPACE, lease)


def the_count(fake) -> str:
    lease = next(lease for lease in fake.leases(NAMESPACE) if lease["metadata"]["name"] == COUNT_LEASE)
    return lease["metadata"]["annotations"][GPU_NODES_ANNOTATION]


@pytest.mark.parametrize("nodes", ["\u00b2", "9" * 401, "-3", " 20", "20.0", "1e9", "", "100001"])
def test_a_count_that_is_no_number_of_nodes_fails_safe_and_is_counted_again(tmp_path, cluster, nodes):
    """A superscript two passes ``str.isdigit`` and breaks ``int``; 401 digits overflow the limit's
    float product. Either used to abort the reconcile, so the faulty node got no taint at all."""
    poisoned_count(cluster, nodes)
    agent = started(tmp_path, cluster, replace_noexecute_grace_seconds=0.0)
    result = agent.reconcile(XID95, T0, "boot-1")
    assert effects(cluster) == {NODE: "NoExecute"} and not result.budget_blocked  # the smallest limit, 1
    assert the_count(cluster) == "20" and agent.errors == {}  # taken again, and healed for everyone


@pytest.mark.parametrize("field", ["renewTime", "acquireTime"])
def test_a_count_or_claim_stamped_far_in_the_future_is_not_believed(tmp_path, cluster, field):
    """A renewTime in 2099 kept a count fresh forever (an inflated count would have ruled the
    fleet); an acquireTime in 2099 kept every agent from counting again."""
    old = T0 - COUNT_MAX_AGE_SECONDS - 100 if field == "acquireTime" else T0 - 5  # the claim: on a due count
    poisoned_count(cluster, "100000", at=old, **{field: "2099-01-01T00:00:00.000000Z"})
    agent = started(tmp_path, cluster)
    agent.reconcile(XID95, T0, "boot-1")
    assert the_count(cluster) == "20"


def test_a_slot_lease_with_a_name_no_agent_writes_is_ignored(tmp_path, cluster):
    for odd in ("\u00b2", "007", "9" * 401):
        lease = held_lease(new_lease(f"healthagent-budget-slot-{odd}", NAMESPACE, "slot"), "gpu-node-5", T0,
                           acquired=True)
        cluster.put_lease(NAMESPACE, lease)
    agent = started(tmp_path, cluster, replace_noexecute_grace_seconds=0.0)
    agent.reconcile(XID95, T0, "boot-1")
    assert effects(cluster) == {NODE: "NoExecute"} and agent.errors == {}


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
