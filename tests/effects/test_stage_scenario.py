"""The remediation stage through a scripted incident, on the fake and the real API server.

Ten GPU nodes: the budget allows one node past NoSchedule. A peer agent's node reboots under the
one slot (XID 79); this node gets XID 94, is cordoned, waits for the slot past its grace, takes
it when the peer's node is back, is drained by an engine and cleared by an operator. The stage
the loop derives from each reconcile's status walks healthy -> cordoned -> held_by_budget ->
disrupting -> handed_off -> cleared, and the history holds the time spent in each.
"""

from __future__ import annotations

import pytest

from healthagent.effects.node_desired import CLEAR_ANNOTATION
from healthagent.effects.stage import NodeSide, StageHistory, stage_of, started
from tests.effects.helpers import T0, cleared_by
from tests.effects.test_scenarios import HEALTHY, XID79, XID94, cluster, effects_for, fake_or_none  # noqa: F401

pytestmark = pytest.mark.integration
GRACE = 120.0


def observed(effects, history: StageHistory, verdict, now: float, boot: str = "boot-1") -> StageHistory:
    """The loop's step: reconcile, then derive the stage from the status it publishes."""
    status = effects.reconcile(verdict, now, boot)
    name, reason = stage_of(verdict, status.taint_effect, status.budget_blocked,
                            NodeSide(status.taint_action, status.disruptive, status.engine), history, now, GRACE)
    return history.advance(name, reason, now, now)


def test_a_scripted_incident_walks_every_stage_with_its_time(tmp_path, cluster):  # noqa: F811
    me, peer_name = cluster.name(0), cluster.name(1)
    peer, _ = effects_for(tmp_path, cluster, node=peer_name)
    effects, _ = effects_for(tmp_path, cluster)
    peer.reconcile(XID79, T0 - 200, "boot-1")  # the peer takes the one slot ...
    peer.reconcile(XID79, T0 - 50, "boot-1")  # ... and its NoExecute after the grace
    history = started(T0 - 600, T0 - 600)
    seen = []
    for verdict, now in ((HEALTHY, T0 - 300), (XID94, T0), (XID94, T0 + 150)):
        history = observed(effects, history, verdict, now)
        seen.append((history.stage, history.reason))
    assert effects.status().budget_limit == 1 and effects.status().budget_slots_held == 1
    peer.reconcile(HEALTHY, T0 + 200, "boot-2")  # the peer's node rebooted: its slot comes back
    now = T0 + 200
    while history.stage == "held_by_budget" and now < T0 + 600:
        now = max(now + 5, effects.budget_recheck_at or now)
        history = observed(effects, history, XID94, now)
    seen.append((history.stage, history.reason))
    cluster.update_node(me, lambda n: n["spec"].update(unschedulable=True))  # an engine drains the node
    history = observed(effects, history, XID94, now + 600)
    seen.append((history.stage, history.reason))
    cluster.update_node(me, lambda n: n["metadata"].setdefault("annotations", {}).update(
        {CLEAR_ANNOTATION: "ticket-9"}))
    effects.reconcile(XID94, now + 1700, "boot-1")  # the resync reads the clear (no watch here)
    history = observed(effects, history, cleared_by("ticket-9"), now + 1800)
    seen.append((history.stage, history.reason))
    assert seen == [("healthy", ""), ("cordoned", "GPU_XID"), ("held_by_budget", "budget"),
                    ("disrupting", "GPU_XID"), ("handed_off", "drain"), ("cleared", "taint_removed")]
    stays = {name: d.total for name, d in history.durations.items()}
    assert stays["healthy"] == 600 and stays["cordoned"] == 150 and stays["handed_off"] == 1200
    assert stays["held_by_budget"] == now - (T0 + 150) and stays["disrupting"] == 600
    assert effects.errors == {} and peer.errors == {}
