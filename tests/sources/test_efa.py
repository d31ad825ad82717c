"""EfaSource over real sysfs-shaped trees (relative symlinks, counter files) under a tmp host root.

The trees are written by the demo node's own sysfs writer (``healthagent.demo.node``), so the
agent, the demo and these tests agree on one layout; the expected counter list comes from an
independent copy of the driver reference (``tests/fixtures/efa/efa-counters.txt``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from healthagent.demo.node import (
    healthy_efa_counters,
    p5_efa_pci_bus_ids,
    write_efa_devices,
    write_rdma_device,
)
from healthagent.sources import sysfs_reader
from healthagent.sources.efa import EfaSource
from tests.support.efa_reference import efa_counter_facts

NOW = 1_700_000_000.0


def reference_counters() -> dict[str, str]:
    """counter name -> scope ("port", "device" or "device AND port") from the driver reference."""
    return {name: fact.scope for name, fact in efa_counter_facts().items()}


def by_device(result) -> dict[str, object]:
    return {s.device: s for s in result.efa}


def class_dir(root: Path) -> Path:
    return root / "sys" / "class" / "infiniband"


def device_dir(root: Path, name: str) -> Path:
    return (class_dir(root) / name).resolve()


# -- a full p5 node ------------------------------------------------------------------------------

def test_the_p5_tree_is_read_fully(tmp_path):
    pci_ids = p5_efa_pci_bus_ids()
    names = write_efa_devices(tmp_path, pci_ids)
    result = EfaSource(str(tmp_path)).collect(NOW)

    assert result.health.up is True
    assert result.health.errors == {}
    assert result.health.detail == "32 EFA devices"
    assert len(result.efa) == 32
    samples = by_device(result)
    assert sorted(samples) == sorted(names)
    # One port each, named and ordered by PCI bus as rdma-core names them.
    assert [s.device for s in result.efa][:5] == ["rdmap79s0", "rdmap80s0", "rdmap81s0", "rdmap82s0", "rdmap96s0"]
    reference = reference_counters()
    expected_names = {name for name in reference if name != "lifespan"}
    for seed, (name, pci) in enumerate(zip(names, pci_ids)):
        sample = samples[name]
        device_counters, port_counters = healthy_efa_counters(seed, 7245.31)
        assert sample.port == 1
        assert sample.pci_bus_id == pci
        assert sample.port_state == "4: ACTIVE"
        assert sample.phys_state == "5: LinkUp"
        assert sample.timestamp == NOW
        assert set(sample.counters) == expected_names
        assert dict(sample.counters) == {**device_counters, **port_counters}
        assert all(type(v) is int for v in sample.counters.values())
        assert "lifespan" not in sample.counters


def test_reference_scopes_match_the_files_written(tmp_path):
    """Port counters live under ports/1/hw_counters, device counters under hw_counters."""
    write_efa_devices(tmp_path, ["0000:4f:00.0"])
    dev = device_dir(tmp_path, "rdmap79s0")
    device_files = set(os.listdir(dev / "hw_counters"))
    port_files = set(os.listdir(dev / "ports" / "1" / "hw_counters"))
    for name, scope in reference_counters().items():
        if scope == "port":
            assert name in port_files and name not in device_files, name
        elif scope == "device":
            assert name in device_files and name not in port_files, name
        else:
            assert name in port_files and name in device_files, name
    assert (dev / "hw_counters" / "lifespan").read_text() == "10\n"


def test_sysfs_links_are_relative_like_the_kernels(tmp_path):
    write_efa_devices(tmp_path, ["0000:4f:00.0"])
    link = class_dir(tmp_path) / "rdmap79s0"
    assert os.readlink(link) == "../../devices/pci0000:4f/0000:4f:00.0/infiniband/rdmap79s0"
    assert os.readlink(device_dir(tmp_path, "rdmap79s0") / "device") == "../../../0000:4f:00.0"
    function = tmp_path / "sys/devices/pci0000:4f/0000:4f:00.0"
    assert os.readlink(function / "driver") == "../../../bus/pci/drivers/efa"


# -- which devices are EFA -----------------------------------------------------------------------

def _small_counters():
    return {"submitted_cmds": 10, "completed_cmds": 10}, {"tx_bytes": 100, "rx_drops": 0}


@pytest.mark.parametrize("name, vendor, device_id, driver, reported", [
    ("rdmap79s0", "0x1d0f", "0xefa2", "efa", True),
    ("efa_0", "0x1d0f", "0xefa0", "efa", True),             # pre-persistent-naming name
    ("rdmap80s0", "0x1d0f", "0xEFA1", "efa", True),          # hex case does not matter
    ("mlx5_0", "0x15b3", "0x101d", "mlx5_core", False),      # ConnectX: RDMA, not EFA
    ("rdmap81s0", "0x1d0f", "0xefa2", "vfio-pci", False),    # EFA id but not the efa driver
    ("rdmap82s0", "0x1d0f", "0xec20", "ena", False),         # Amazon vendor, not an EFA id
])
def test_only_efa_devices_bound_to_efa_are_reported(tmp_path, name, vendor, device_id, driver, reported):
    device_counters, port_counters = _small_counters()
    write_rdma_device(tmp_path, name, "0000:4f:00.0", vendor=vendor, device_id=device_id, driver=driver,
                      device_counters=device_counters, port_counters=port_counters)
    result = EfaSource(str(tmp_path)).collect(NOW)
    assert [s.device for s in result.efa] == ([name] if reported else [])
    assert result.health.up is True
    assert result.health.errors == {}


def test_mlx5_beside_efa_is_ignored_and_soft_rdma_without_pci_too(tmp_path):
    device_counters, port_counters = _small_counters()
    write_efa_devices(tmp_path, ["0000:4f:00.0"])
    write_rdma_device(tmp_path, "mlx5_0", "0000:17:00.0", vendor="0x15b3", device_id="0x101d",
                      driver="mlx5_core", device_counters=device_counters, port_counters=port_counters)
    # rxe (soft RoCE) has no PCI function: no device link at all.
    soft = tmp_path / "sys/devices/virtual/infiniband/rxe0"
    (soft / "ports/1/hw_counters").mkdir(parents=True)
    (class_dir(tmp_path) / "rxe0").symlink_to("../../devices/virtual/infiniband/rxe0")
    result = EfaSource(str(tmp_path)).collect(NOW)
    assert [s.device for s in result.efa] == ["rdmap79s0"]
    assert result.health.errors == {}


def test_links_resolve_inside_the_host_root(tmp_path):
    """An absolute link target means <host root>/..., never the agent's own /sys."""
    write_efa_devices(tmp_path, ["0000:4f:00.0"])
    dev = device_dir(tmp_path, "rdmap79s0")
    os.unlink(dev / "device")
    os.symlink("/sys/devices/pci0000:4f/0000:4f:00.0", dev / "device")
    result = EfaSource(str(tmp_path)).collect(NOW)
    assert [(s.device, s.pci_bus_id) for s in result.efa] == [("rdmap79s0", "0000:4f:00.0")]


