"""EfaSource's per-device cache (``_Known``): what cannot change while a device exists is read
once, the counters every cycle, and a device that changes under the cache is read afresh.

Real sysfs-shaped trees under a tmp host root, written by the demo node's writer; ``os.scandir``
is wrapped only to count which directories a cycle lists.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from healthagent.demo.node import healthy_efa_counters, write_efa_devices, write_rdma_device
from healthagent.sources import efa as efa_module
from healthagent.sources.efa import EfaSource

NOW = 1_700_000_000.0
PCI = ["0000:4f:00.0", "0000:50:00.0", "0000:51:00.0"]


def by_device(result) -> dict:
    return {s.device: s for s in result.efa}


def device_dir(root: Path, name: str) -> Path:
    return (root / "sys" / "class" / "infiniband" / name).resolve()


def set_counter(root: Path, name: str, counter: str, value: int) -> None:
    path = device_dir(root, name) / "ports" / "1" / "hw_counters" / counter
    tmp = path.with_name(counter + ".new")
    tmp.write_text(f"{value}\n")
    os.replace(tmp, path)


def reregister(root: Path, name: str, pci_bus_id: str, **how) -> dict[str, int]:
    """Unregister ``name`` and register it again on another PCI function (a driver reload);
    returns the new device's port counters."""
    link = root / "sys" / "class" / "infiniband" / name
    old = device_dir(root, name)
    link.unlink()
    shutil.rmtree(old)
    device_counters, port_counters = healthy_efa_counters(5, 100.0)
    write_rdma_device(root, name, pci_bus_id, device_counters=device_counters,
                      port_counters=port_counters, **how)
    return port_counters


class ListingCounter:
    """Counts ``os.scandir`` calls on paths below ``root`` (the class directory excluded)."""

    def __init__(self, monkeypatch, root: Path) -> None:
        self.calls: list[str] = []
        self._real = os.scandir
        self._class_dir = str(root / "sys" / "class" / "infiniband")
        monkeypatch.setattr(efa_module.os, "scandir", self)

    def __call__(self, path="."):
        if str(path) != self._class_dir:
            self.calls.append(str(path))
        return self._real(path)


def test_listings_are_trusted_after_two_equal_reads_and_values_stay_fresh(tmp_path, monkeypatch):
    write_efa_devices(tmp_path, PCI)
    listings = ListingCounter(monkeypatch, tmp_path)
    source = EfaSource(str(tmp_path))
    first = source.collect(NOW)
    assert len(first.efa) == 3 and listings.calls  # listed
    listings.calls.clear()
    source.collect(NOW + 10)
    assert listings.calls  # listed again: one read is not trusted (a half-registered device)
    listings.calls.clear()
    set_counter(tmp_path, "rdmap80s0", "rdma_read_resp_bytes", 123_456_789)
    third = source.collect(NOW + 20)
    assert listings.calls == []  # no directory listed: the cached layout served
    assert by_device(third)["rdmap80s0"].counters["rdma_read_resp_bytes"] == 123_456_789
    assert by_device(third)["rdmap80s0"].timestamp == NOW + 20
    # Same samples as an uncached source reading the same tree.
    fresh = EfaSource(str(tmp_path)).collect(NOW + 20)
    assert third.efa == fresh.efa
    assert third.health == fresh.health


def test_a_counter_file_gone_from_a_trusted_listing_reads_the_device_afresh(tmp_path):
    write_efa_devices(tmp_path, PCI)
    source = EfaSource(str(tmp_path))
    source.collect(NOW)
    source.collect(NOW + 10)  # now trusted
    (device_dir(tmp_path, "rdmap79s0") / "ports" / "1" / "hw_counters" / "tx_pkts").unlink()
    result = source.collect(NOW + 20)
    samples = by_device(result)
    assert sorted(samples) == ["rdmap79s0", "rdmap80s0", "rdmap81s0"]
    assert "tx_pkts" not in samples["rdmap79s0"].counters
    assert "rx_pkts" in samples["rdmap79s0"].counters  # the rest of the device still read
    # The fresh listing no longer names the file: no error (a vanished file the listing named
    # would be counted once, by the uncached read, never twice).
    assert result.health.errors == {}
    assert result.efa == EfaSource(str(tmp_path)).collect(NOW + 20).efa


def test_a_counter_that_vanishes_between_listing_and_read_is_counted_once(tmp_path, monkeypatch):
    write_efa_devices(tmp_path, PCI[:1])
    source = EfaSource(str(tmp_path))
    source.collect(NOW)
    source.collect(NOW + 10)  # trusted
    victim = device_dir(tmp_path, "rdmap79s0") / "ports" / "1" / "hw_counters" / "tx_pkts"
    victim.unlink()
    os.symlink("gone", victim)  # still listed, read fails with ENOENT (dangling)
    result = source.collect(NOW + 20)
    assert "tx_pkts" not in by_device(result)["rdmap79s0"].counters
    assert result.health.errors == {"unreadable": 1}


def test_a_device_registered_again_at_the_same_name_is_identified_again(tmp_path):
    """Driver reload: rdmap79s0 comes back on another PCI function, with another port layout."""
    write_efa_devices(tmp_path, PCI[:2])
    source = EfaSource(str(tmp_path))
    source.collect(NOW)
    source.collect(NOW + 10)  # trusted
    port_counters = reregister(tmp_path, "rdmap79s0", "0000:a0:00.0", ports=(1, 2))
    result = source.collect(NOW + 20)
    again = [s for s in result.efa if s.device == "rdmap79s0"]
    assert [s.port for s in again] == [1, 2]
    assert {s.pci_bus_id for s in again} == {"0000:a0:00.0"}
    assert again[0].counters["tx_bytes"] == port_counters["tx_bytes"]
    assert result.efa == EfaSource(str(tmp_path)).collect(NOW + 20).efa


def test_a_device_rebound_to_another_driver_is_dropped(tmp_path):
    write_efa_devices(tmp_path, PCI[:2])
    source = EfaSource(str(tmp_path))
    source.collect(NOW)
    source.collect(NOW + 10)
    reregister(tmp_path, "rdmap80s0", "0000:b0:00.0", driver="vfio-pci")
    assert sorted(by_device(source.collect(NOW + 20))) == ["rdmap79s0"]


def test_the_cache_holds_only_devices_listed_now(tmp_path):
    names = write_efa_devices(tmp_path, PCI)
    source = EfaSource(str(tmp_path))
    source.collect(NOW)
    assert sorted(source._known) == sorted(names)
    link = tmp_path / "sys" / "class" / "infiniband" / "rdmap81s0"
    target = device_dir(tmp_path, "rdmap81s0")
    link.unlink()
    shutil.rmtree(target)
    source.collect(NOW + 10)
    assert sorted(source._known) == ["rdmap79s0", "rdmap80s0"]
    shutil.rmtree(tmp_path / "sys" / "class" / "infiniband")
    source.collect(NOW + 20)
    assert source._known == {}
