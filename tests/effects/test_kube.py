"""NodeEffects end to end: the real ``kubernetes`` client against the fake API server.

Time is driven through the ``now`` argument and the backoff sleep is injected, so nothing here
waits on a wall clock.
"""

import logging
import shutil
from dataclasses import replace

import pytest

from healthagent.effects.node_desired import (
    CLEAR_ANNOTATION,
    CLEAR_HANDLED_ANNOTATION,
    HEALTH_LABEL,
    HYPERPOD_FAULT_REASONS_LABEL,
    HYPERPOD_FAULT_TYPES_LABEL,
    HYPERPOD_HEALTH_LABEL,
)
from healthagent.effects.api_time import rfc3339
from healthagent.model import Action
from tests.effects.budget_helpers import count_gpu_nodes
from tests.effects.helpers import (
    HEALTHY,
    cleared_by,
    T0,
    TAINT_KEY,
    XID95,
    Sleeps,
    condition,
    finding,
    our_taints,
    settings_for,
    start_effects,
    started,
    verdict,
)

pytestmark = pytest.mark.integration

NODE = "gpu-node-0"
EVENTS = "/apis/events.k8s.io/v1/namespaces/default/events"


@pytest.fixture
def cluster(fake):
    fake.seed_nodes(20)
    count_gpu_nodes(fake)
    fake.reset_log()
    return fake


def node_writes(fake, node=NODE):
    return [r for r in fake.writes(f"/api/v1/nodes/{node}")]


