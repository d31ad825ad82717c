"""The budget rule and the two-agents race, as pure functions."""

import random

import pytest

from healthagent.effects.budget import (
    budget_limit,
    count_budget,
    late_older_peers,
    must_roll_back,
    recheck_delay,
    recheck_interval,
)
from healthagent.effects.node_desired import parse_rfc3339

KEY = "healthagent.io/unhealthy"


def node(name, tainted=False, added="2024-05-01T10:00:00Z", key=KEY):
    taints = []
    if tainted:
        taint = {"key": key, "value": "replace_node", "effect": "NoSchedule"}
        if added:
            taint["timeAdded"] = added
        taints.append(taint)
    return {"metadata": {"name": name}, "spec": {"taints": taints}}


@pytest.mark.parametrize("total,fraction,max_nodes,limit", [
    (20, 0.10, None, 2),     # the documented example: the 3rd of 20 is blocked
    (9, 0.10, None, 1),      # floor(0.9) = 0, but one bad node can always go
    (0, 0.10, None, 1),
    (100, 0.29, None, 29),   # floating point: 0.29 * 100 = 28.999...
    (30, 0.10, None, 3),
    (200, 0.10, 5, 5),       # the count caps the share
    (20, 0.10, 0, 0),        # 0 nodes = never taint
    (20, 1.0, None, 20),
    (20, 0.0, None, 1),
])
def test_budget_limit(total, fraction, max_nodes, limit):
    assert budget_limit(total, fraction, max_nodes) == limit


@pytest.mark.parametrize("already,allows", [(0, True), (1, True), (2, False), (5, False)])
def test_count_on_twenty_nodes_at_ten_percent(already, allows):
    nodes = [node(f"n{i}", tainted=i < already) for i in range(19)] + [node("me")]
    count = count_budget(nodes, KEY, "me", 0.10, None)
    assert (count.total, len(count.tainted), count.limit, count.allows) == (20, already, 2, allows)


def test_count_ignores_foreign_taints_and_this_node():
    nodes = [node("a", tainted=True, key="other.io/x"), node("me", tainted=True), node("b", tainted=True)]
    count = count_budget(nodes, KEY, "me", 0.5, None)
    assert count.tainted == ("b",)


def test_newest_past_the_limit_rolls_back():
    nodes = [node("a", True, "2024-05-01T10:00:00Z"), node("b", True, "2024-05-01T10:00:05Z"),
             node("c", True, "2024-05-01T10:00:03Z")]
    # limit 2: a (10:00:00) and c (10:00:03) stand, b (10:00:05) is the excess
    assert [must_roll_back(nodes, KEY, n, 2) for n in ("a", "b", "c")] == [False, True, False]
    assert not any(must_roll_back(nodes, KEY, n, 3) for n in ("a", "b", "c"))


def test_ties_break_by_name_and_a_taint_without_time_is_oldest():
    nodes = [node("z", True, "2024-05-01T10:00:00Z"), node("y", True, "2024-05-01T10:00:00Z"),
             node("old", True, added=None)]
    assert [must_roll_back(nodes, KEY, n, 2) for n in ("old", "y", "z")] == [False, False, True]


def test_late_older_peers_are_only_unseen_decisions_not_newer_than_this_one():
    own = parse_rfc3339("2024-05-01T10:00:05Z")
    nodes = [node("seen", True, "2024-05-01T10:00:00Z"), node("late-older", True, "2024-05-01T10:00:04Z"),
             node("late-same", True, "2024-05-01T10:00:05Z"), node("late-newer", True, "2024-05-01T10:00:09Z"),
             node("by-hand", True, added=None), node("clean"), node("me", True, "2024-05-01T10:00:05Z")]
    assert late_older_peers(nodes, KEY, "me", {"seen"}, own) == ["late-older", "late-same"]


def test_recheck_delay_spreads_agents_over_a_whole_interval_around_the_base():
    delays = [recheck_delay(30.0, random.Random(seed)) for seed in range(200)]
    assert all(15.0 <= d <= 45.0 for d in delays)
    assert min(delays) < 17.0 and max(delays) > 43.0  # the whole window is used
    assert 27.0 < sum(delays) / len(delays) < 33.0  # on average still every 30 s
    assert len(set(delays)) == len(delays)


def test_waiting_counts_the_blocked_nodes_by_their_label_this_one_included():
    def labelled(name, health, tainted=False):
        n = node(name, tainted=tainted)
        n["metadata"]["labels"] = {"healthagent.io/health": health}
        return n

    nodes = [labelled("a", "replace-required"), labelled("b", "reboot-required"),
             labelled("c", "replace-required", tainted=True), labelled("d", "degraded"),
             labelled("e", "healthy"), node("f"), labelled("me", "replace-required")]
    count = count_budget(nodes, KEY, "me", 0.10, None)
    assert count.waiting == 3  # a, b and this node; c has its taint, d/e/f need no node action
    assert count_budget([node("me")], KEY, "me", 0.10, None).waiting == 1


@pytest.mark.parametrize("waiting,interval", [(1, 30.0), (30, 30.0), (45, 45.0), (1800, 1800.0)])
def test_recheck_interval_keeps_the_fleet_near_one_count_a_second(waiting, interval):
    assert recheck_interval(30.0, waiting) == interval
    assert waiting / recheck_interval(30.0, waiting) <= max(1.0, waiting / 30.0)
