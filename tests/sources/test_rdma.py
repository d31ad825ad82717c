"""RdmaSource over a real InfiniBand/RoCE sysfs tree (8 NDR IB ports, 2 RoCE ports) under a tmp
host root: what it reads, which port is which, and what it cannot see."""

from __future__ import annotations

import errno
import os

import pytest

from healthagent.demo.node import write_rdma_device
from healthagent.sources.rdma import RdmaSource, parse_rate, parse_state
from tests.support.rdma_tree import DISABLED, DOWN, HW_COUNTERS_ROCE, IB_COUNTERS, LEGACY_COUNTERS, build_rdma_tree

NOW = 1_700_000_000.0


def ports_of(result) -> dict:
    return {p.name: p for p in result.rdma}


def failing(match: str, code: int):
    """A fault hook: sysfs answers ``code`` for every path ending with ``match``."""
    def hook(path: str) -> None:
        if path.endswith(match):
            raise OSError(code, os.strerror(code), path)
    return hook


def test_every_port_of_the_node_is_read(tmp_path):
    tree = build_rdma_tree(tmp_path)
    result = RdmaSource(str(tmp_path)).collect(NOW)
    assert result.health.up and result.health.errors == {} and result.health.unobserved == ()
    assert result.health.detail == "10 RDMA ports on 10 devices"
    ports = ports_of(result)
    assert list(ports) == [f"mlx5_{i}/1" for i in range(10)]
    for spec in tree.ports:
        port = ports[f"{spec.device}/1"]
        assert (port.state_id, port.state, port.phys_state_id, port.phys_state) == (4, "ACTIVE", 5, "LinkUp")
        assert port.up and port.link_layer == spec.link_layer and port.pci_bus_id == spec.pci
        assert port.netdev == spec.netdev and port.driver == "mlx5_core"
        assert port.gpus == ((spec.gpu,) if spec.gpu else ())
        assert port.hca_type == "MT4129" and port.fw_ver == "28.39.1002"
        assert port.timestamp == NOW
        expected = set(IB_COUNTERS) | (set(LEGACY_COUNTERS) if spec.device == "mlx5_7" else set())
        assert set(port.counters) == expected
        assert port.counters["port_xmit_data"] == tree.counter(spec.device, "port_xmit_data")
        assert "lifespan" not in port.hw_counters
    assert ports["mlx5_0/1"].rate_gbps == 400.0 and ports["mlx5_0/1"].rate_text == "400 Gb/sec (4X NDR)"
    assert ports["mlx5_8/1"].rate_gbps == 200.0 and set(ports["mlx5_8/1"].hw_counters) == set(HW_COUNTERS_ROCE)


def test_values_follow_the_files_through_held_listings(tmp_path):
    tree = build_rdma_tree(tmp_path)
    source = RdmaSource(str(tmp_path))
    for step in range(4):  # the listing is trusted from the second collection on
        value = tree.bump("mlx5_4", "link_downed", 1)
        tree.bump("mlx5_9", "np_cnp_sent", 100)
        ports = ports_of(source.collect(NOW + step))
        assert ports["mlx5_4/1"].counters["link_downed"] == value
        assert ports["mlx5_9/1"].hw_counters["np_cnp_sent"] == tree.counter("mlx5_9", "np_cnp_sent")
    tree.set_state("mlx5_4", DOWN, DISABLED)
    port = ports_of(source.collect(NOW + 10))["mlx5_4/1"]
    assert (port.state_id, port.phys_state_id, port.up) == (1, 3, False)
    source.close()


def test_a_counter_file_gone_from_a_trusted_listing_reads_the_device_again(tmp_path):
    tree = build_rdma_tree(tmp_path)
    source = RdmaSource(str(tmp_path))
    source.collect(NOW)
    source.collect(NOW + 1)
    os.unlink(tree.port_dir("mlx5_1") / "hw_counters" / "out_of_buffer")
    result = source.collect(NOW + 2)
    assert result.health.up and result.health.errors == {}
    assert "out_of_buffer" not in ports_of(result)["mlx5_1/1"].hw_counters
    assert len(result.rdma) == 10


