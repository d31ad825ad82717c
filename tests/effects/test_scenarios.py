"""The effects' promises, each scenario one test body run against the fake API server AND a real
kube-apiserver + etcd (``cluster`` is parametrised; the real one skips where its binaries are
absent). Where the behaviour must match, it is asserted the same way on both.

Time for the effects is the ``now`` argument; the node watch and the label churn run in real
time, so those scenarios wait on conditions with generous deadlines and assert no durations.
"""

from __future__ import annotations

import pytest

from healthagent.effects.node_desired import (
    CLEAR_ANNOTATION,
    CLEAR_HANDLED_ANNOTATION,
    HEALTH_LABEL,
    HYPERPOD_HEALTH_LABEL,
)
from healthagent.effects.api_time import rfc3339
from healthagent.model import Action, Finding, Verdict
from tests.effects.helpers import TAINT_KEY, T0, Wakes, cleared_by, settings_for, start_effects, wait_for
from tests.support.clusters import NOT_READY, READY, FakeCluster, LabelChurn, RealCluster

pytestmark = pytest.mark.integration

XID94_LINE = "NVRM: Xid (PCI:0000:53:00): 94, pid=4242, name=python, Contained ECC error"
XID79_LINE = "NVRM: Xid (PCI:0000:29:00): 79, pid=0, name=(null), GPU has fallen off the bus."
FOREIGN_TAINT = {"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"}
FOREIGN_CONDITION = {"type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure",
                     "message": "kubelet has no disk pressure", "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                     "lastTransitionTime": "2026-01-01T00:00:00Z"}


def xid_finding(xid: int, action: Action, pci: str, line: str) -> Finding:
    return Finding(code="GPU_XID", action=action, summary=f"XID {xid} on GPU {pci}", evidence=line,
                   next_steps="see the runbook", pci_bus_id=pci, xids=(xid,), first_seen=T0, last_seen=T0)


XID94 = Verdict.of([xid_finding(94, Action.REPLACE_NODE, "0000:53:00.0", XID94_LINE)], T0)
XID79 = Verdict.of([xid_finding(79, Action.REBOOT_NODE, "0000:29:00.0", XID79_LINE)], T0)
HEALTHY = Verdict.of([], T0)


@pytest.fixture(params=["fake", "real"])
def cluster(request, fake_or_none, unique_name):
    if request.param == "fake":
        made = FakeCluster(fake_or_none)
    else:
        plane = request.getfixturevalue("control_plane")
        made = RealCluster(plane, unique_name("scn") + "-")
    made.seed(10)  # 10% of 10 GPU nodes: the budget allows one
    made.count_gpu_nodes()
    yield made
    made.close()


@pytest.fixture
def fake_or_none(request):
    """The fake server, started only for the fake side of a scenario."""
    if "[fake" not in request.node.name:
        yield None
        return
    from tests.support.kubefake import KubeFake

    with KubeFake() as server:
        yield server


def effects_for(tmp_path, cluster, node=None, watch=False, **overrides):
    node = node or cluster.name(0)
    overrides.setdefault("budget_namespace", cluster.budget_namespace)
    settings = settings_for(tmp_path / node, node, budget_node_selector=cluster.budget_selector, **overrides)
    kwargs = {}
    wakes = None
    if watch:
        wakes = Wakes()
        kwargs = dict(watch=True, on_change=wakes, watch_backoff=(0.05, 0.5))
    effects = start_effects(settings, cluster, **kwargs)
    effects.startup(T0 - 1, "boot-1")
    return effects, wakes


def ours(node: dict) -> list[dict]:
    return [t for t in (node.get("spec") or {}).get("taints") or [] if t["key"] == TAINT_KEY]


def foreign(node: dict) -> list[dict]:
    return [t for t in (node.get("spec") or {}).get("taints") or [] if t["key"] != TAINT_KEY]


def condition(node: dict, ctype: str) -> dict:
    return next(c for c in node["status"]["conditions"] if c["type"] == ctype)


def events_about(cluster, name: str) -> list[dict]:
    return [e for e in cluster.events() if e["regarding"]["name"] == name]


def no_internal_errors(effects) -> None:
    assert effects.errors == {}, effects.errors


def test_xid94_noschedule_then_noexecute_after_the_grace_with_conditions_and_one_event(tmp_path, cluster):
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster)
    status = effects.reconcile(XID94, T0, "boot-1")
    node = cluster.node(name)
    assert ours(node) == [{"key": TAINT_KEY, "value": "replace_node", "effect": "NoSchedule",
                           "timeAdded": rfc3339(T0)}]
    assert foreign(node) == [NOT_READY]  # admission's taint (the fake adds the same) is kept
    assert node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    gpu, efa = condition(node, "GpuHealthy"), condition(node, "NetworkHealthy")
    assert (gpu["status"], gpu["reason"]) == ("False", "GPU_XID") and XID94_LINE in gpu["message"]
    assert gpu["lastTransitionTime"] == gpu["lastHeartbeatTime"] == rfc3339(T0)
    assert (efa["status"], efa["reason"]) == ("True", "AllChecksPassed")
    (event,) = events_about(cluster, name)
    assert (event["type"], event["reason"], event["action"]) == ("Warning", "GPU_XID", "Detected")
    assert event["regarding"]["uid"] == node["metadata"]["uid"] and XID94_LINE in event["note"]
    assert status.pending_writes == 0 and status.taint_effect == "NoSchedule"

    assert effects.reconcile(XID94, T0 + 119, "boot-1").taint_effect == "NoSchedule"
    status = effects.reconcile(XID94, T0 + 120, "boot-1")
    node = cluster.node(name)
    assert status.taint_effect == "NoExecute" and [t["effect"] for t in ours(node)] == ["NoExecute"]
    assert foreign(node) == [NOT_READY]
    assert condition(node, "GpuHealthy")["lastTransitionTime"] == rfc3339(T0)  # no flip, no transition
    assert len(events_about(cluster, name)) == 1
    no_internal_errors(effects)


