"""The Remediation dashboard's DRA row on a real Prometheus: the agent's snapshot with one GPU
quarantined (and later a fallback) is served on a real ``AgentServer``, the Debian ``prometheus``
scrapes it, and the row's own expressions (read from dashboards/remediation.json, the variables
filled in as Grafana would) show the device, its stage and the fallback reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from healthagent.model import AgentSnapshot, KubeStatus
from tests.dashboards.test_live_prometheus import Prometheus
from tests.effects.budget_helpers import NODE
from tests.effects.helpers import T0
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
DEVICE = f"gpu.nvidia.com/{NODE}/gpu-3"


def panel(title: str, ref: str = "A") -> str:
    (query,) = [q for q in dashboard_queries() if q.dashboard == "remediation.json" and q.where == f"{title} / {ref}"]
    return substitute(query.expr, {"cluster": ".*", "node": NODE})


def test_the_dra_row_shows_the_quarantined_gpu_then_the_fallback(tmp_path: Path):
    require_binary("prometheus")
    agent = start_agent()
    config = write_scrape_config(tmp_path / "prometheus.yml", agent.server.port, NODE, RULES_FILE)
    server, url = start_prometheus(config, tmp_path)
    prom = Prometheus(url)
    try:
        quarantined = KubeStatus(gpu_quarantines=((DEVICE, "GPU-3", "0000:5d:00.0", "NoSchedule"),))
        agent.telemetry.publish(AgentSnapshot(timestamp=T0, kube=quarantined))

        def listed() -> list[tuple]:
            return [(r["metric"].get("device"), r["metric"].get("stage")) for r in prom.query(panel("GPUs quarantined"))]

        wait_for(lambda: listed() == [(DEVICE, "NoSchedule")], timeout=60, what="the quarantined GPU")
        assert [(r["metric"], float(r["value"][1])) for r in prom.query(panel("GPU quarantines and fallbacks"))] == [
            ({"stage": "NoSchedule"}, 1.0)]
        agent.telemetry.publish(AgentSnapshot(timestamp=T0 + 1, kube=KubeStatus(dra_fallbacks=("too_many_gpus",))))
        wait_for(lambda: [r["metric"] for r in prom.query(panel("GPU quarantines and fallbacks", "B"))]
                 == [{"reason": "too_many_gpus"}], timeout=60, what="the fallback")
        wait_for(lambda: listed() == [], timeout=60, what="the quarantine to end")
    finally:
        server.stop()
        agent.server.stop()
