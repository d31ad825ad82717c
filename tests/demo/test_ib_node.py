"""The InfiniBand demo node (``healthagent demo --fabric ib``): its shape, read back through the real
RDMA, EFA and kernel-log sources, and its pulled cable as the RDMA source and the kernel log see it."""

from __future__ import annotations

import time

import pytest

from healthagent.demo import stub_nvml
from healthagent.demo.ib_node import PRODUCT_NAME, build_ib_demo_root
from healthagent.demo.rdma_tree import DOWN, POLLING
from healthagent.sources.efa import EfaSource
from healthagent.sources.instance import read_instance_type
from healthagent.sources.kernel_log.offline import iter_adapter_events, iter_events
from healthagent.sources.rdma import RdmaSource


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One node for the tests that only read it."""
    return build_ib_demo_root(tmp_path_factory.mktemp("ib") / "host")


def test_eight_infiniband_rails_beside_the_gpus_two_roce_ports_and_no_efa(built):
    ib = built
    ports = RdmaSource(str(ib.node.root)).collect(1.0).rdma
    assert [p.name for p in ports] == [f"mlx5_{i}/1" for i in range(10)]
    assert all(p.up for p in ports)
    assert [p.link_layer for p in ports] == ["InfiniBand"] * 8 + ["Ethernet"] * 2
    # NVML and sysfs agree on where each GPU sits: port i is behind GPU i's PCIe switch.
    nvml = [g["pci_bus_id"] for g in stub_nvml.load_scenario(ib.node.scenario)["gpus"]]
    assert [f"0000:{pci[9:].lower()}" for pci in nvml] == ib.node.gpu_pci_bus_ids
    assert [p.gpus for p in ports] == [(pci,) for pci in ib.node.gpu_pci_bus_ids] + [(), ()]
    assert ib.port_beside(3).device == "mlx5_3"
    efa = EfaSource(str(ib.node.root)).collect(1.0)
    assert efa.efa == () and efa.health.up and ib.node.efa_devices == []
    assert (ib.node.root / "sys/devices/virtual/dmi/id/product_name").read_text() == PRODUCT_NAME + "\n"
    assert read_instance_type(str(ib.node.root)) is None  # no EC2 type: the settings say 8 GPUs


def test_the_boot_log_is_a_dgx_boot_in_time_order_without_an_xid(built):
    ib = built
    text = ib.node.kernel_log.read_text()
    assert "DMI: NVIDIA DGXH100/DGXH100" in text and "Amazon" not in text and "EFA" not in text
    stamps = [int(line.split(",")[2]) for line in text.splitlines() if not line.startswith(" ")]
    assert stamps == sorted(stamps)
    assert "mlx5_core 0000:4b:00.0 ibp75s0: renamed from ib3" in text
    with ib.node.kernel_log.open(encoding="utf-8") as fh:
        assert list(iter_events(fh, time.time(), host_root=str(ib.node.root))) == []


def test_a_pulled_cable_is_a_port_down_polling_with_one_more_link_downed(tmp_path):
    ib = build_ib_demo_root(tmp_path / "host")
    source = RdmaSource(str(ib.node.root))
    before = {p.device: p for p in source.collect(1.0).rdma}
    line = ib.pull_cable("mlx5_3")
    after = {p.device: p for p in source.collect(2.0).rdma}
    assert (after["mlx5_3"].state_id, after["mlx5_3"].phys_state_id) == (int(DOWN[0]), int(POLLING[0]))
    assert not after["mlx5_3"].up and all(p.up for d, p in after.items() if d != "mlx5_3")
    assert after["mlx5_3"].counters["link_downed"] == before["mlx5_3"].counters["link_downed"] + 1
    with pytest.raises(IndexError):
        ib.port_beside(8)
    # The driver logs the cable's going at the adapter's PCI id, in words the agent recognises.
    assert line == "mlx5_core 0000:4b:00.0: Port module event: module 0, Cable unplugged"
    with ib.node.kernel_log.open(encoding="utf-8") as fh:
        events = list(iter_adapter_events(fh, time.time(), host_root=str(ib.node.root)))
    assert [(e.event, e.pci_bus_id, e.detail) for e in events] == [("module_unplugged", "0000:4b:00.0", "module 0")]
