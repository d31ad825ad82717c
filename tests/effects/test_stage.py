"""The remediation stage: derived from the verdict and the node, and its history.

The scripted incident runs the agent's Kubernetes side (``NodeEffects``) against the fake API
server with a limit of 2 whose slots peers hold: the node goes healthy -> cordoned ->
held_by_budget -> disrupting -> handed_off -> cleared as the budget frees, an engine drains it
and an operator clears it, and the history keeps how long each stay lasted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from healthagent.effects.budget_reclaim import Evidence
from healthagent.effects.node_desired import CLEAR_ANNOTATION
from healthagent.effects.stage import (
    CLEARED_HOLD_SECONDS,
    DURATION_BUCKETS,
    KARPENTER_DISRUPTED_TAINT,
    NodeSide,
    StageHistory,
    engine_of,
    stage_of,
    started,
)
from healthagent.model import Action, KubeStatus
from tests.effects.budget_helpers import NODE, cluster, held_by, peer_holds  # noqa: F401 (cluster: a fixture)
from tests.effects.helpers import (HEALTHY, T0, TAINT_KEY, XID95, cleared_by, finding, settings_for,
                                  started as effects_started, verdict)

NO_SIDE = NodeSide()


def stage(verdict_=XID95, effect="", blocked=False, side=NO_SIDE, previous=None, now=T0):
    return stage_of(verdict_, effect, blocked, side, previous or started(T0 - 10, T0 - 10), now, 120.0)


TAINTED_AT_T0_MINUS_200 = started(T0 - 300, T0 - 300).advance("cordoned", "GPU_XID", T0 - 200, T0 - 200)


@pytest.mark.parametrize("args,expected", [
    (dict(verdict_=HEALTHY), ("healthy", "")),
    (dict(verdict_=verdict(finding("GPU_SBE_STORM", Action.MONITOR, xids=()))), ("observing", "GPU_SBE_STORM")),
    (dict(effect="NoSchedule", side=NodeSide("replace_node")), ("cordoned", "GPU_XID")),
    (dict(effect="NoSchedule", blocked=True, side=NodeSide("replace_node")), ("cordoned", "GPU_XID")),  # grace
    (dict(effect="NoSchedule", blocked=True, side=NodeSide("replace_node"), previous=TAINTED_AT_T0_MINUS_200),
     ("held_by_budget", "budget")),
    (dict(effect="NoExecute", side=NodeSide("replace_node", True)), ("disrupting", "GPU_XID")),
    (dict(effect="NoExecute", side=NodeSide("replace_node", True, "drain")), ("handed_off", "drain")),
    (dict(effect="NoSchedule", side=NodeSide("replace_node", True, "hyperpod")), ("handed_off", "hyperpod")),
    (dict(effect="NoSchedule", side=NodeSide("replace_node", True, "node-repair")), ("handed_off", "node-repair")),
    (dict(effect="NoSchedule", side=NodeSide("replace_node", False, "karpenter")), ("handed_off", "karpenter")),
    (dict(effect="NoExecute", side=NodeSide("reboot_node", True)), ("rebooting", "GPU_XID")),
])
def test_each_stage_and_its_reason(args, expected):
    assert stage(**args) == expected


def test_cleared_is_shown_for_a_while_after_the_taint_comes_off_then_healthy():
    was = started(T0 - 100, T0 - 100).advance("disrupting", "GPU_XID", T0 - 50, T0 - 50)
    name, reason = stage(HEALTHY, previous=was, now=T0)
    assert (name, reason) == ("cleared", "taint_removed")
    cleared = was.advance(name, reason, T0, T0)
    assert stage(HEALTHY, previous=cleared, now=T0 + CLEARED_HOLD_SECONDS - 1)[0] == "cleared"
    assert stage(HEALTHY, previous=cleared, now=T0 + CLEARED_HOLD_SECONDS)[0] == "healthy"
    # a new fault after the clear is a new episode at once
    assert stage(XID95, "NoSchedule", side=NodeSide("replace_node"), previous=cleared, now=T0 + 1)[0] == "cordoned"


HYPERPOD_REBOOT = {"metadata": {"labels": {"sagemaker.amazonaws.com/node-health-status": "UnschedulablePendingReboot"}}}
EKS_FALSE = {"status": {"conditions": [{"type": "AcceleratedHardwareReady", "status": "False"}]}}
ALL_ENGINES = Evidence(TAINT_KEY, hyperpod=True, gated_types=frozenset({"AcceleratedHardwareReady", "NetworkingReady"}))
NO_ENGINE = Evidence(TAINT_KEY)


@pytest.mark.parametrize("node,evidence,engine", [
    ({"spec": {"taints": [{"key": KARPENTER_DISRUPTED_TAINT, "effect": "NoSchedule"}]}}, NO_ENGINE, "karpenter"),
    ({"spec": {"unschedulable": True}}, NO_ENGINE, "drain"),
    (HYPERPOD_REBOOT, ALL_ENGINES, "hyperpod"),
    (HYPERPOD_REBOOT, NO_ENGINE, ""),  # no HyperPod in use: the node's own label hands nothing off
    (EKS_FALSE, ALL_ENGINES, "node-repair"),
    (EKS_FALSE, NO_ENGINE, ""),  # the healthagent vocabulary: no engine repairs on that condition
    ({"status": {"conditions": [{"type": "GpuHealthy", "status": "False"}]}}, ALL_ENGINES, ""),
    ({"spec": {"unschedulable": "yes"}}, ALL_ENGINES, ""),  # a value the API never holds is no cordon
])
def test_the_engine_that_has_the_node(node, evidence, engine):
    assert engine_of(node, evidence) == engine


def test_the_engines_are_those_the_settings_name():
    assert Evidence.of(settings_for(Path("/nonexistent"), NODE)) == NO_ENGINE
    assert Evidence.of(settings_for(Path("/nonexistent"), NODE, hyperpod_labels=True,
                                    condition_vocabulary="eks")) == ALL_ENGINES


def test_a_node_action_moves_healthy_to_cordoned_before_its_taint_lands_never_through_observing():
    """The loop publishes the stage right after the verdict, while the effects thread is still
    writing the taint: the node is cordoned at once, and the taint's arrival is no move."""
    history = started(T0 - 10, T0 - 10)
    for effect, now in (("", T0), ("", T0 + 0.2), ("NoSchedule", T0 + 0.4)):
        name, reason = stage(XID95, effect, side=NodeSide("replace_node" if effect else ""), previous=history, now=now)
        history = history.advance(name, reason, now, now)
    assert history.transitions == {("healthy", "cordoned"): 1} and history.reason == "GPU_XID"
    assert history.tainted_since == T0  # the grace the stage waits for runs from the fault
    monitor = verdict(finding("GPU_SBE_STORM", Action.MONITOR, xids=()))
    escalated = history_of(("observing", monitor, ""), ("cordoned", XID95, ""))
    assert escalated.transitions == {("healthy", "observing"): 1, ("observing", "cordoned"): 1}
    # without effects (--kube off) no taint comes: a node action is only observed
    assert stage_of(XID95, "", False, NO_SIDE, started(T0 - 10, T0 - 10), T0, 120.0, taints=False)[0] == "observing"


