"""The budget's Leases as hostile input, on the fake API server: every node's credentials can write
a slot in its own name, so what a slot says is judged, never trusted.

- A held slot is taken back by what its holder's Node shows (gone, no taint, or no disruptive
  step past the grace), by how long THIS agent has seen it unchanged, and never by the times
  its holder wrote; a node holds one slot, and a second in its name is taken back at once.
- A count that is no number of nodes is no count (the smallest limit); the agent never writes
  one, the counter's next round does (only it may: tests/deploy/test_budget_attacks.py).
- A slot name no agent writes is no slot.

The same attacks with real node tokens on a real API server: tests/deploy/test_budget_attacks.py.
"""

from __future__ import annotations

import pytest

from healthagent.effects.budget import (
    COUNT_LEASE,
    GPU_NODES_ANNOTATION,
    SLOT_GRACE_SECONDS,
    counted,
    held_lease,
    new_lease,
    slot_name,
)
from healthagent.effects.budget_reclaim import LIVE_HOLDER_SECONDS
from healthagent.effects.hyperpod import HYPERPOD_HEALTH_LABEL, HYPERPOD_PENDING_REPLACEMENT
from tests.effects.budget_helpers import (  # noqa: F401 (cluster: a fixture)
    NAMESPACE,
    NODE,
    cluster,
    count_gpu_nodes,
    effects,
    held_by,
    holders,
    node_lists,
    peer_holds,
)
from tests.effects.helpers import T0, XID95, settings_for, start_effects, started

pytestmark = pytest.mark.integration


# -- stale holders -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,reclaimed", [
    ("holder node deleted", True),
    ("holder node deleted, the limit shrank with it: more holders than the limit", False),
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
        if "shrank" not in case:
            cluster.seed_nodes(1, prefix="new-")  # still 20 GPU nodes: a limit of 2
        count_gpu_nodes(cluster, at=T0 - 3600)
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
    if "shrank" in case:  # slot 1 lies past the limit of 1: its stale holder is cleared, not replaced
        assert holders(cluster)[slot_name(1)] == ""
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


# -- Leases parsed defensively: a count or a slot no writer could have made is none ---------------------

def poisoned_count(fake, nodes: str, at: float = T0 - 5, **spec: str) -> None:
    lease = counted(new_lease(COUNT_LEASE, NAMESPACE, "count"), 20, "nvidia.com/gpu.present=true", at)
    lease["metadata"]["annotations"][GPU_NODES_ANNOTATION] = nodes
    lease["spec"].update(spec)
    fake.put_lease(NAMESPACE, lease)


def the_count(fake) -> str:
    lease = next(lease for lease in fake.leases(NAMESPACE) if lease["metadata"]["name"] == COUNT_LEASE)
    return lease["metadata"]["annotations"][GPU_NODES_ANNOTATION]


@pytest.mark.parametrize("nodes", ["\u00b2", "9" * 401, "-3", " 20", "20.0", "1e9", "", "100001"])
def test_a_count_that_is_no_number_of_nodes_fails_safe_and_the_counter_heals_it(tmp_path, cluster, nodes):
    """A superscript two passes ``str.isdigit`` and breaks ``int``; 401 digits overflow the limit's
    float product. Either must not abort the reconcile (the faulty node would get no taint at
    all). The agent never writes a count: the counter's next round puts the true one back."""
    poisoned_count(cluster, nodes)
    agent = started(tmp_path, cluster, replace_noexecute_grace_seconds=0.0)
    result = agent.reconcile(XID95, T0, "boot-1")
    assert effects(cluster) == {NODE: "NoExecute"} and not result.budget_blocked  # the smallest limit, 1
    assert the_count(cluster) == nodes and agent.errors == {} and node_lists(cluster) == []
    count_gpu_nodes(cluster, at=T0 + 1)
    assert the_count(cluster) == "20"


def test_a_count_stamped_far_in_the_future_is_counted_again_by_the_counter(cluster):
    """A renewTime in 2099 must not look fresh to the counter, or a forged count would stand."""
    poisoned_count(cluster, "100000", renewTime="2099-01-01T00:00:00.000000Z")
    count_gpu_nodes(cluster, at=T0)
    assert the_count(cluster) == "20"


def test_a_slot_lease_with_a_name_no_agent_writes_is_ignored(tmp_path, cluster):
    for odd in ("\u00b2", "007", "9" * 401):
        lease = held_lease(new_lease(f"healthagent-budget-slot-{odd}", NAMESPACE, "slot"), "gpu-node-5", T0,
                           acquired=True)
        cluster.put_lease(NAMESPACE, lease)
    agent = started(tmp_path, cluster, replace_noexecute_grace_seconds=0.0)
    agent.reconcile(XID95, T0, "boot-1")
    assert effects(cluster) == {NODE: "NoExecute"} and agent.errors == {}


# -- one slot a node, and a holder that never takes its step ------------------------------------------