def test_efa_and_soft_rdma_devices_are_left_out(tmp_path):
    build_rdma_tree(tmp_path)
    write_rdma_device(tmp_path, "rdmap79s0", "0000:4f:00.0", vendor="0x1d0f", device_id="0xefa2", driver="efa",
                      device_counters={"cmds_err": 0}, port_counters={"tx_bytes": 1})
    soft = tmp_path / "sys/class/infiniband/rxe0"
    (soft / "ports/1").mkdir(parents=True)  # rxe: no PCI function behind it
    result = RdmaSource(str(tmp_path)).collect(NOW)
    assert {p.device for p in result.rdma} == {f"mlx5_{i}" for i in range(10)}
    assert result.health.up


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
def test_a_port_whose_state_cannot_be_read_is_unobserved_never_down(tmp_path, code):
    build_rdma_tree(tmp_path)
    result = RdmaSource(str(tmp_path), fault=failing("mlx5_2/ports/1/state", code)).collect(NOW)
    assert "mlx5_2/1" not in ports_of(result)
    assert len(result.rdma) == 9
    assert result.health.up is False and result.health.unobserved == ("mlx5_2/1",)
    assert errno.errorcode[code] in result.health.detail and "unobserved (not down)" in result.health.detail
    assert result.health.errors == {"unreadable": 1}


def test_a_state_that_is_not_understood_is_unobserved(tmp_path):
    tree = build_rdma_tree(tmp_path)
    tree.write("mlx5_6", "state", "garbage")
    result = RdmaSource(str(tmp_path)).collect(NOW)
    assert result.health.unobserved == ("mlx5_6/1",) and result.health.errors == {"parse": 1}


def test_a_device_whose_links_cannot_be_followed_is_unobserved(tmp_path):
    build_rdma_tree(tmp_path)
    result = RdmaSource(str(tmp_path), fault=failing("class/infiniband/mlx5_5", errno.EACCES)).collect(NOW)
    assert result.health.unobserved == ("mlx5_5",) and len(result.rdma) == 9


def test_a_counter_that_cannot_be_read_is_only_that_counter(tmp_path):
    build_rdma_tree(tmp_path)
    result = RdmaSource(str(tmp_path), fault=failing("mlx5_0/ports/1/counters/symbol_error", errno.EIO)).collect(NOW)
    port = ports_of(result)["mlx5_0/1"]
    assert "symbol_error" not in port.counters and "link_downed" in port.counters
    assert result.health.up and result.health.errors == {"unreadable": 1}


def test_no_pma_is_no_counter_and_no_error(tmp_path):
    tree = build_rdma_tree(tmp_path)
    tree.write("mlx5_8", "counters/symbol_error", "N/A (no PMA)")
    result = RdmaSource(str(tmp_path)).collect(NOW)
    assert "symbol_error" not in ports_of(result)["mlx5_8/1"].counters
    assert result.health.errors == {}


def test_a_removed_device_is_simply_not_reported(tmp_path):
    tree = build_rdma_tree(tmp_path)
    source = RdmaSource(str(tmp_path))
    source.collect(NOW)
    tree.remove_device("mlx5_3")
    result = source.collect(NOW + 1)
    assert "mlx5_3/1" not in ports_of(result) and result.health.up and result.health.unobserved == ()


def test_no_class_directory_is_up_with_nothing(tmp_path):
    result = RdmaSource(str(tmp_path)).collect(NOW)
    assert result.health.up and result.rdma == ()


def test_the_words_of_state_and_rate_files():
    assert parse_state(b"4: ACTIVE\n") == (4, "ACTIVE")
    assert parse_state(b"5: LinkUp") == (5, "LinkUp")
    assert parse_state(b"ACTIVE") is None
    assert parse_rate("2.5 Gb/sec (1X SDR)") == 2.5 and parse_rate("400 Gb/sec (4X NDR)") == 400.0
    assert parse_rate("") is None and parse_rate("fast") is None
