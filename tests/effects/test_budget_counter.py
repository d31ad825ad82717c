"""The budget counter's decisions as pure functions: what it counts per budget, and which count
Leases it writes (only what changed, or what has not been confirmed for a while)."""

from __future__ import annotations

from healthagent.budget_counter import COUNTER_ACCOUNT, count_writes, counts_by_scope, main
from healthagent.effects.budget import COUNT_LEASE, COUNT_MAX_AGE_SECONDS, GPU_NODES_ANNOTATION, SELECTOR_ANNOTATION
from healthagent.effects.budget import Scope, counted, new_lease

T0 = 1_700_000_000.0
SELECTOR = "nvidia.com/gpu.present=true"
POOL = "karpenter.sh/nodepool"


def stored(nodes: int, at: float = T0, scope: Scope = Scope(), selector: str = SELECTOR) -> dict:
    lease = counted(new_lease(scope.count_name, "healthagent", "count", scope), nodes,
                    scope.node_selector(selector), at)
    lease["metadata"]["resourceVersion"] = "5"
    return lease


def test_the_fleet_is_one_count_and_a_scope_label_one_count_per_value():
    labels = [{POOL: "a"}, {POOL: "a"}, {POOL: "b"}, {}]
    assert counts_by_scope(iter(labels), "") == {Scope(): 4}
    assert counts_by_scope(iter(labels), POOL) == {Scope(POOL, "a"): 2, Scope(POOL, "b"): 1, Scope(POOL, ""): 1}
    assert counts_by_scope(iter([]), "") == {Scope(): 0}


def test_a_first_count_is_created_with_its_selector_and_the_counters_name():
    (body,) = count_writes([], {Scope(): 20}, SELECTOR, "healthagent", T0)
    annotations = body["metadata"]["annotations"]
    assert body["metadata"]["name"] == COUNT_LEASE and "resourceVersion" not in body["metadata"]
    assert (annotations[GPU_NODES_ANNOTATION], annotations[SELECTOR_ANNOTATION]) == ("20", SELECTOR)
    assert body["spec"]["holderIdentity"] == COUNTER_ACCOUNT


def test_an_unchanged_fresh_count_is_not_written_again():
    assert count_writes([stored(20)], {Scope(): 20}, SELECTOR, "healthagent", T0 + 60) == []


def test_a_changed_an_old_a_future_or_a_foreign_selector_count_is_written():
    half = COUNT_MAX_AGE_SECONDS / 2
    for lease, nodes in ((stored(20), 21), (stored(20, at=T0 - half - 1), 20), (stored(20, at=T0 + 86400), 20),
                         (stored(20, selector="other=x"), 20)):
        (body,) = count_writes([lease], {Scope(): nodes}, SELECTOR, "healthagent", T0)
        assert body["metadata"]["resourceVersion"] == "5"  # a guarded update of the one read
        assert body["metadata"]["annotations"][GPU_NODES_ANNOTATION] == str(nodes)
        assert body["metadata"]["annotations"][SELECTOR_ANNOTATION] == SELECTOR


def test_a_pool_that_lost_its_last_node_counts_zero_and_each_pool_its_own_selector():
    gone = Scope(POOL, "old")
    writes = count_writes([stored(3, scope=gone)], {Scope(POOL, "a"): 2}, SELECTOR, "healthagent", T0)
    by_name = {w["metadata"]["name"]: w["metadata"]["annotations"] for w in writes}
    assert by_name[gone.count_name][GPU_NODES_ANNOTATION] == "0"
    assert by_name[Scope(POOL, "a").count_name][SELECTOR_ANNOTATION] == f"{SELECTOR},{POOL}=a"


def test_an_interval_under_a_second_stops_start_up(capsys):
    assert main(["--interval", "0.5"]) == 3
    assert "interval" in capsys.readouterr().err