# -- old drivers: one combined list in both directories -----------------------------------------

OLD_COMBINED = {  # efa < 1.14: basic + messages + rdma_read + admin queue + verbs errors, no split
    "tx_bytes": 9120, "tx_pkts": 12, "rx_bytes": 8800, "rx_pkts": 11, "rx_drops": 0,
    "send_bytes": 640, "send_wrs": 5, "recv_bytes": 512, "recv_wrs": 4, "rdma_read_wrs": 2,
    "rdma_read_bytes": 8192, "rdma_read_wr_err": 0, "rdma_read_resp_bytes": 8192,
    "submitted_cmds": 301, "completed_cmds": 301, "cmds_err": 0, "no_completion_cmds": 0,
    "keep_alive_rcvd": 7000, "alloc_pd_err": 0, "create_qp_err": 0, "create_cq_err": 0,
    "reg_mr_err": 0, "alloc_ucontext_err": 0, "create_ah_err": 0, "mmap_err": 0, "lifespan": 10,
}


def test_old_driver_combined_layout_is_not_double_counted(tmp_path):
    write_rdma_device(tmp_path, "efa_0", "0000:10:1c.0", device_id="0xefa0",
                      device_counters=OLD_COMBINED, port_counters=OLD_COMBINED)
    result = EfaSource(str(tmp_path)).collect(NOW)
    (sample,) = result.efa
    expected = {k: v for k, v in OLD_COMBINED.items() if k != "lifespan"}
    assert dict(sample.counters) == expected
    assert sample.pci_bus_id == "0000:10:1c.0"
    assert result.health.errors == {}


def test_old_layout_takes_the_copy_that_is_readable(tmp_path):
    port = dict(OLD_COMBINED, tx_bytes="garbage\n")
    device = dict(OLD_COMBINED, rx_bytes="\n")
    write_rdma_device(tmp_path, "efa_0", "0000:10:1c.0", device_id="0xefa0",
                      device_counters=device, port_counters=port)
    result = EfaSource(str(tmp_path)).collect(NOW)
    (sample,) = result.efa
    assert sample.counters["tx_bytes"] == 9120   # from the device directory
    assert sample.counters["rx_bytes"] == 8800   # from the port directory
    assert result.health.errors == {"parse": 2}


# -- bad files -----------------------------------------------------------------------------------