def test_xid95_noschedule_then_noexecute_after_the_grace_with_labels_conditions_and_one_event(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    status = effects.reconcile(XID95, T0, "boot-1")
    node = cluster.node(NODE)
    assert our_taints(node) == [{"key": TAINT_KEY, "value": "replace_node", "effect": "NoSchedule",
                                 "timeAdded": rfc3339(T0)}]
    assert node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    gpu = condition(node, "GpuHealthy")
    assert (gpu["status"], gpu["reason"]) == ("False", "GPU_XID")
    assert "NVRM: Xid (PCI:0000:53:00): 95" in gpu["message"]
    assert gpu["lastTransitionTime"] == gpu["lastHeartbeatTime"] == rfc3339(T0)
    efa = condition(node, "NetworkHealthy")
    assert (efa["status"], efa["reason"]) == ("True", "AllChecksPassed")
    (event,) = cluster.events()
    assert (event["type"], event["reason"], event["action"]) == ("Warning", "GPU_XID", "Detected")
    assert event["regarding"]["name"] == NODE and event["regarding"]["uid"] == node["metadata"]["uid"]
    assert (event["reportingController"], event["reportingInstance"]) == ("healthagent.io/agent", NODE)
    assert "Xid (PCI:0000:53:00): 95" in event["note"]
    assert status.taint_effect == "NoSchedule" and status.reachable and status.pending_writes == 0
    assert status.writes == {("node", "ok"): 1, ("node_status", "ok"): 1, ("event", "ok"): 1}

    cluster.reset_log()
    status = effects.reconcile(XID95, T0 + 10, "boot-1")
    assert status.taint_effect == "NoSchedule" and cluster.requests() == []  # nothing due: no request at all
    effects.reconcile(XID95, T0 + 61, "boot-1")  # the resync reads the node; the budget asks nothing
    assert [(r.method, r.path) for r in cluster.requests()] == [("GET", f"/api/v1/nodes/{NODE}")]
    status = effects.reconcile(XID95, T0 + 119, "boot-1")
    assert status.taint_effect == "NoSchedule" and cluster.writes() == []
    status = effects.reconcile(XID95, T0 + 120, "boot-1")
    assert status.taint_effect == "NoExecute"
    assert [t["effect"] for t in our_taints(cluster.node(NODE))] == ["NoExecute"]
    assert len(cluster.events()) == 1
    assert [r.method for r in cluster.writes()] == ["PUT", "PATCH"]  # the slot confirmed by a write, the taint


def test_grace_zero_is_noexecute_at_once(tmp_path, cluster):
    effects = started(tmp_path, cluster, replace_noexecute_grace_seconds=0.0)
    assert effects.reconcile(XID95, T0, "boot-1").taint_effect == "NoExecute"


def test_a_second_start_on_the_same_state_and_node_writes_nothing(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    effects.reconcile(XID95, T0 + 130, "boot-1")
    cluster.reset_log()
    again = started(tmp_path, cluster)
    status = again.reconcile(XID95, T0 + 200, "boot-1")
    assert cluster.writes() == []
    assert {r.method for r in cluster.requests()} == {"GET"}
    assert status.taint_effect == "NoExecute" and status.writes == {} and status.pending_writes == 0
    assert again.reconcile(XID95, T0 + 230, "boot-1").writes == {}
    assert cluster.writes() == [] and len(cluster.events()) == 1


def test_steady_state_rereads_only_on_the_resync_interval(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")  # reads the node (no watch here)
    cluster.reset_log()
    effects.reconcile(XID95, T0 + 30, "boot-1")
    effects.reconcile(XID95, T0 + 59, "boot-1")
    assert cluster.requests() == []
    effects.reconcile(XID95, T0 + 61, "boot-1")
    assert [(r.method, r.path) for r in cluster.requests()] == [("GET", f"/api/v1/nodes/{NODE}")]


def test_reboot_taint_clears_when_healthy_again_with_a_normal_event(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    reboot = verdict(finding("GPU_ROW_REMAP_PENDING", Action.REBOOT_NODE, xids=()))
    effects.reconcile(reboot, T0, "boot-1")
    node = cluster.node(NODE)
    assert [(t["value"], t["effect"]) for t in our_taints(node)] == [("reboot_node", "NoSchedule")]
    assert node["metadata"]["labels"][HEALTH_LABEL] == "reboot-required"
    status = effects.reconcile(HEALTHY, T0 + 600, "boot-2")  # rebooted; policy dropped the finding
    node = cluster.node(NODE)
    assert our_taints(node) == [] and node["metadata"]["labels"][HEALTH_LABEL] == "healthy"
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]} == {
        "Ready": "True", "GpuHealthy": "True", "NetworkHealthy": "True"}
    assert condition(node, "GpuHealthy")["lastTransitionTime"] == rfc3339(T0 + 600)
    assert [(e["type"], e["reason"]) for e in cluster.events()] == [("Warning", "GPU_ROW_REMAP_PENDING"),
                                                                    ("Normal", "Cleared")] or \
        sorted((e["type"], e["reason"]) for e in cluster.events()) == [("Normal", "Cleared"),
                                                                       ("Warning", "GPU_ROW_REMAP_PENDING")]
    assert status.taint_effect == ""


def test_replace_taint_is_sticky_even_when_the_state_is_lost(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    effects.reconcile(HEALTHY, T0 + 10, "boot-1")  # the classifier forgot; the taint must stay
    assert [t["value"] for t in our_taints(cluster.node(NODE))] == ["replace_node"]
    shutil.rmtree(tmp_path / "state")
    fresh = start_effects(settings_for(tmp_path, NODE), cluster)
    fresh.startup(T0 + 50, "boot-2")  # first sight of the taint without a record
    fresh.reconcile(HEALTHY, T0 + 50, "boot-2")
    node = cluster.node(NODE)
    assert [(t["value"], t["effect"]) for t in our_taints(node)] == [("replace_node", "NoSchedule")]
    assert node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    gpu = condition(node, "GpuHealthy")
    assert (gpu["status"], gpu["reason"]) == ("False", "ReplacePending") and "kubectl annotate" in gpu["message"]
    # without a record the grace starts at first sight on the decision clock, and runs in full
    assert fresh.reconcile(HEALTHY, T0 + 121, "boot-2").taint_effect == "NoSchedule"
    assert fresh.reconcile(HEALTHY, T0 + 50 + 119, "boot-2").taint_effect == "NoSchedule"
    assert fresh.reconcile(HEALTHY, T0 + 50 + 120, "boot-2").taint_effect == "NoExecute"


@pytest.mark.parametrize("storm", [3, 20])
def test_conflict_storm_ends_in_the_right_state_without_duplicate_events(tmp_path, cluster, storm):
    sleeps = Sleeps()
    effects = start_effects(settings_for(tmp_path, NODE), cluster, sleeps)
    effects.startup(T0 - 1, "boot-1")
    cluster.conflict_next_writes(storm)
    status = effects.reconcile(XID95, T0, "boot-1")
    for n in range(1, 30):  # one node write a reconcile: a conflict leaves the next one due at once
        if status.pending_writes == 0:
            break
        status = effects.reconcile(XID95, T0 + n, "boot-1")
    node = cluster.node(NODE)
    assert [(t["value"], t["effect"]) for t in our_taints(node)] == [("replace_node", "NoSchedule")]
    assert condition(node, "GpuHealthy")["reason"] == "GPU_XID"
    assert len(cluster.events()) == 1 and status.pending_writes == 0
    conflicts = status.writes.get(("node", "conflict"), 0) + status.writes.get(("node_status", "conflict"), 0)
    assert conflicts == storm
    assert sleeps.delays and max(sleeps.delays) <= 3.2
    assert sleeps.delays[:3] == sorted(sleeps.delays[:3])  # exponential: each wait longer than the last


def test_5xx_keeps_the_desired_state_and_applies_it_later(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    cluster.fail_next(3)
    status = effects.reconcile(XID95, T0, "boot-1")
    assert status.pending_writes >= 1 and not status.reachable
    assert our_taints(cluster.node(NODE)) == []
    effects.reconcile(XID95, T0 + 5, "boot-1")  # the third failure: the read
    status = effects.reconcile(XID95, T0 + 10, "boot-1")
    assert status.pending_writes == 0 and status.reachable
    assert our_taints(cluster.node(NODE)) and len(cluster.events()) == 1


def test_api_down_then_up_applies_the_queued_state(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    cluster.go_down()
    status = effects.reconcile(XID95, T0, "boot-1")
    assert not status.reachable and status.pending_writes == 3  # node, status, one Event
    status = effects.reconcile(XID95, T0 + 5, "boot-1")
    assert status.pending_writes == 3
    cluster.come_up()
    status = effects.reconcile(XID95, T0 + 10, "boot-1")
    assert status.reachable and status.pending_writes == 0
    node = cluster.node(NODE)
    assert our_taints(node) and node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    assert len(cluster.events()) == 1


def test_a_slow_api_server_times_out_and_the_write_lands_later(tmp_path, cluster):
    effects = start_effects(settings_for(tmp_path, NODE), cluster, request_timeout=(1.0, 0.2))
    cluster.set_delay(0.6)
    status = effects.reconcile(XID95, T0, "boot-1")
    assert status.pending_writes >= 1 and not status.reachable
    cluster.set_delay(0)
    status = effects.reconcile(XID95, T0 + 5, "boot-1")
    assert status.pending_writes == 0 and our_taints(cluster.node(NODE))


def test_restart_with_state_saved_but_writes_not_done(tmp_path, cluster):
    first = started(tmp_path, cluster)
    cluster.go_down()
    first.reconcile(XID95, T0, "boot-1")  # decided and saved; nothing reached the node
    cluster.come_up()
    second = started(tmp_path, cluster)
    status = second.reconcile(XID95, T0 + 1, "boot-1")
    assert status.pending_writes == 0
    assert [(t["value"], t["effect"]) for t in our_taints(cluster.node(NODE))] == [("replace_node", "NoSchedule")]
    assert len(cluster.events()) == 1


def test_restart_after_the_writes_but_before_the_state_was_saved(tmp_path, cluster):
    settings = settings_for(tmp_path, NODE)
    started(tmp_path, cluster)  # an empty state file exists
    before = (tmp_path / "state" / "state.json").read_bytes()
    first = started(tmp_path, cluster)
    first.reconcile(XID95, T0, "boot-1")
    (tmp_path / "state" / "state.json").write_bytes(before)  # SIGKILL before the state write
    cluster.reset_log()
    second = start_effects(settings, cluster)
    second.startup(T0 + 5, "boot-1")
    status = second.reconcile(XID95, T0 + 5, "boot-1")
    assert node_writes(cluster) == []
    assert [(r.method, r.status) for r in cluster.requests("POST", EVENTS)] == [("POST", 409)]
    assert len(cluster.events()) == 1 and status.writes == {("event", "conflict"): 1}
    # the record was lost with the state write: the grace starts again at first sight (T0 + 5)
    assert second.reconcile(XID95, T0 + 120, "boot-1").taint_effect == "NoSchedule"
    assert second.reconcile(XID95, T0 + 125, "boot-1").taint_effect == "NoExecute"


def test_foreign_taints_labels_annotations_and_conditions_are_untouched(tmp_path, cluster):
    foreign_taints = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                      {"key": "sagemaker.amazonaws.com/node-health-status", "value": "Unschedulable",
                       "effect": "NoSchedule"}]
    npd = {"type": "KernelDeadlock", "status": "False", "reason": "KernelHasNoDeadlock", "message": "ok",
           "lastHeartbeatTime": rfc3339(T0 - 99), "lastTransitionTime": rfc3339(T0 - 999)}

    def dress(n):
        n["spec"]["taints"] = list(foreign_taints)
        n["metadata"]["labels"]["team"] = "llm"
        n["metadata"]["annotations"]["owner"] = "infra"
        n["status"]["conditions"].append(npd)

    cluster.update_node(NODE, dress)
    before = cluster.node(NODE)
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    effects.reconcile(XID95, T0 + 120, "boot-1")
    node = cluster.node(NODE)
    assert [t for t in node["spec"]["taints"] if t["key"] != TAINT_KEY] == foreign_taints
    assert node["spec"]["taints"][:2] == foreign_taints  # in place, the agent's appended
    labels = {k: v for k, v in node["metadata"]["labels"].items() if k != HEALTH_LABEL}
    assert labels == before["metadata"]["labels"]
    assert node["metadata"]["annotations"] == {"owner": "infra"}
    assert [c for c in node["status"]["conditions"] if c["type"] in ("Ready", "KernelDeadlock")] == \
        before["status"]["conditions"]
    cluster.update_node(NODE, lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: "1"}))
    effects.reconcile(cleared_by("1"), T0 + 200, "boot-1")
    node = cluster.node(NODE)
    assert node["spec"]["taints"] == foreign_taints
    assert node["metadata"]["annotations"] == {
        "owner": "infra", CLEAR_ANNOTATION: "1", CLEAR_HANDLED_ANNOTATION: "1"}


def test_stale_owned_taints_labels_and_conditions_are_cleared(tmp_path, cluster):
    def leftovers(n):
        n["spec"]["taints"] = [{"key": TAINT_KEY, "value": "reboot_node", "effect": "NoSchedule"},
                               {"key": "other.io/keep", "effect": "NoSchedule"},
                               {"key": TAINT_KEY, "value": "reboot_node", "effect": "NoExecute"}]
        n["metadata"]["labels"][HEALTH_LABEL] = "reboot-required"
        n["status"]["conditions"] += [
            {"type": "GpuHealthy", "status": "False", "reason": "GPU_XID", "message": "old"},
            {"type": "NetworkHealthy", "status": "False", "reason": "EFA_DEVICE_MISSING", "message": "old"}]

    cluster.update_node(NODE, leftovers)
    effects = started(tmp_path, cluster)
    effects.reconcile(HEALTHY, T0, "boot-2")
    node = cluster.node(NODE)
    assert node["spec"]["taints"] == [{"key": "other.io/keep", "effect": "NoSchedule"}]
    assert node["metadata"]["labels"][HEALTH_LABEL] == "healthy"
    assert {c["type"]: (c["status"], c["reason"]) for c in node["status"]["conditions"]} == {
        "Ready": ("True", "KubeletReady"), "GpuHealthy": ("True", "AllChecksPassed"),
        "NetworkHealthy": ("True", "AllChecksPassed")}


def test_the_clear_annotation_flow(tmp_path, cluster):
    """The effects see the clear on the node and hold the node as it is until policy's verdict
    accounts for it (the loop reads the same annotation from the node); then they remove the
    taint, mark the clear handled and say so once."""
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    effects.reconcile(XID95, T0 + 120, "boot-1")
    cluster.update_node(NODE, lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: "ticket-42"}))
    status = effects.reconcile(XID95, T0 + 200, "boot-1")  # the resync read sees it; policy has not yet
    assert status.clear_pending == "ticket-42" and effects.pending_clear() == "ticket-42"
    assert [t["effect"] for t in our_taints(cluster.node(NODE))] == ["NoExecute"]  # held as it was
    status = effects.reconcile(cleared_by("ticket-42"), T0 + 201, "boot-1")
    node = cluster.node(NODE)
    assert our_taints(node) == [] and node["metadata"]["labels"][HEALTH_LABEL] == "healthy"
    assert node["metadata"]["annotations"][CLEAR_HANDLED_ANNOTATION] == "ticket-42"
    assert condition(node, "GpuHealthy")["status"] == "True"
    assert status.clear_pending == "" and status.taint_effect == "" and effects.pending_clear() == ""
    assert sorted((e["type"], e["reason"]) for e in cluster.events()) == [
        ("Normal", "Cleared"), ("Warning", "GPU_XID")]
    # after a restart the handled clear is not carried out again
    again = started(tmp_path, cluster)
    assert again.reconcile(cleared_by("ticket-42"), T0 + 400, "boot-1").clear_pending == ""
    assert our_taints(cluster.node(NODE)) == [] and len(cluster.events()) == 2
    # a new fault (a new finding id, so a new key) is a new decision
    status = again.reconcile(verdict(finding(first_seen=T0 + 500, finding_id=2), clear_token="ticket-42"),
                             T0 + 500, "boot-1")
    assert status.taint_effect == "NoSchedule"


