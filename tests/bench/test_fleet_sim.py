"""The fleet simulator's small preset (``bench/bench_fleet.py --preset small``) as a test of
behaviour: 60 realistic GPU nodes on a real kube-apiserver + etcd of its own (the scenario
restarts it), 30 agents' effects in full under the admission policies with their nodes'
identities, the other 30 nodes' watches. Through every scenario (a burst over seconds, a burst in
one second, operator clears) the budget is never exceeded as a watch counts it, every faulty node
is tainted, every cleared one is clean, a budget decision costs the API server at most 20 kB
whatever the fleet's size, and the agents' requests go through their own FlowSchema. The bench's
API server restart (about 20 s for a fresh server to be ready here) runs in the bench only; a
restart mid-fault is tested in tests/effects/test_scenarios.py, a refused watch's retry in
tests/effects/test_watch_retry.py. Times are printed by the bench, never asserted here."""

from __future__ import annotations

import pytest

from tests.support.deploy import kubectl_binary
from tests.support.envtest import find_assets, missing_reason

pytestmark = pytest.mark.integration


def test_the_small_fleet_keeps_its_budget_taints_every_faulty_node_and_decides_in_o1_bytes():
    if find_assets() is None:
        pytest.skip(missing_reason())
    if kubectl_binary() is None:
        pytest.skip("no kubectl to render the generic overlay (pip install -e '.[test]')")
    from bench.bench_fleet import BYTES_PER_DECISION_BOUND, run

    setup, results = run("small", restart=False)
    preset = setup["preset"]
    assert setup["agents_watching"] == preset["agents"]
    assert setup["agents_watching_at_end"] == preset["agents"]
    assert setup["dispatched_in_level"] > 0  # the agents' requests went through their own FlowSchema
    assert setup["passive_watches_live"] == preset["nodes"] - preset["agents"]
    assert setup["gpu_nodes_counted"] == preset["nodes"]  # the counter's identity may write the count
    bursts = [r for r in results if r.faults and not r.cleared and r.name != "steady state"]
    clears = [r for r in results if r.cleared or "clear" in r.name]
    assert len(bursts) == 2 and len(clears) == 2
    for result in results:
        assert result.most_noexecute <= preset["limit"], result.name  # never past the limit
    for burst in bursts:
        assert burst.tainted == burst.faults == preset["faults"], burst.name
        assert burst.decisions > 0, burst.name
        assert burst.bytes_per_decision <= BYTES_PER_DECISION_BOUND, burst.name
        assert len(burst.to_noexecute) >= preset["limit"], burst.name  # the slot holders went out
    for clear in clears:
        assert clear.cleared == clear.faults > 0, clear.name