def test_foreign_taints_labels_annotations_and_conditions_are_untouched_and_in_order(tmp_path, cluster):
    name = cluster.name(0)

    def foreign_state(node):
        node["spec"]["taints"] = [dict(NOT_READY), dict(FOREIGN_TAINT)]
        node["metadata"]["labels"]["team"] = "llm"
        node["metadata"].setdefault("annotations", {})["example.com/owner"] = "infra"
        node["status"]["conditions"].append(dict(FOREIGN_CONDITION))

    cluster.update_node(name, foreign_state)
    before = cluster.node(name)
    effects, _ = effects_for(tmp_path, cluster)
    effects.reconcile(XID79, T0, "boot-1")
    tainted = cluster.node(name)
    assert [t["key"] for t in tainted["spec"]["taints"]] == [NOT_READY["key"], FOREIGN_TAINT["key"], TAINT_KEY]
    effects.reconcile(HEALTHY, T0 + 60, "boot-1")  # the reboot finding is gone: the taint goes
    after = cluster.node(name)
    assert after["spec"]["taints"] == before["spec"]["taints"]
    assert after["metadata"]["labels"]["team"] == "llm"
    assert after["metadata"]["annotations"]["example.com/owner"] == "infra"
    theirs = [c for c in after["status"]["conditions"] if c["type"] not in ("GpuHealthy", "NetworkHealthy")]
    assert theirs == before["status"]["conditions"] == [READY, FOREIGN_CONDITION]
    no_internal_errors(effects)


def test_conditions_transition_only_when_their_status_flips(tmp_path, cluster):
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster)
    effects.reconcile(XID79, T0, "boot-1")
    worse = Verdict.of([xid_finding(79, Action.REBOOT_NODE, "0000:29:00.0", XID79_LINE),
                        xid_finding(79, Action.REBOOT_NODE, "0000:53:00.0", XID79_LINE.replace("29", "53"))], T0 + 30)
    effects.reconcile(worse, T0 + 30, "boot-1")
    gpu = condition(cluster.node(name), "GpuHealthy")
    assert gpu["status"] == "False" and gpu["lastTransitionTime"] == rfc3339(T0)
    assert gpu["lastHeartbeatTime"] == rfc3339(T0 + 30)  # rewritten: the message changed
    effects.reconcile(HEALTHY, T0 + 60, "boot-1")
    node = cluster.node(name)
    gpu = condition(node, "GpuHealthy")
    assert (gpu["status"], gpu["lastTransitionTime"]) == ("True", rfc3339(T0 + 60))
    assert condition(node, "NetworkHealthy")["lastTransitionTime"] == rfc3339(T0)  # never flipped
    assert ours(node) == [] and node["metadata"]["labels"][HEALTH_LABEL] == "healthy"
    assert [e["reason"] for e in events_about(cluster, name)].count("Cleared") == 1


