"""The API server misbehaves while a node goes bad: down, slow, 500s, 409 storms, watch streams cut.

In each case the agent (``AgentRuntime`` on the demo node, XID 95 appended to its kernel log) must
keep detecting without waiting for the API server, must not crash, and once the server behaves
must leave exactly one taint and one Event on the node, with the metrics telling the story
(``kube_reachable``, ``kube_pending_writes``, ``kube_writes_total{kind,result}``).
"""

from __future__ import annotations

import pytest

from tests.reliability.helpers import (
    NODE,
    TAINT_KEY,
    alive,
    events_by_reason,
    our_taints,
    scrape,
    wait_metric,
    wait_warm,
)
from tests.support.live_agent import taint_write, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

REPLACE = [("replace_node", "NoSchedule")]  # default grace: NoSchedule first, NoExecute after 120 s


def replace_decided(s) -> bool:
    return s.value("healthagent_node_action", action="replace_node") == 1


def settled(fake, runtime) -> None:
    """One taint and one GPU_XID Event on the node, and the agent says nothing is pending."""
    wait_until(lambda: our_taints(fake) == REPLACE, what="the replace_node taint")
    wait_until(lambda: events_by_reason(fake).get("GPU_XID") == 1, what="the GPU_XID Event")
    wait_metric(runtime, lambda s: s.value("healthagent_kube_pending_writes") == 0
                and s.value("healthagent_kube_reachable") == 1, "nothing pending")


def assert_exactly_one_taint_and_event(fake, budget_unreadable: bool = False) -> None:
    """``budget_unreadable``: the budget's Leases may have been unreadable (a request timed out),
    and then the agent says so in one Event of its own, naming the cause, beside the finding's."""
    taints = fake.node(NODE)["spec"]["taints"]
    assert [t for t in taints if t["key"] == TAINT_KEY] == [
        {"key": TAINT_KEY, "value": "replace_node", "effect": "NoSchedule", "timeAdded": taints[0]["timeAdded"]}]
    delivered = fake.events()  # one read: an Event landing between two reads must not split them
    events: dict[str, int] = {}
    for event in delivered:
        events[event["reason"]] = events.get(event["reason"], 0) + 1
    blocked = [e for e in delivered if e["reason"] == "TaintBlockedByBudget"]
    if budget_unreadable and blocked:
        assert len(blocked) == 1 and "could not be read or written" in blocked[0]["note"]
        events.pop("TaintBlockedByBudget")
    assert events == {"GPU_XID": 1}


def xid_while(misbehave, fake, demo, start_agent):
    """A warm agent; the API server starts to misbehave; XID 95 lands in the kernel log."""
    runtime = start_agent()
    wait_warm(runtime)
    fake.reset_log()
    misbehave()
    demo.inject_xid(3, 95)
    return runtime


def recovered(fake, runtime, budget_unreadable: bool = False) -> None:
    """Once the server behaves: exactly one taint and one Event, nothing pending, nothing crashed."""
    settled(fake, runtime)
    assert_exactly_one_taint_and_event(fake, budget_unreadable)
    assert alive(runtime)


def test_api_server_down_when_the_fault_comes(fake, demo, start_agent):
    runtime = xid_while(fake.go_down, fake, demo, start_agent)
    down = wait_metric(runtime, lambda s: replace_decided(s) and s.value("healthagent_kube_reachable") == 0
                       and s.value("healthagent_kube_pending_writes") >= 1, "the outage in the metrics")
    assert our_taints(fake) == [] and fake.events() == []  # nothing reached the server
    assert down.value("healthagent_node_taint_applied") == 0

    fake.come_up()
    recovered(fake, runtime)
    after = scrape(runtime)
    assert after.value("healthagent_node_taint_applied") == 1
    assert after.value("healthagent_kube_writes_total", kind="node", result="ok") >= 1


def test_api_server_answering_after_10_seconds(fake, demo, start_agent):
    runtime = xid_while(lambda: fake.set_delay(10.0), fake, demo, start_agent)
    # The verdict is out while the first request to the server has not even been answered:
    # detection does not wait for Kubernetes.
    wait_metric(runtime, replace_decided, "the verdict", timeout=30)
    assert fake.requests() == [] and our_taints(fake) == []
    wait_until(lambda: fake.requests(), timeout=60, what="a request answered after the delay")
    fake.set_delay(0.0)
    # the first request may be the budget's Lease read, which times out (10 s) before its answer
    recovered(fake, runtime, budget_unreadable=True)


def test_500s_from_the_api_server(fake, demo, start_agent):
    # the next three requests, whatever they are, get 500 Internal Error
    runtime = xid_while(lambda: fake.fail_next(3), fake, demo, start_agent)
    wait_until(lambda: [r.status for r in fake.requests()].count(500) == 3, what="the three 500s answered")
    assert replace_decided(scrape(runtime))
    recovered(fake, runtime)  # whichever requests the 500s hit (budget Leases, node, Event), the taint lands
    assert [r.status for r in fake.requests()].count(500) == 3
    errors = scrape(runtime).total("healthagent_kube_writes_total", result="error")
    assert errors <= 3  # the 500s that hit writes; the others hit the budget's Lease reads