def test_a_second_slot_in_one_nodes_name_is_taken_back_at_once_without_a_read(tmp_path, cluster):
    """gpu-node-5 (its own NoExecute on) holds both slots of the limit of 2: the one it needs
    stands, the other is a duplicate, taken back at the first look, young as it is."""
    peer_holds(cluster, 0, "gpu-node-5", at=T0 - 1)
    peer_holds(cluster, 1, "gpu-node-5", at=T0 - 1)
    agent = started(tmp_path, cluster)
    cluster.reset_log()
    status = agent.reconcile(XID95, T0, "boot-1")
    assert held_by(cluster, NODE) == [slot_name(1)] and held_by(cluster, "gpu-node-5") == [slot_name(0)]
    assert not status.budget_blocked
    assert [r for r in cluster.requests("GET", "/api/v1/nodes/") if r.path.endswith("gpu-node-5")] == []



def test_a_node_squatting_on_every_slot_counts_once_and_is_judged_as_a_holder(tmp_path, cluster):
    """gpu-node-6 holds slot 0 with its NoExecute; gpu-node-5 writes slots 1..9 in its own name
    and taints itself NoSchedule. Slots 2..9 lie past the limit of 2, so taking one would be a
    third node out: none is. gpu-node-5 keeps slot 1 while it could be within its grace, and
    loses it once it has not taken its step by then."""
    peer_holds(cluster, 0, "gpu-node-6")
    for index in range(1, 10):
        peer_holds(cluster, index, "gpu-node-5", at=T0 - 1, effect="NoSchedule")
    agent = start_effects(settings_for(tmp_path, NODE), cluster)
    agent.startup(T0 - 1, "boot-1")
    assert agent.reconcile(XID95, T0, "boot-1").budget_blocked and held_by(cluster, NODE) == []
    now = T0
    while not held_by(cluster, NODE) and now < T0 + 600:
        now = agent.budget_recheck_at
        agent.reconcile(XID95, now, "boot-1")
    assert held_by(cluster, NODE) == [slot_name(1)] and now - T0 >= 120 + SLOT_GRACE_SECONDS - 1

@pytest.mark.parametrize("shows,seen_for,reclaimed,engines", [
    ("NoSchedule only", 120 + SLOT_GRACE_SECONDS, True, {}),
    ("NoSchedule only", 120 + SLOT_GRACE_SECONDS - 5, False, {}),  # within the grace: its step may come
    ("HyperPod replacement requested", 1000, False, {"hyperpod_labels": True}),
    ("HyperPod replacement requested, no HyperPod in use", 1000, True, {}),
    ("AcceleratedHardwareReady False", 1000, False, {"condition_vocabulary": "eks"}),
    ("AcceleratedHardwareReady False, no node repair in use", 1000, True, {}),
    ("NoExecute", 1000, False, {}),
])
def test_a_holder_that_never_takes_its_disruptive_step_loses_its_slot_after_the_grace(
        tmp_path, cluster, shows, seen_for, reclaimed, engines):
    """A holder whose agent stopped after its NoSchedule, or a node that tainted itself to squat on
    a slot: past the grace (120 s here) plus the slot grace of this agent's own clock, with no
    disruptive step on its Node that an engine in use acts on, its slot is taken back. HyperPod's
    label and a gated condition are any node's to write about itself: without the engine they
    take nothing out, so they keep no slot."""
    for index, holder in enumerate(("gpu-node-5", "gpu-node-6")):
        peer_holds(cluster, index, holder, effect="NoExecute" if shows == "NoExecute" else "NoSchedule")

    def show(node):
        if shows.startswith("HyperPod"):
            node["metadata"].setdefault("labels", {})[HYPERPOD_HEALTH_LABEL] = HYPERPOD_PENDING_REPLACEMENT
        if shows.startswith("Accelerated"):
            node["status"].setdefault("conditions", []).append(
                {"type": "AcceleratedHardwareReady", "status": "False", "reason": "NvidiaXID95Error"})

    for holder in ("gpu-node-5", "gpu-node-6"):
        cluster.update_node(holder, show)
    agent = start_effects(settings_for(tmp_path, NODE, **engines), cluster)
    agent.startup(T0 - seen_for, "boot-1")  # the agent's first look at both slots
    status = agent.reconcile(XID95, T0, "boot-1")
    assert bool(held_by(cluster, NODE)) is reclaimed and status.budget_blocked is (not reclaimed)
    if reclaimed:
        assert "past the 120 s grace" in agent.budget.note or held_by(cluster, NODE)


def test_a_holder_within_its_grace_is_looked_at_again_when_it_could_be_stuck(tmp_path, cluster):
    """A live holder is not read again for a while, but never past the moment its grace ends."""
    for index, holder in enumerate(("gpu-node-5", "gpu-node-6")):
        peer_holds(cluster, index, holder, effect="NoSchedule")
    agent = start_effects(settings_for(tmp_path, NODE), cluster)
    agent.startup(T0 - SLOT_GRACE_SECONDS, "boot-1")
    assert agent.reconcile(XID95, T0, "boot-1").budget_blocked  # judged: within its grace
    now = T0
    while not held_by(cluster, NODE) and now < T0 + LIVE_HOLDER_SECONDS:
        now = agent.budget_recheck_at
        agent.reconcile(XID95, now, "boot-1")
    assert held_by(cluster, NODE) and now <= T0 + 120 + 4 * 30  # the grace, then a re-check or so
