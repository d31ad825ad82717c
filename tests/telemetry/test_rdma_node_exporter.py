"""The agent's InfiniBand/RoCE metrics against the real node_exporter, on one sysfs tree.

Debian's ``prometheus-node-exporter`` runs with only its infiniband collector and
``--path.sysfs`` on the node's tree (8 NDR InfiniBand ports, 2 RoCE ports, one device with the old
``counters_ext/``); the agent reads the same tree with its own source and renders its exposition.
Every series node_exporter exports has the agent's twin under ``healthagent_`` with the same labels
and the same value, and the agent exports every one of them: the data counters in octets (4x the
sysfs word counter), the rate in bytes a second, the states' numbers. Then the counters move and
both are read again.
"""

from __future__ import annotations

import pytest
from prometheus_client.exposition import generate_latest

from healthagent.model import AgentSnapshot
from healthagent.sources.rdma import RdmaSource
from healthagent.telemetry.metrics import Telemetry
from tests.support.node_exporter import InfinibandExporter, samples
from tests.support.rdma_tree import DISABLED, DOWN, build_rdma_tree

pytestmark = pytest.mark.integration


def agent_text(source: RdmaSource, now: float) -> str:
    telemetry = Telemetry("test")
    telemetry.publish(AgentSnapshot(timestamp=now, rdma=source.collect(now).rdma))
    return generate_latest(telemetry.registry).decode()


def compare(exporter: InfinibandExporter, source: RdmaSource, now: float) -> int:
    """Assert parity; the number of series compared."""
    theirs = samples(exporter.text(), "node_infiniband_")
    ours = samples(agent_text(source, now), "healthagent_infiniband_")
    assert theirs, "node_exporter exported no infiniband series: " + exporter.server.log_tail()
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"node_exporter series the agent lacks: {missing[:10]}"
    differ = {key: (theirs[key], ours[key]) for key in theirs if theirs[key] != ours[key]}
    assert not differ, f"values differ (node_exporter, agent): {differ}"
    return len(theirs)


@pytest.fixture
def both(tmp_path):
    tree = build_rdma_tree(tmp_path / "host")
    # Values where the octet conversion and float rounding matter: past 2**53 after the x4.
    tree.write("mlx5_0", "counters/port_xmit_data", str(2**60 + 1))
    tree.write("mlx5_7", "counters_ext/port_rcv_data_64", str(2**55 + 3))
    exporter = InfinibandExporter(tmp_path / "host" / "sys", tmp_path / "node_exporter.log")
    source = RdmaSource(str(tmp_path / "host"))
    try:
        yield tree, exporter, source
    finally:
        exporter.stop()
        source.close()


def test_every_series_node_exporter_exports_the_agent_exports_with_the_same_value(both):
    tree, exporter, source = both
    compared = compare(exporter, source, 1.0)
    # 10 info + 10 ports x (3 gauges + 21 PortCounters) + 8 legacy counters of mlx5_7.
    assert compared == 10 + 10 * 24 + 8
    ours = samples(agent_text(source, 2.0), "healthagent_infiniband_")
    key = ("port_data_transmitted_bytes_total", (("device", "mlx5_0"), ("port", "1")))
    assert ours[key] == float(4 * (2**60 + 1))
    assert ours[("rate_bytes_per_second", (("device", "mlx5_8"), ("port", "1")))] == 25e9


def test_parity_holds_as_counters_move_and_a_port_goes_down(both):
    tree, exporter, source = both
    tree.bump("mlx5_3", "port_xmit_data", 123_456_789)
    tree.bump("mlx5_3", "link_downed", 2)
    tree.bump("mlx5_9", "port_rcv_packets", 5)
    tree.set_state("mlx5_5", DOWN, DISABLED)
    tree.set_rate("mlx5_5", "10 Gb/sec (4X SDR)")
    compare(exporter, source, 3.0)
    ours = samples(agent_text(source, 4.0), "healthagent_infiniband_")
    assert ours[("state_id", (("device", "mlx5_5"), ("port", "1")))] == 1.0
    assert ours[("port_up", (("device", "mlx5_5"), ("port", "1")))] == 0.0