def test_a_500_on_the_taint_write_itself(fake, demo, start_agent):
    holds = []
    runtime = xid_while(lambda: holds.append(fake.hold(taint_write(TAINT_KEY))), fake, demo, start_agent)
    assert holds[0].arrived.wait(60)
    holds[0].release(apply=False)  # answered 500, not stored
    wait_metric(runtime, lambda s: s.value("healthagent_kube_writes_total", kind="node", result="error") == 1,
                "the failed write counted")
    recovered(fake, runtime)


def test_409_storm_on_the_node(fake, demo, start_agent):
    # more 409s than one reconcile's attempts (6): the next reconcile must come back for the write
    runtime = xid_while(lambda: fake.conflict_next_writes(10), fake, demo, start_agent)
    # the 409s may hit the budget slot's writes too: then the agent says so, once, naming the cause
    recovered(fake, runtime, budget_unreadable=True)

    def conflicts(path: str) -> int:
        return len([r for r in fake.writes(path) if r.status == 409])

    node = conflicts(f"/api/v1/nodes/{NODE}") - conflicts(f"/api/v1/nodes/{NODE}/status")
    status = conflicts(f"/api/v1/nodes/{NODE}/status")
    leases = conflicts("/apis/coordination.k8s.io/")
    # The first write after the XID is the node's (a slot is created, never PUT, before it), and a
    # conflict ends its reconcile: the next one starts at once and may meet the rest of the storm on
    # the node again, its status, or the budget slot's re-write. Every 409 is one answered request.
    assert (node + status + leases, node >= 1) == (10, True)
    # The metrics are the loop's snapshot, published each cycle: wait for the one with the counts.
    wait_metric(runtime, lambda s: s.value("healthagent_kube_writes_total", kind="node", result="conflict") == node
                and s.value("healthagent_kube_writes_total", kind="node_status", result="conflict") == status,
                "the conflicts counted")


def watch_requests(fake) -> int:
    return len([r for r in fake.requests("GET", "/api/v1/nodes") if r.query.get("watch") in ("true", "1")])


def test_watch_streams_cut_while_an_operator_clears_the_node(fake, demo, start_agent):
    from healthagent.effects.node_desired import CLEAR_ANNOTATION

    runtime = xid_while(lambda: None, fake, demo, start_agent)
    settled(fake, runtime)
    for _ in range(3):  # the API server cuts the agent's watch, again and again (a rolling upgrade)
        opened = watch_requests(fake)
        fake.drop_watches()
        wait_until(lambda: watch_requests(fake) > opened, timeout=90, what="the watch opened again")
    # Only now does the operator act: the agent must hear of it through the new watch.
    fake.update_node(NODE, lambda node: node["metadata"]["annotations"].update({CLEAR_ANNOTATION: "ticket-4711"}))
    wait_until(lambda: our_taints(fake) == [], timeout=90, what="the taint removed after the clear")
    cleared = wait_metric(runtime, lambda s: s.value("healthagent_node_action", action="none") == 1
                          and s.value("healthagent_node_taint_applied") == 0, "the clear in the metrics")
    assert cleared.total("healthagent_findings") == 0
    wait_until(lambda: events_by_reason(fake).get("Cleared") == 1, what="the Cleared Event")
    assert events_by_reason(fake) == {"GPU_XID": 1, "Cleared": 1}
    taint_adds = [r for r in fake.writes(f"/api/v1/nodes/{NODE}") if r.status == 200
                  and taint_write(TAINT_KEY)(r.method, r.path, r.body)]
    assert len(taint_adds) == 1  # the watch's replays never made the agent taint again
    assert alive(runtime)


def test_a_taint_removal_answered_504_that_landed_is_the_agents_own(fake, demo, start_agent):
    """An operator clears the node; the agent's write that removes its taint lands but is answered
    504 (the API server's deadline passed first). At its next read the taint is gone: the agent's
    own removal, not a second operator's clear (which would close what opened since)."""
    import re

    from healthagent.effects.node_desired import CLEAR_ANNOTATION

    runtime = xid_while(lambda: None, fake, demo, start_agent)
    settled(fake, runtime)
    hold = fake.hold(lambda method, path, body: method == "PATCH" and bool(re.fullmatch(r"/api/v1/nodes/[^/]+", path)))
    fake.update_node(NODE, lambda node: node["metadata"]["annotations"].update({CLEAR_ANNOTATION: "ticket-504"}))
    assert hold.arrived.wait(60)
    hold.release(apply=True, answer=504)
    wait_until(lambda: our_taints(fake) == [], timeout=90, what="the taint removed after the clear")
    wait_until(lambda: events_by_reason(fake).get("Cleared") == 1, what="the Cleared Event")
    # the reconcile after the 504 read the node: nothing pending, the API server answering
    wait_metric(runtime, lambda s: s.value("healthagent_kube_pending_writes") == 0
                and s.value("healthagent_kube_reachable") == 1, "the reconcile after the 504")
    assert fake.node(NODE)["metadata"]["annotations"].get(CLEAR_ANNOTATION) == "ticket-504"
    assert events_by_reason(fake) == {"GPU_XID": 1, "Cleared": 1}
    assert alive(runtime)