def test_garbage_and_unreadable_files_are_counted_and_skipped(tmp_path):
    device_counters, port_counters = healthy_efa_counters(0, 100.0)
    port_counters = dict(port_counters, rx_drops="-3\n", tx_pkts="lots\n", retrans_pkts="")
    write_rdma_device(tmp_path, "rdmap79s0", "0000:4f:00.0",
                      device_counters=device_counters, port_counters=port_counters)
    write_efa_devices(tmp_path, ["0000:50:00.0"])  # a healthy neighbour
    dev = device_dir(tmp_path, "rdmap79s0")
    # unreadable: a file that vanished after the listing (dangling link: ENOENT), one that is a
    # directory (EISDIR), and a name that is no counter at all.
    os.unlink(dev / "hw_counters" / "cmds_err")
    os.symlink("gone", dev / "hw_counters" / "cmds_err")
    os.unlink(dev / "hw_counters" / "mmap_err")
    os.mkdir(dev / "hw_counters" / "mmap_err")
    (dev / "hw_counters" / "bad name.tmp").write_text("1\n")

    source = EfaSource(str(tmp_path))
    result = source.collect(NOW)
    samples = by_device(result)
    broken = samples["rdmap79s0"].counters
    assert "rx_drops" not in broken and "tx_pkts" not in broken and "retrans_pkts" not in broken
    assert "cmds_err" not in broken and "mmap_err" not in broken
    assert broken["tx_bytes"] == port_counters["tx_bytes"]
    assert broken["submitted_cmds"] == device_counters["submitted_cmds"]
    assert len(broken) == len(device_counters) + len(port_counters) - 5
    assert len(samples["rdmap80s0"].counters) == len(device_counters) + len(port_counters)
    assert result.health.up is True
    assert result.health.errors == {"parse": 4, "unreadable": 2}
    # Cumulative: the same files fail again next cycle and are counted again.
    assert source.collect(NOW + 10).health.errors == {"parse": 8, "unreadable": 4}


def test_unreadable_class_dir_is_the_only_down(tmp_path):
    (tmp_path / "sys" / "class").mkdir(parents=True)
    (class_dir(tmp_path)).write_text("not a directory")
    result = EfaSource(str(tmp_path)).collect(NOW)
    assert result.health.up is False
    assert "cannot read /sys/class/infiniband" in result.health.detail
    assert result.health.errors == {"unreadable": 1}
    assert result.efa == ()


def test_empty_class_dir_is_up_with_no_devices(tmp_path):
    class_dir(tmp_path).mkdir(parents=True)
    result = EfaSource(str(tmp_path)).collect(NOW)
    assert (result.health.up, result.health.detail, result.efa) == (True, "no EFA devices", ())
    assert result.health.errors == {}


def test_no_infiniband_class_at_all_is_up(tmp_path):
    result = EfaSource(str(tmp_path)).collect(NOW)
    assert result.health.up is True
    assert "no /sys/class/infiniband" in result.health.detail
    assert result.efa == ()


# -- devices that come and go --------------------------------------------------------------------

def _unbind(root: Path, name: str) -> None:
    target = device_dir(root, name)
    (class_dir(root) / name).unlink()
    shutil.rmtree(target)


def test_devices_vanishing_and_returning_between_cycles(tmp_path):
    pci_ids = p5_efa_pci_bus_ids()[:4]
    write_efa_devices(tmp_path, pci_ids)
    source = EfaSource(str(tmp_path))
    assert len(source.collect(NOW).efa) == 4
    _unbind(tmp_path, "rdmap80s0")
    second = source.collect(NOW + 10)
    assert sorted(by_device(second)) == ["rdmap79s0", "rdmap81s0", "rdmap82s0"]
    assert second.health.up is True and second.health.errors == {}
    write_efa_devices(tmp_path, ["0000:50:00.0"])  # driver reload brings it back
    assert sorted(by_device(source.collect(NOW + 20))) == ["rdmap79s0", "rdmap80s0", "rdmap81s0", "rdmap82s0"]


@pytest.mark.parametrize("when", ["first device counter file", "port directory listing", "state file"])
def test_device_vanishing_in_the_middle_of_its_read(tmp_path, monkeypatch, when):
    """The device is removed while the source is half-way through it: it is simply not reported
    (its absence is what policy acts on), the others are, and nothing is counted as an error."""
    write_efa_devices(tmp_path, ["0000:4f:00.0", "0000:50:00.0", "0000:51:00.0"])
    victim = device_dir(tmp_path, "rdmap80s0")
    removed = []

    def remove_once():
        if not removed:
            removed.append(True)
            _unbind(tmp_path, "rdmap80s0")

    real_read, real_scandir = sysfs_reader.read_once, os.scandir

    def read_once(path, size):
        if when == "first device counter file" and path.startswith(str(victim / "hw_counters")):
            remove_once()
        if when == "state file" and path == str(victim / "ports" / "1" / "state"):
            remove_once()
        return real_read(path, size)

    def scandir(path="."):
        if when == "port directory listing" and str(path) == str(victim / "ports"):
            remove_once()
        return real_scandir(path)

    monkeypatch.setattr(sysfs_reader, "read_once", read_once)
    monkeypatch.setattr(sysfs_reader.os, "scandir", scandir)
    result = EfaSource(str(tmp_path)).collect(NOW)
    assert removed == [True]
    assert sorted(by_device(result)) == ["rdmap79s0", "rdmap81s0"]
    assert result.health.up is True
    assert result.health.errors == {}