def test_operator_clear_by_annotation(tmp_path, cluster):
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster)
    effects.reconcile(XID94, T0, "boot-1")
    cluster.update_node(name, lambda n: n["metadata"].setdefault("annotations", {}).update({CLEAR_ANNOTATION: "ticket-42"}))
    held = effects.reconcile(XID94, T0 + 200, "boot-1")  # seen; policy has not accounted for it yet
    assert held.clear_pending == "ticket-42" and len(ours(cluster.node(name))) == 1
    status = effects.reconcile(cleared_by("ticket-42"), T0 + 201, "boot-1")
    node = cluster.node(name)
    assert ours(node) == [] and foreign(node) == [NOT_READY]
    assert node["metadata"]["annotations"][CLEAR_HANDLED_ANNOTATION] == "ticket-42"
    assert node["metadata"]["labels"][HEALTH_LABEL] == "healthy"
    assert status.clear_pending == ""
    assert [e["reason"] for e in events_about(cluster, name)] .count("Cleared") == 1
    # the same verdict again: nothing is written
    assert effects.reconcile(cleared_by("ticket-42"), T0 + 210, "boot-1").pending_writes == 0
    assert ours(cluster.node(name)) == []
    no_internal_errors(effects)


def test_operator_clear_by_removing_the_taint_by_hand(tmp_path, cluster):
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster)
    effects.reconcile(XID94, T0, "boot-1")
    cluster.update_node(name, lambda n: n["spec"].update(taints=[t for t in n["spec"]["taints"] if t["key"] != TAINT_KEY]))
    status = effects.reconcile(XID94, T0 + 61, "boot-1")  # past the resync: the node is read again
    token = status.clear_pending
    assert token.startswith("taint-removed-")
    assert cluster.node(name)["metadata"]["annotations"][CLEAR_ANNOTATION] == token  # a node fact now
    assert ours(cluster.node(name)) == [] and foreign(cluster.node(name)) == [NOT_READY]
    effects.reconcile(XID94, T0 + 62, "boot-1")
    assert ours(cluster.node(name)) == []  # not put back while policy has not accounted for it
    effects.reconcile(cleared_by(token), T0 + 200, "boot-1")
    assert ours(cluster.node(name)) == [] and cluster.node(name)["metadata"]["annotations"][
        CLEAR_HANDLED_ANNOTATION] == token
    no_internal_errors(effects)


def test_past_the_budget_a_node_is_held_at_noschedule_and_goes_out_once_a_slot_frees(tmp_path, cluster):
    """Ten GPU nodes at 10%: one slot. The second faulty node gets NoSchedule at once (new pods stay
    off), says it is held, and takes neither NoExecute nor HyperPod's replacement value until the
    first node is cleared and gives its slot back."""
    first_name, second_name = cluster.name(0), cluster.name(1)
    first, _ = effects_for(tmp_path, cluster, hyperpod_labels=True)
    second, _ = effects_for(tmp_path, cluster, node=second_name, hyperpod_labels=True)
    assert not first.reconcile(XID94, T0, "boot-1").budget_blocked
    status = second.reconcile(XID94, T0, "boot-1")
    node = cluster.node(second_name)
    assert status.budget_blocked and [(t["value"], t["effect"]) for t in ours(node)] == [
        ("replace_node", "NoSchedule")]
    assert foreign(node) == [NOT_READY] and node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    (held,) = [e for e in events_about(cluster, second_name) if e["reason"] == "TaintBlockedByBudget"]
    assert "NoSchedule" in held["note"] and "slots_held=1 limit=1 gpu_nodes=10" in held["note"]
    # the grace is over: the slot holder goes out, the held node stays where it is
    first.reconcile(XID94, T0 + 120, "boot-1")
    status = second.reconcile(XID94, T0 + 120, "boot-1")
    out, waiting = cluster.node(first_name), cluster.node(second_name)
    assert [t["effect"] for t in ours(out)] == ["NoExecute"]
    assert out["metadata"]["labels"][HYPERPOD_HEALTH_LABEL] == "UnschedulablePendingReplacement"
    assert [t["effect"] for t in ours(waiting)] == ["NoSchedule"] and status.budget_blocked
    assert HYPERPOD_HEALTH_LABEL not in waiting["metadata"]["labels"]  # nothing that starts a replacement
    # the first node is replaced and cleared: its slot goes back, the held node takes it at its next look
    cluster.update_node(first_name, lambda n: n["metadata"].setdefault("annotations", {}).update(
        {CLEAR_ANNOTATION: "replaced"}))
    first.reconcile(cleared_by("replaced"), T0 + 181, "boot-1")
    assert ours(cluster.node(first_name)) == []
    status = second.reconcile(XID94, max(second.budget_recheck_at, T0 + 181), "boot-1")
    node = cluster.node(second_name)
    assert not status.budget_blocked and [t["effect"] for t in ours(node)] == ["NoExecute"]
    assert node["metadata"]["labels"][HYPERPOD_HEALTH_LABEL] == "UnschedulablePendingReplacement"
    no_internal_errors(first)
    no_internal_errors(second)