def test_an_operators_clear_of_a_pending_taint_shows_cleared_once_policy_closes_the_finding():
    """A taint removed by hand while the verdict still holds the finding: cordoned until the
    policy accounts for the clear, then cleared (never observing, never a second cordoned)."""
    history = history_of(("cordoned", XID95, "NoSchedule"), ("cordoned", XID95, ""), ("cleared", HEALTHY, ""))
    assert history.transitions == {("healthy", "cordoned"): 1, ("cordoned", "cleared"): 1}


def history_of(*steps):
    """Walk ``steps`` of (expected stage, verdict, taint effect) a second apart from a healthy start."""
    history = started(T0 - 10, T0 - 10)
    for i, (expected, verdict_, effect) in enumerate(steps):
        name, reason = stage(verdict_, effect, side=NodeSide("replace_node" if effect else ""), previous=history,
                             now=T0 + i)
        assert name == expected, (i, name)
        history = history.advance(name, reason, T0 + i, T0 + i)
    return history


def test_a_stay_is_timed_on_the_decision_clock_into_cumulative_buckets():
    history = StageHistory(entered=0.0).advance("cordoned", "GPU_XID", 45.0, 1000.0)
    history = history.advance("held_by_budget", "GPU_XID", 45.0 + 400.0, 1400.0)
    history = history.advance("held_by_budget", "budget", 500.0, 1455.0)  # a new reason is no move
    assert history.transitions == {("healthy", "cordoned"): 1, ("cordoned", "held_by_budget"): 1}
    stays = history.durations["cordoned"]
    assert (stays.count, stays.total) == (1, 400.0)
    assert stays.buckets[DURATION_BUCKETS.index(300.0)] == 0 and stays.buckets[DURATION_BUCKETS.index(900.0)] == 1
    assert stays.buckets[-1] == 1  # +Inf
    assert (history.stage, history.reason, history.entered_wall) == ("held_by_budget", "budget", 1400.0)


