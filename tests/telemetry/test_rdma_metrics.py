"""The InfiniBand/RoCE families: names as node_exporter's, the rate as Go computes it, the docs."""

from __future__ import annotations

import pytest

from healthagent.telemetry.rdma_metrics import HW_NAMES, PMA_NAMES, RDMA, counter_name, go_rate_bytes
from tests.telemetry.test_docs import METRICS_DOC, doc_rows


@pytest.mark.parametrize("metric", RDMA, ids=lambda m: m.name)
def test_the_metrics_doc_lists_every_rdma_family_with_type_and_labels(metric):
    kind, labels = doc_rows()[metric.full_name]
    assert kind == metric.type
    assert labels == set(metric.labels)


def test_the_counter_families_are_documented():
    """The pattern, every counter node_exporter names, and the name of a driver counter it does not."""
    assert doc_rows()["healthagent_infiniband_<counter>_total"] == ("counter", {"device", "port"})
    named = [counter_name(file, hw=False) for file in PMA_NAMES] + [counter_name(file, hw=True) for file in HW_NAMES]
    assert [name for name in named if f"| `{name}` |" not in METRICS_DOC] == []
    assert "`healthagent_infiniband_hw_<file>_total`" in METRICS_DOC


def test_counter_names():
    assert counter_name("port_xmit_data", hw=False) == "healthagent_infiniband_port_data_transmitted_bytes_total"
    assert counter_name("VL15_dropped", hw=False) == "healthagent_infiniband_vl15_dropped_total"
    assert counter_name("port_rcv_data_64", hw=False) == "healthagent_infiniband_legacy_data_received_bytes_total"
    assert counter_name("out_of_buffer", hw=True) == "healthagent_infiniband_out_of_buffer_drops_total"
    assert counter_name("req_transport_retries_exceeded", hw=True) == \
        "healthagent_infiniband_hw_req_transport_retries_exceeded_total"


def test_rates_in_bytes_a_second_as_go_parses_them():
    assert go_rate_bytes(400.0) == 50_000_000_000
    assert go_rate_bytes(2.5) == 312_500_000
    assert go_rate_bytes(53.125) == 6_640_625_000
    # Go parses the number as a 32-bit float first: 0.1 is 0.100000001490116..., times 1.25e8
    assert go_rate_bytes(0.1) == 12_500_000


def test_ports_past_the_bound_on_sysfs_names_fold_into_one_series():
    """10,000 ports (names a writable sysfs or a broken driver could make up): the first
    ``RDMA_PORTS`` keep their own series, the rest are one ``~other`` series whose counter is their
    sum and whose ``port_up`` is 0 while any of them is down."""
    from healthagent.bounded_names import OVERFLOW, RDMA_PORTS
    from healthagent.model import RdmaPort
    from healthagent.telemetry.rdma_metrics import rdma_families

    ports = tuple(RdmaPort(device=f"mlx5_{n}", port=1, state_id=1 if n == 9_999 else 4, phys_state_id=5,
                           counters={"symbol_error": 2}) for n in range(10_000))
    families = {f.name: f.samples for f in rdma_families(ports)}
    assert len(families["healthagent_infiniband_port_up"]) == RDMA_PORTS + 1
    folded = {s.labels["device"]: s.value for s in families["healthagent_infiniband_symbol_error"]}
    assert len(folded) == RDMA_PORTS + 1 and folded[OVERFLOW] == 2.0 * (10_000 - RDMA_PORTS)
    assert {s.labels["device"]: s.value for s in families["healthagent_infiniband_port_up"]}[OVERFLOW] == 0.0
    assert [s.value for s in families["healthagent_infiniband_ports_folded"]] == [10_000 - RDMA_PORTS]
    assert len(families["healthagent_infiniband_state_id"]) == RDMA_PORTS