def test_api_server_restarted_mid_fault_nothing_lost_nothing_written_twice(tmp_path, cluster):
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster, watch=True)
    try:
        wait_for(lambda: effects.watching, what="the watch")
        effects.reconcile(XID94, T0, "boot-1")
        assert [t["effect"] for t in ours(cluster.node(name))] == ["NoSchedule"]
        cluster.restart_apiserver()
        # the NoExecute step falls due while the watch recovers: it lands once, on the new server
        wait_for(lambda: effects.reconcile(XID94, T0 + 120, "boot-1").pending_writes == 0 and effects.watching,
                 timeout=120, what="the write and the watch after the restart", interval=0.2)
        node = cluster.node(name)
        assert [(t["value"], t["effect"]) for t in ours(node)] == [("replace_node", "NoExecute")]
        assert foreign(node) == [NOT_READY]
        assert len(events_about(cluster, name)) == 1  # the Event was not sent again
        # the watch was cut, and could not resume where it was: 410 Gone (the restarted server's
        # new watch cache starts past the agent's version; the fake forgot its history)
        assert effects.api_errors.get("watch_unavailable", 0) >= 1
        assert effects.api_errors.get("watch_expired", 0) >= 1
        no_internal_errors(effects)
        writes = dict(effects.status().writes)
        assert effects.reconcile(XID94, T0 + 130, "boot-1").writes == writes  # steady again: no write
    finally:
        effects.close()


def test_a_deleted_and_recreated_node_gets_the_taint_again(tmp_path, cluster):
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster, watch=True)
    try:
        effects.reconcile(XID94, T0, "boot-1")
        old_uid = cluster.node(name)["metadata"]["uid"]
        cluster.delete_node(name)
        wait_for(lambda: effects.node is None, what="the watch to see the deletion")
        status = effects.reconcile(XID94, T0 + 61, "boot-1")
        assert status.pending_writes > 0  # nothing to write to: the desired state is kept
        assert effects.api_errors.get("node_not_found") == 1
        cluster.create_node(name)
        wait_for(lambda: (effects.node or {}).get("metadata", {}).get("uid") not in (None, old_uid),
                 what="the watch to see the new Node object")
        effects.reconcile(XID94, T0 + 130, "boot-1")
        node = cluster.node(name)
        assert node["metadata"]["uid"] != old_uid
        assert [t["value"] for t in ours(node)] == ["replace_node"] and foreign(node) == [NOT_READY]
        assert condition(node, "GpuHealthy")["status"] == "False"
        no_internal_errors(effects)  # a node that went away is the API's condition, not a fault
    finally:
        effects.close()


def test_a_second_writer_churning_labels_never_delays_the_taint_or_the_clear(tmp_path, cluster):
    """Another controller patches the node's labels ~100 times a second while the agent taints
    and then clears: the agent's writes pin only what they replace, so none conflicts and each
    lands in the reconcile that wants it."""
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster, watch=True)
    try:
        with LabelChurn(cluster, name, rate=100.0) as churn:
            wait_for(lambda: churn.writes >= 50, what="the churn to run")
            status = effects.reconcile(XID94, T0, "boot-1")
            assert status.pending_writes == 0 and [t["value"] for t in ours(cluster.node(name))] == ["replace_node"]
            cluster.update_node(name, lambda n: n["metadata"].setdefault("annotations", {})
                                .update({CLEAR_ANNOTATION: "after-repair"}))
            wait_for(lambda: effects.pending_clear() == "after-repair", what="the clear", interval=0.05)
            effects.reconcile(cleared_by("after-repair"), T0 + 10, "boot-1")
            assert ours(cluster.node(name)) == [] and effects.status().pending_writes == 0
            writes_during = churn.writes
        assert churn.errors == [] and writes_during >= 50
        assert all(result != "conflict" for (_, result) in effects.status().writes), effects.status().writes
        assert "conflicts_exhausted" not in effects.api_errors
        no_internal_errors(effects)
    finally:
        effects.close()