def at(effects, history, verdict_, now):
    """The stage after a reconcile at ``now``, as the loop derives it from the status."""
    status: KubeStatus = effects.reconcile(verdict_, now, "boot-1")
    name, reason = stage_of(verdict_, status.taint_effect, status.budget_blocked,
                            NodeSide(status.taint_action, status.disruptive, status.engine), history, now, 120.0)
    return history.advance(name, reason, now, now), status


def test_a_scripted_incident_walks_the_pipeline_with_the_time_in_each_stage(tmp_path, cluster):
    peer_holds(cluster, 0, "gpu-node-5")
    peer_holds(cluster, 1, "gpu-node-6")  # the limit of 2 is taken
    effects = effects_started(tmp_path, cluster)
    history = started(T0 - 600, T0 - 600)
    seen = []
    history, _ = at(effects, history, HEALTHY, T0 - 300)
    seen.append(history.stage)
    history, status = at(effects, history, XID95, T0)
    seen.append(history.stage)  # the slot is asked only for the disruptive step: cordoned, then held
    effects.budget._reclaim.next_judgement = lambda memory, view, now: None  # the peers stand: no early look
    history, status = at(effects, history, XID95, T0 + 150)  # the grace is over: the step is due
    seen.append(history.stage)
    assert status.budget_blocked and status.budget_slots_held == 2 and status.budget_limit == 2
    cluster.update_node("gpu-node-6", lambda n: n["spec"].update(taints=[]))  # a peer healed: its agent
    slot = next(x for x in cluster.leases("healthagent") if x["metadata"]["name"] == "healthagent-budget-slot-1")
    cluster.put_lease("healthagent", {**slot, "spec": {}})
    history, status = at(effects, history, XID95, T0 + 300)  # its next look finds slot 1
    seen.append(history.stage)
    assert held_by(cluster, NODE) and status.taint_effect == "NoExecute"
    cluster.update_node(NODE, lambda n: n["spec"].update(unschedulable=True))  # an engine drains it
    history, status = at(effects, history, XID95, T0 + 900)
    seen.append(history.stage)
    assert history.reason == "drain"
    cluster.update_node(NODE, lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: "ticket-7"}))
    effects.reconcile(XID95, T0 + 2000, "boot-1")  # the resync reads the clear (no watch here)
    history, status = at(effects, history, cleared_by("ticket-7"), T0 + 2001)
    seen.append(history.stage)
    assert [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]] == [
        "healthy", "cordoned", "held_by_budget", "disrupting", "handed_off", "cleared"]
    assert status.taint_effect == ""
    stays = {name: d.total for name, d in history.durations.items()}
    assert stays == {"healthy": 600, "cordoned": 150, "held_by_budget": 150, "disrupting": 600, "handed_off": 1101}
    assert set(history.transitions) == {("healthy", "cordoned"), ("cordoned", "held_by_budget"),
                                        ("held_by_budget", "disrupting"), ("disrupting", "handed_off"),
                                        ("handed_off", "cleared")}
    assert [t for t in cluster.node(NODE)["spec"].get("taints") or [] if t["key"] == TAINT_KEY] == []