def test_removing_the_taint_by_hand_is_an_operator_clear(tmp_path, cluster):
    """The agent writes the removal to the node as the clear annotation (so the loop, which reads
    the node, hands it to policy) and re-adds no taint; policy's verdict completes it."""
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    cluster.update_node(NODE, lambda n: n["spec"].update(taints=[]))  # kubectl taint node ... -
    token = f"taint-removed-{int(T0 + 61)}"
    status = effects.reconcile(XID95, T0 + 61, "boot-1")
    node = cluster.node(NODE)
    assert our_taints(node) == [] and node["metadata"]["annotations"][CLEAR_ANNOTATION] == token
    assert status.clear_pending == token and effects.pending_clear() == token
    effects.reconcile(cleared_by(token), T0 + 62, "boot-1")
    node = cluster.node(NODE)
    assert node["metadata"]["annotations"][CLEAR_HANDLED_ANNOTATION] == token
    assert node["metadata"]["labels"][HEALTH_LABEL] == "healthy" and our_taints(node) == []
    assert [e["reason"] for e in cluster.events()].count("Cleared") == 1


def test_a_recreated_node_object_gets_the_taint_again(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    cluster.delete_node(NODE)
    cluster.add_node(NODE, labels={"nvidia.com/gpu.present": "true"})  # a new uid, no taint
    status = effects.reconcile(XID95, T0 + 61, "boot-1")
    assert our_taints(cluster.node(NODE)) and status.clear_pending == ""


def test_dry_run_decides_everything_and_makes_no_request(tmp_path, cluster, caplog):
    caplog.set_level(logging.INFO, logger="healthagent.effects")
    effects = start_effects(settings_for(tmp_path, NODE, kube="dry-run"), None)
    effects.startup(T0 - 1, "boot-1")
    status = effects.reconcile(XID95, T0, "boot-1")
    assert (status.mode, status.reachable, status.taint_effect) == ("dry-run", True, "NoSchedule")
    text = caplog.text
    assert f"dry_run=1 write=taint node={NODE} key={TAINT_KEY} value=replace_node effect=NoSchedule" in text
    assert "dry_run=1 write=label" in text and "dry_run=1 write=condition" in text
    assert "dry_run=1 event type=Warning reason=GPU_XID" in text
    caplog.clear()
    assert effects.reconcile(XID95, T0 + 30, "boot-1").taint_effect == "NoSchedule"
    assert "dry_run=1" not in caplog.text  # a steady state logs nothing
    assert effects.reconcile(XID95, T0 + 120, "boot-1").taint_effect == "NoExecute"
    assert "effect=NoExecute" in caplog.text
    restarted = start_effects(settings_for(tmp_path, NODE, kube="dry-run"), None)
    restarted.startup(T0 + 130, "boot-1")
    caplog.clear()
    assert restarted.reconcile(XID95, T0 + 130, "boot-1").taint_effect == "NoExecute"
    assert "dry_run=1" not in caplog.text
    assert cluster.requests() == []
    assert status.writes == {}


def test_hyperpod_labels_behind_the_flag(tmp_path, cluster):
    plain = started(tmp_path / "a", cluster, node="gpu-node-1")
    plain.reconcile(XID95, T0, "boot-1")
    plain.reconcile(XID95, T0 + 120, "boot-1")
    plain_labels = cluster.node("gpu-node-1")["metadata"]["labels"]
    assert not any(k.startswith("sagemaker.amazonaws.com/") for k in plain_labels)

    effects = started(tmp_path / "b", cluster, hyperpod_labels=True)
    effects.reconcile(XID95, T0, "boot-1")
    assert HYPERPOD_HEALTH_LABEL not in cluster.node(NODE)["metadata"]["labels"]  # not before the grace
    effects.reconcile(XID95, T0 + 120, "boot-1")
    labels = cluster.node(NODE)["metadata"]["labels"]
    hyperpod = (HYPERPOD_HEALTH_LABEL, HYPERPOD_FAULT_TYPES_LABEL, HYPERPOD_FAULT_REASONS_LABEL)
    assert tuple(labels[k] for k in hyperpod) == ("UnschedulablePendingReplacement", "GPU", "GPU_XID")
    cluster.update_node(NODE, lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: "1"}))
    effects.reconcile(cleared_by("1"), T0 + 200, "boot-1")
    labels = cluster.node(NODE)["metadata"]["labels"]
    assert labels[HYPERPOD_HEALTH_LABEL] == "Schedulable"
    assert HYPERPOD_FAULT_TYPES_LABEL not in labels and HYPERPOD_FAULT_REASONS_LABEL not in labels

    cluster.update_node("gpu-node-2",
                        lambda n: n["metadata"]["labels"].update({HYPERPOD_HEALTH_LABEL: "Unschedulable"}))
    other = started(tmp_path / "c", cluster, node="gpu-node-2", hyperpod_labels=True)
    other.reconcile(HEALTHY, T0, "boot-1")
    # HyperPod's own value is not the agent's to change
    assert cluster.node("gpu-node-2")["metadata"]["labels"][HYPERPOD_HEALTH_LABEL] == "Unschedulable"


