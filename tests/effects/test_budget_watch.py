"""The held node's watch on the budget's slot Leases (``effects/budget_watch.py``), on the fake API
server: what it reports, what it ignores, and what it survives. Any node can write a Lease of the
budget, so what the stream carries is hostile input: it can wake the node for a look (which
judges the Leases itself), never take a slot or stop the watch.
"""

from __future__ import annotations

import random

import pytest

from healthagent.common import ErrorTally
from healthagent.effects.backend import ApiBackend
from healthagent.effects.budget import COUNT_LEASE, FLEET, Scope, held_lease, new_lease, released_lease, slot_name
from healthagent.effects.budget_leases import LeaseStore
from healthagent.effects.budget_watch import SlotWatch
from tests.effects.budget_helpers import NAMESPACE, NODE, count_gpu_nodes, held_by, peer_holds
from tests.effects.helpers import T0, Wakes, XID95, settings_for, start_effects, wait_for
from tests.support.gated_source import LONG

SLOT_LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"


@pytest.fixture
def watching(fake):
    """A SlotWatch of the fleet's budget over the fake, its wake-ups and its tally."""
    fake.seed_nodes(3)
    wakes, tally = Wakes(), ErrorTally("kube")
    watch = SlotWatch(LeaseStore(ApiBackend(fake.api_client(), NODE), NAMESPACE), node_name=NODE, tally=tally,
                      rng=random.Random(1), on_freed=wakes, backoff=(0.01, 0.05))
    yield watch, wakes, tally
    watch.stop()


def started(fake, watch, scope: Scope = FLEET) -> None:
    """Follow ``scope`` and wait until the stream is open (the fake serves it)."""
    watch.follow(scope)
    wait_for(lambda: fake.open_watches() == 1, LONG, "the slot watch to be open")


def reopened(fake, requests: int) -> None:
    """Wait until the watch was requested ``requests`` times and only the newest stream is open
    (the fake notices a stream its client left a moment later)."""
    wait_for(lambda: len(fake.watches(SLOT_LEASES)) == requests and fake.open_watches() == 1, LONG,
             f"watch request {requests} to be the one open stream")


def test_a_slot_given_back_or_deleted_wakes_the_held_node(fake, watching):
    watch, wakes, _ = watching
    peer_holds(fake, 0, "gpu-node-1")
    started(fake, watch)
    assert not watch.take_freed()  # the current state: every slot held
    lease = next(x for x in fake.leases(NAMESPACE) if x["metadata"]["name"] == slot_name(0))
    fake.put_lease(NAMESPACE, released_lease(lease))
    assert wakes.wait(LONG) and watch.take_freed() and not watch.take_freed()
    peer_holds(fake, 0, "gpu-node-2")
    fake.handle("DELETE", f"{SLOT_LEASES}/{slot_name(0)}", {}, "", None)
    assert wakes.wait(LONG) and watch.take_freed()


def test_a_free_slot_at_the_start_is_reported_so_no_release_is_missed(fake, watching):
    """A slot given back between the look that held the node and the watch's start."""
    watch, wakes, _ = watching
    fake.put_lease(NAMESPACE, new_lease(slot_name(1), NAMESPACE, "slot"))
    started(fake, watch)
    assert wakes.wait(LONG) and watch.take_freed()


def test_what_frees_no_slot_of_this_budget_wakes_nothing(fake, watching):
    """A slot taken, the shared count re-written, another pool's slot given back, a Lease that is
    no slot: no wake-up. The last write frees a slot of this budget, and the wake-up it causes is
    the first."""
    watch, wakes, _ = watching
    started(fake, watch)
    peer_holds(fake, 0, "gpu-node-1")
    count = new_lease(COUNT_LEASE, NAMESPACE, "count")
    fake.put_lease(NAMESPACE, count)
    pool = Scope("karpenter.sh/nodepool", "b")
    fake.put_lease(NAMESPACE, new_lease(slot_name(0, pool), NAMESPACE, "slot", pool))
    fake.put_lease(NAMESPACE, new_lease("healthagent-budget-slot-007", NAMESPACE, "slot"))
    odd = held_lease(new_lease(slot_name(2), NAMESPACE, "slot"), "gpu-node-1", T0, acquired=True)
    fake.put_lease(NAMESPACE, odd)
    fake.put_lease(NAMESPACE, released_lease(odd))  # the one write that frees a slot
    assert wakes.wait(LONG) and wakes.count == 1 and watch.take_freed()


def test_a_garbage_line_a_refusal_and_a_cut_stream_are_counted_and_survived(fake, watching):
    watch, wakes, tally = watching
    started(fake, watch)
    fake.send_raw_watch_line("{not json")
    wait_for(lambda: tally.snapshot().get("watch_bad_event") == 1, LONG, "the bad line counted")
    reopened(fake, 2)
    fake.drop_watches()
    wait_for(lambda: tally.snapshot().get("watch_unavailable", 0) >= 1, LONG, "the cut counted")
    reopened(fake, 3)
    peer_holds(fake, 0, "gpu-node-1", tainted=False)
    fake.put_lease(NAMESPACE, released_lease(fake.leases(NAMESPACE)[0]))
    assert wakes.wait(LONG) and watch.take_freed()
    watch.stop()
    fake.fail_next(1, 403)
    started_refused = SlotWatch(LeaseStore(ApiBackend(fake.api_client(), NODE), NAMESPACE), node_name=NODE,
                                tally=tally, rng=random.Random(1), backoff=(LONG, LONG))
    started_refused.follow(FLEET)
    wait_for(lambda: tally.snapshot().get("watch_rejected_403") == 1, LONG, "the refusal counted")
    started_refused.stop()  # it waits out its retry without a request meanwhile, and stops at once
    assert not started_refused.running


def test_the_watch_runs_only_while_the_node_is_held(tmp_path, fake):
    """Held: watching; a slot taken: not; no disruptive step ahead any more: not."""
    fake.seed_nodes(20)
    count_gpu_nodes(fake)  # 10% of the 20 counted: a limit of 2, both held by peers
    for index, peer in enumerate(("gpu-node-5", "gpu-node-6")):
        peer_holds(fake, index, peer)
    effects = start_effects(settings_for(tmp_path, NODE), fake, watch=True)
    effects.startup(T0 - 1, "boot-1")
    watch = effects.budget._watch
    assert effects.reconcile(XID95, T0, "boot-1").budget_blocked and watch.running
    lease = next(x for x in fake.leases(NAMESPACE) if x["metadata"]["name"] == slot_name(1))
    fake.put_lease(NAMESPACE, released_lease(lease))
    wait_for(lambda: watch.freed.is_set(), LONG, "the freed slot heard")
    status = effects.reconcile(XID95, T0 + 1, "boot-1")
    assert status.budget_blocked and T0 + 1 <= effects.budget_recheck_at <= T0 + 2  # a look within a second
    assert not effects.reconcile(XID95, effects.budget_recheck_at, "boot-1").budget_blocked
    assert held_by(fake, NODE) == [slot_name(1)] and not watch.running
    effects.close()
    assert effects.errors == {}
