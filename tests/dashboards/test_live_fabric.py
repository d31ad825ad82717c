"""The InfiniBand/RoCE fabric dashboard and alerts, proven on a real Prometheus scraping the real
agent on a node with 8 NDR InfiniBand ports and 2 RoCE ports (``tests/support/rdma_tree.py``).

The agent is ``AgentRuntime`` (what ``healthagent run`` starts) over the tree, without NVML,
Kubernetes in dry-run; Prometheus is the Debian binary with the rule file (every ``for:`` at 0s, as
in test_live_prometheus.py). Faults are written into sysfs: a port goes down, one trains at half
its rate, one flaps, a RoCE port sends CNPs; and into the kernel log: one ConnectX adapter's
firmware hangs (a fatal event), a RoCE adapter's cable goes bad. Then every query of
dashboards/rdma-fabric.json returns data and the fabric alerts fire. No timing is asserted: each
wait polls for its condition.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.dashboards.test_live_prometheus import DEADLINE, scraped_by_prometheus
from tests.support.observability import dashboard_queries, require_binary, substitute, wait_for
from tests.support.rdma_tree import DISABLED, DOWN, HDR, build_rdma_tree

pytestmark = pytest.mark.integration

NODE = "dgx-ib-node"
EXPECTED_FIRING = {"HealthagentInfinibandPortDown", "HealthagentInfinibandPortDegraded",
                   "HealthagentInfinibandLinkFlapping", "HealthagentRdmaAdapterFatal"}
FATAL_ADAPTER, CABLE_ADAPTER = "mlx5_2", "mlx5_8"  # an InfiniBand adapter, a RoCE one


def log_adapter_events(kernel_log: Path, pci: dict[str, str]) -> None:
    """Append, as syslog writes kern.log, the driver's lines for a hung firmware and a bad cable."""
    stamp = datetime.now(timezone.utc).isoformat(timespec="microseconds")
    lines = [f"mlx5_core {pci[FATAL_ADAPTER]}: poll_health:801:(pid 0): device's health compromised - reached miss "
             "count",
             f"mlx5_core {pci[CABLE_ADAPTER]}: port_module:258:(pid 0): Port module event[error]: module 0, Cable "
             "error, Bad or shorted cable/module"]
    with open(kernel_log, "a", encoding="utf-8") as fh:
        fh.writelines(f"{stamp} {NODE} kernel: {line}\n" for line in lines)


@pytest.fixture
def fabric(tmp_path):
    require_binary("prometheus")
    from healthagent.config import load_settings
    from healthagent.wiring import AgentRuntime

    tree = build_rdma_tree(tmp_path / "host")
    kernel_log = tmp_path / "kern.log"
    kernel_log.write_text("")
    settings = load_settings(env={}, flags={
        "host_root": str(tree.root), "kernel_log": str(kernel_log), "nvml": "false", "kube": "dry-run",
        "listen": "127.0.0.1:0", "state_file": str(tmp_path / "state.json"), "node_name": NODE,
        "rdma_interval_seconds": 1, "log_level": "WARNING", "training_intake": "off",
    })
    with scraped_by_prometheus(AgentRuntime(settings), NODE, tmp_path) as prometheus:
        yield tree, kernel_log, prometheus


def test_the_fabric_dashboard_returns_data_and_the_fabric_alerts_fire(fabric):
    tree, kernel_log, prom = fabric
    wait_for(lambda: prom.query(f'healthagent_infiniband_port_up{{node="{NODE}"}} == 1'), timeout=DEADLINE,
             what="Prometheus to have the ports up")
    wait_for(lambda: len(prom.query(f'healthagent_infiniband_port_up{{node="{NODE}"}} == 1')) == 10,
             timeout=DEADLINE, what="all ten ports up")
    tree.set_state("mlx5_3", DOWN, DISABLED)
    tree.set_rate("mlx5_5", HDR)
    tree.bump("mlx5_6", "link_downed", 6)
    tree.bump("mlx5_9", "np_cnp_sent", 50_000)
    tree.bump("mlx5_0", "symbol_error", 3)
    log_adapter_events(kernel_log, {port.device: port.pci for port in tree.ports})
    for step in range(3):  # traffic moves between scrapes
        tree.bump("mlx5_1", "port_xmit_data", 1_000_000 + step)
        wait_for(lambda: prom.query(f'changes(healthagent_infiniband_port_data_transmitted_bytes_total'
                                    f'{{node="{NODE}",device="mlx5_1"}}[1m]) > {step}'),
                 timeout=DEADLINE, what="the traffic counter to move")

    firing = lambda: {name for name, states in prom.alerts().items() if "firing" in states}  # noqa: E731
    try:
        wait_for(lambda: EXPECTED_FIRING <= firing(), timeout=DEADLINE, what="the fabric alerts")
    except AssertionError:
        pytest.fail(f"not firing: {sorted(EXPECTED_FIRING - firing())}; alerts: {prom.alerts()}")

    empty = []
    for query in [q for q in dashboard_queries() if q.dashboard == "rdma-fabric.json"]:
        expr = substitute(query.expr, {"cluster": ".*", "node": NODE})
        try:
            wait_for(lambda e=expr: prom.query(e), timeout=30, what=expr)
        except AssertionError:
            empty.append(f"{query.where}: {expr}")
    assert not empty, "fabric dashboard queries without data:\n" + "\n".join(empty)

    # The events panel shows each adapter's first event, which increase() alone never sees.
    [events] = [substitute(q.expr, {"cluster": ".*", "node": NODE}) for q in dashboard_queries()
                if (q.dashboard, q.where) == ("rdma-fabric.json", "ConnectX adapter events / A")]
    shown = prom.query(f"max_over_time(({events})[5m:1s]) > 0")
    assert {(r["metric"]["device"], r["metric"]["event"]) for r in shown} == {
        (FATAL_ADAPTER, "health_compromised"), (CABLE_ADAPTER, "module_bad_cable")}