def test_rejected_writes_are_counted_and_never_raise(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    cluster.fail_next(2, status=403)  # the budget count and the node read: RBAC missing, say
    status = effects.reconcile(XID95, T0, "boot-1")
    assert status.reachable and status.pending_writes >= 1
    assert ("node", "ok") not in status.writes
    status = effects.reconcile(XID95, T0 + 5, "boot-1")
    assert status.pending_writes == 0 and our_taints(cluster.node(NODE))


def test_unwritable_state_file_does_not_stop_the_effects(tmp_path, cluster):
    (tmp_path / "state").write_text("a file where the state directory should be")
    effects = start_effects(settings_for(tmp_path, NODE), cluster)
    status = effects.reconcile(XID95, T0, "boot-1")
    assert status.taint_effect == "NoSchedule"
    assert effects.state.errors.get("unwritable", 0) >= 1


# -- escalation: one Event per (finding, action) ---------------------------------------------------

XID79_LINE = "NVRM: Xid (PCI:0000:53:00): 79, pid=1234, name=python, GPU has fallen off the bus."
XID94_LINE = "NVRM: Xid (PCI:0000:53:00): 94, pid=1234, name=python, Contained ECC error"
XID79 = replace(finding(action=Action.REBOOT_NODE, xids=(79,)), evidence=XID79_LINE)
XID79_94 = replace(XID79, action=Action.REPLACE_NODE, xids=(79, 94), count=2,
                   evidence=f"{XID79_LINE}; {XID94_LINE}")


def by_action(events):
    return {e["action"]: e for e in events}


def test_an_incident_that_escalates_gets_one_more_event(tmp_path, cluster):
    assert XID79_94.key == XID79.key  # one incident on one GPU: the key is stable
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(XID79), T0, "boot-1")
    assert [(t["value"], t["effect"]) for t in our_taints(cluster.node(NODE))] == [("reboot_node", "NoSchedule")]
    status = effects.reconcile(verdict(XID79_94), T0 + 5, "boot-1")
    assert [(t["value"], t["effect"]) for t in our_taints(cluster.node(NODE))] == [("replace_node", "NoSchedule")]
    events = by_action(cluster.events())
    assert sorted(events) == ["Detected", "Escalated"]
    detected, escalated = events["Detected"], events["Escalated"]
    assert detected["note"].startswith("[reboot_node] ") and XID94_LINE not in detected["note"]
    assert (escalated["type"], escalated["reason"]) == ("Warning", "GPU_XID")
    assert escalated["note"].startswith("[replace_node] escalated from reboot_node to replace_node: ")
    assert XID94_LINE in escalated["note"] and "Next: drain and replace the node" in escalated["note"]
    assert escalated["regarding"]["name"] == NODE
    assert status.writes[("event", "ok")] == 2 and status.pending_writes == 0
    # the same action again, a milder one (the replace taint stays), and back: nothing more
    for n, f in enumerate([XID79_94, replace(XID79_94, action=Action.REBOOT_NODE), XID79_94]):
        effects.reconcile(verdict(f), T0 + 10 + n, "boot-1")
    assert len(cluster.events()) == 2
    # a restart on the saved state: nothing more either
    cluster.reset_log()
    started(tmp_path, cluster).reconcile(verdict(XID79_94), T0 + 20, "boot-1")
    assert cluster.writes() == [] and len(cluster.events()) == 2


