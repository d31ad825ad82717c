"""The Remediation dashboard through a scripted incident, on a real Prometheus.

The agent's Kubernetes side (``NodeEffects``) runs the incident against the fake API server, as
tests/effects/test_stage.py does: a full budget, a freed slot, an engine's drain, an operator's
clear. After each step the loop's snapshot (its stage history included) is published on a real
``AgentServer``; the Debian ``prometheus`` binary scrapes it every second with the recording
rules loaded, and the dashboard's own expressions (read from dashboards/remediation.json, the
variables filled in as Grafana would) must show the node in that stage, with its reason, and the
budget and hand-off panels the values the agent read. No timing is asserted: each step waits for
Prometheus to show it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from healthagent.effects.node_desired import CLEAR_ANNOTATION
from healthagent.effects.stage import NodeSide, stage_of, started
from healthagent.model import AgentSnapshot, KubeStatus
from tests.dashboards.test_live_prometheus import Prometheus
from tests.effects.budget_helpers import NODE, count_gpu_nodes, peer_holds
from tests.effects.helpers import HEALTHY, T0, XID95, cleared_by, started as effects_started
from tests.support.kubefake import KubeFake
from tests.support.observability import (
    RULES_FILE,
    dashboard_queries,
    require_binary,
    start_prometheus,
    substitute,
    wait_for,
    write_scrape_config,
)
from tests.telemetry.harness import start_agent

pytestmark = pytest.mark.integration

VARIABLES = {"cluster": ".*", "node": NODE}
GRACE = 120.0


def panel(title: str, ref: str = "A") -> str:
    """A Remediation panel's expression, as Grafana would send it for this node."""
    (query,) = [q for q in dashboard_queries() if q.dashboard == "remediation.json" and q.where == f"{title} / {ref}"]
    return substitute(query.expr, VARIABLES)


@pytest.fixture
def fake():
    """The fake API server the agent's Kubernetes side runs the incident against."""
    with KubeFake() as server:
        yield server


@pytest.fixture
def prometheus(tmp_path: Path):
    require_binary("prometheus")
    agent = start_agent()
    config = write_scrape_config(tmp_path / "prometheus.yml", agent.server.port, NODE, RULES_FILE)
    server, url = start_prometheus(config, tmp_path)
    try:
        yield agent, Prometheus(url)
    finally:
        server.stop()
        agent.server.stop()


def test_the_dashboard_follows_a_scripted_incident_stage_by_stage(tmp_path, fake, prometheus):
    agent, prom = prometheus
    fake.seed_nodes(20)
    count_gpu_nodes(fake)  # the counter's count: a limit of 2 at 10%
    peer_holds(fake, 0, "gpu-node-5")
    peer_holds(fake, 1, "gpu-node-6")
    effects = effects_started(tmp_path, fake)
    effects.budget._reclaim.next_judgement = lambda memory, view, now: None  # the peers stand: no early look
    history = started(T0 - 600, T0 - 600)

    def step(verdict, now: float, expect: str, reason: str) -> KubeStatus:
        nonlocal history
        status = effects.reconcile(verdict, now, "boot-1")
        name, why = stage_of(verdict, status.taint_effect, status.budget_blocked,
                             NodeSide(status.taint_action, status.disruptive, status.engine), history, now, GRACE)
        history = history.advance(name, why, now, now)
        assert (name, why) == (expect, reason)
        agent.telemetry.publish(AgentSnapshot(timestamp=now, verdict=verdict, kube=status, stage=history))

        def shown() -> bool:
            stages = {r["metric"]["stage"]: float(r["value"][1]) for r in prom.query(
                panel("Nodes per stage").replace('stage!="healthy"', 'stage=~".+"'))}
            listed = {(r["metric"].get("stage"), r["metric"].get("reason")) for r in prom.query(
                panel("Nodes in the pipeline"))}
            return stages.get(expect) == 1 and sum(stages.values()) == 1 and (
                expect == "healthy" or (expect, reason) in listed)

        wait_for(shown, timeout=60, what=f"the dashboard to show {expect} ({reason})")
        return status

    step(HEALTHY, T0 - 300, "healthy", "")
    step(XID95, T0, "cordoned", "GPU_XID")
    status = step(XID95, T0 + 150, "held_by_budget", "budget")
    wait_for(lambda: prom.value(panel("Held by the budget")) == 1, timeout=60, what="the held stat")
    wait_for(lambda: {r["metric"].get("scope", ""): float(r["value"][1]) for r in prom.query(
        panel("Budget per scope", "A"))} == {"": 2.0}, timeout=60, what="slots held")
    assert status.budget_limit == 2
    fake.update_node("gpu-node-6", lambda n: n["spec"].update(taints=[]))  # a peer healed: its slot freed
    slot = next(x for x in fake.leases("healthagent") if x["metadata"]["name"] == "healthagent-budget-slot-1")
    fake.put_lease("healthagent", {**slot, "spec": {}})
    step(XID95, T0 + 300, "disrupting", "GPU_XID")
    fake.update_node(NODE, lambda n: n["spec"].update(unschedulable=True))  # an engine drains it
    step(XID95, T0 + 900, "handed_off", "drain")
    wait_for(lambda: [r["metric"].get("reason") for r in prom.query(panel("Hand-offs per engine"))] == ["drain"],
             timeout=60, what="the hand-off per engine")
    (oldest,) = prom.query(panel("Hand-offs per engine", "B"))  # how long the engine has had it
    assert oldest["metric"] == {"reason": "drain"} and float(oldest["value"][1]) >= 0
    fake.update_node(NODE, lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: "ticket-7"}))
    effects.reconcile(XID95, T0 + 2000, "boot-1")  # the resync reads the clear (no watch here)
    step(cleared_by("ticket-7"), T0 + 2001, "cleared", "taint_removed")
    # the time in each finished stage, from the histogram the p50 panel reads
    def finished() -> dict[str, float]:  # stages without a finished stay are NaN (no increase)
        values = {r["metric"]["stage"]: float(r["value"][1]) for r in prom.query(panel("Time in stage, p50"))}
        return {stage: v for stage, v in values.items() if not math.isnan(v)}

    wait_for(lambda: set(finished()) == {"cordoned", "held_by_budget", "disrupting", "handed_off"},
             timeout=60, what="the time in each finished stage")
    p50 = finished()
    assert 120 <= p50["handed_off"] <= 1800 and 300 <= p50["disrupting"] <= 600  # in their buckets
    wait_for(lambda: prom.value('cluster_stage:healthagent_remediation_nodes:sum{stage="cleared"}') == 1,
             timeout=60, what="the fleet's recording rule to count the cleared node")
