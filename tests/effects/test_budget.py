"""The budget rule and the shape of its slots, as pure functions (no API server)."""

import random

import pytest

from healthagent.effects.budget import (
    COUNT_LEASE,
    GPU_NODES_ANNOTATION,
    SELECTOR_ANNOTATION,
    budget_limit,
    counted,
    held_lease,
    new_lease,
    read_view,
    recheck_delay,
    recheck_interval,
    released_lease,
    slot_index,
    slot_name,
)
from healthagent.effects.events import micro_time

T0 = 1_700_000_000.0
SELECTOR = "nvidia.com/gpu.present=true"


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


def test_recheck_delay_spreads_agents_over_a_whole_interval_around_the_base():
    delays = [recheck_delay(30.0, random.Random(seed)) for seed in range(200)]
    assert all(15.0 <= d <= 45.0 for d in delays)
    assert min(delays) < 17.0 and max(delays) > 43.0  # the whole window is used
    assert 27.0 < sum(delays) / len(delays) < 33.0  # on average still every 30 s
    assert len(set(delays)) == len(delays)


@pytest.mark.parametrize("holds,interval", [(0, 30.0), (1, 30.0), (2, 60.0), (3, 120.0), (4, 120.0), (50, 120.0)])
def test_a_node_blocked_again_and_again_looks_less_often_up_to_four_times_the_base(holds, interval):
    assert recheck_interval(30.0, holds) == interval


@pytest.mark.parametrize("name,index", [
    ("healthagent-budget-slot-0", 0), ("healthagent-budget-slot-17", 17),
    ("healthagent-budget-slot-01", None), ("healthagent-budget-slot-", None), ("healthagent-budget-slot-x", None),
    (COUNT_LEASE, None), ("kube-scheduler", None),
])
def test_slot_names(name, index):
    assert slot_index(name) == index
    if index is not None:
        assert slot_name(index) == name


def slot(index, holder="", at=T0, version="10"):
    lease = new_lease(slot_name(index), "healthagent", "slot")
    lease["metadata"]["resourceVersion"] = version
    return held_lease(lease, holder, at, acquired=True) if holder else lease


def count_lease(nodes, at=T0, selector=SELECTOR, version="20"):
    lease = new_lease(COUNT_LEASE, "healthagent", "count")
    lease["metadata"]["resourceVersion"] = version
    body = counted(lease, nodes, selector, at)
    body["spec"]["holderIdentity"] = "healthagent-budget-counter"
    return body


def view(*leases, fraction=0.10, max_nodes=None):
    return read_view(list(leases), SELECTOR, fraction, max_nodes)


def test_the_view_reads_holders_times_versions_and_the_shared_count():
    seen = view(slot(1, "gpu-a", T0 - 5, "11"), slot(0), count_lease(40), fraction=0.10)
    assert [(s.index, s.holder, s.since, s.version) for s in seen.slots] == [
        (0, "", None, "10"), (1, "gpu-a", pytest.approx(T0 - 5), "11")]
    assert (seen.count.nodes, seen.limit, [s.index for s in seen.held]) == (40, 4, [1])
    assert seen.held_by("gpu-a")[0].index == 1 and seen.held_by("gpu-b") == ()
    assert seen.allows and seen.free_indexes() == [0, 2, 3]  # 2 and 3 not created yet: free too
    assert seen.describe() == "slots_held=1 limit=4 gpu_nodes=40"


@pytest.mark.parametrize("leases,max_nodes,limit", [
    ((), None, 1),  # never counted: the smallest limit there is
    ((), 0, 0),
    ((count_lease(40, selector="other=selector"),), None, 1),  # counted for another selector: no count
    ((count_lease(40),), 2, 2),
    ((count_lease(40),), None, 4),
])
def test_the_limit_comes_from_the_shared_count_or_is_the_smallest(leases, max_nodes, limit):
    assert view(*leases, max_nodes=max_nodes).limit == limit


def test_holders_past_a_limit_that_shrank_still_count():
    """8 slots held from when the fleet was larger; the limit is now 4: no room, no free index."""
    seen = view(*[slot(i, f"gpu-{i}") for i in range(8)], count_lease(40))
    assert seen.limit == 4 and not seen.allows and seen.free_indexes() == []
    seen = view(slot(0, "gpu-0"), slot(6, "gpu-6"), count_lease(40))
    assert seen.allows and seen.free_indexes() == [1, 2, 3]


def test_lease_bodies_keep_the_version_read_as_their_precondition():
    held = held_lease(slot(2, "gpu-a", T0 - 100, "33"), "gpu-b", T0, acquired=True)
    assert held["metadata"]["resourceVersion"] == "33"
    assert held["spec"] == {"holderIdentity": "gpu-b", "acquireTime": micro_time(T0), "renewTime": micro_time(T0)}
    again = held_lease(held, "gpu-b", T0 + 7, acquired=False)
    assert (again["spec"]["acquireTime"], again["spec"]["renewTime"]) == (micro_time(T0), micro_time(T0 + 7))
    given_back = released_lease({**held, "metadata": {**held["metadata"], "managedFields": [{"manager": "x"}]}})
    assert given_back["spec"] == {} and given_back["metadata"]["resourceVersion"] == "33"
    assert "managedFields" not in given_back["metadata"]
    assert held["spec"]["holderIdentity"] == "gpu-b"  # the input is not changed


def test_the_count_lease_records_nodes_selector_and_time():
    lease = count_lease(1234, at=T0)
    annotations = lease["metadata"]["annotations"]
    assert (annotations[GPU_NODES_ANNOTATION], annotations[SELECTOR_ANNOTATION]) == ("1234", SELECTOR)
    assert lease["spec"]["renewTime"] == micro_time(T0) and lease["spec"]["holderIdentity"] == "healthagent-budget-counter"
    assert lease["metadata"]["labels"]["healthagent.io/budget"] == "count"


@pytest.mark.parametrize("value,ok", [("", True), ("healthagent", True), ("gpu-health-2", True),
                                      ("Healthagent", False), ("health_agent", False), ("-x", False),
                                      ("a" * 64, False)])
def test_the_budget_namespace_setting_is_a_namespace_name_or_empty(tmp_path, value, ok):
    from healthagent.config import ConfigError, load_settings

    env = {"HEALTHAGENT_BUDGET_NAMESPACE": value, "HEALTHAGENT_STATE_FILE": str(tmp_path / "state.json")}
    if ok:
        assert load_settings(env=env).budget_namespace == value
    else:
        with pytest.raises(ConfigError, match=r"^budget_namespace: .* is not a namespace name; use a namespace name"):
            load_settings(env=env)


def test_the_budget_lives_in_the_service_accounts_namespace_unless_set(tmp_path):
    from healthagent.effects.budget_leases import DEFAULT_NAMESPACE, agent_namespace

    account = tmp_path / "namespace"
    assert agent_namespace("", account) == DEFAULT_NAMESPACE  # outside a pod
    account.write_text("gpu-health\n")
    assert agent_namespace("", account) == "gpu-health"
    assert agent_namespace("budget-test", account) == "budget-test"