def test_an_escalation_whose_state_write_was_lost_is_not_duplicated(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(XID79), T0, "boot-1")
    state = tmp_path / "state" / "state.json"
    before = state.read_bytes()
    effects.reconcile(verdict(XID79_94), T0 + 5, "boot-1")
    state.write_bytes(before)  # SIGKILL after the escalation's POST, before the state write
    cluster.reset_log()
    again = started(tmp_path, cluster)
    status = again.reconcile(verdict(XID79_94), T0 + 6, "boot-1")
    assert [(r.method, r.status) for r in cluster.requests("POST", EVENTS)] == [("POST", 409)]
    assert status.writes == {("event", "conflict"): 1} and node_writes(cluster) == []
    assert sorted(by_action(cluster.events())) == ["Detected", "Escalated"]
    assert [t["value"] for t in our_taints(cluster.node(NODE))] == ["replace_node"]


def test_an_escalation_while_the_api_is_down_is_delivered_later_once(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(XID79), T0, "boot-1")
    cluster.go_down()
    status = effects.reconcile(verdict(XID79_94), T0 + 5, "boot-1")
    assert status.pending_writes >= 2  # the taint change and the escalation's Event
    cluster.come_up()
    again = started(tmp_path, cluster)  # and a restart in between: the outbox is in the state file
    status = again.reconcile(verdict(XID79_94), T0 + 10, "boot-1")
    assert status.pending_writes == 0 and sorted(by_action(cluster.events())) == ["Detected", "Escalated"]
