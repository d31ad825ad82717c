"""InfiniBand and RoCE ports (mlx5 and every other non-EFA RDMA driver) from sysfs.

What is read, per ``/sys/class/infiniband/<dev>`` backed by a PCI function whose driver is not
``efa`` (the EFA source reads those; soft RDMA devices such as rxe and siw have no PCI function and
are skipped):

- per device, once while it stays registered: its driver, canonical PCI id, ``board_id``,
  ``fw_ver``, ``hca_type``, and the GPUs behind the same PCIe switch (``pci_topology``);
- per port, every collection: ``state`` and ``phys_state`` (``"4: ACTIVE"``, ``"5: LinkUp"``),
  ``rate`` (``"400 Gb/sec (4X NDR)"``), ``link_layer`` (``InfiniBand``, or ``Ethernet`` for RoCE),
  the IB PortCounters in ``counters/`` (and ``counters_ext/`` of older kernels), the driver's
  ``hw_counters/`` of the port and of the device (``lifespan`` is a setting, not a counter);
- the port's network interface, from ``device/net/*`` (its ``dev_port`` when a function has
  several).

Unlike EFA, whose driver hard-codes ACTIVE, an InfiniBand port's state is real: a cable pulled or
a switch port disabled reads ``1: DOWN`` / ``3: Disabled`` at once, so the state is the signal.

**Unobserved, never missing, never down** (``sysfs_reader``, the reading layer every RDMA sysfs
source shares). Only ENOENT of the device itself says it is gone, and the device is simply not
reported (policy remembers the devices it saw and calls that missing). Every other error says
nothing about the hardware: a link that cannot be followed, or a ``ports/`` directory that cannot
be listed (EACCES, ELOOP, ENOTDIR, EIO), makes the device *unobserved*; a port whose ``state`` or
``phys_state`` cannot be read, or reads as no state the kernel writes (``"9: BOGUS"``), or whose
counter directory cannot be listed, makes that port unobserved (``mlx5_3/1``), never down. Both
are named in ``SourceHealth.unobserved`` with the reason, counted (``unreadable``/``parse``) and
the source reports down, while every other port is still reported. A counter file that cannot be
read, or holds more than its PortCounters field can (``link_downed`` is 8 bits), is only that
counter: absent, and counted. ``N/A (no PMA)`` (a port without a performance management agent) is
absent, not an error. The devices and ports read are bounded (``sysfs_reader``).

Files are read as the EFA source reads them: a trusted listing's files are held open, and what
cannot change while a device stays registered is cached by its identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from healthagent.common import ErrorTally
from healthagent.model import RdmaPort, SourceHealth, canonical_pci_bus_id, natural_key
from healthagent.sources.base import SourceResult
from healthagent.sources.pci_topology import gpu_paths, gpus_near
from healthagent.sources.sysfs_paths import FaultHook
from healthagent.sources.sysfs_reader import (NOT_OURS, ClassReader, Files, Links, Reading, Unobserved,
                                              blind_detail)
from healthagent.sources.sysfs_values import NO_WIDTHS, PHYS_STATES, PMA_WIDTHS, PORT_STATES, parse_state

CLASS_DIR = "/sys/class/infiniband"
EFA_DRIVER = "efa"
READ_LIMIT = 96  # a u64, a state line or a rate line ("400 Gb/sec (4X NDR)") with room to spare
MAX_NETDEVS = 16
PMA_DIRS = ("counters", "counters_ext")  # IB PortCounters; counters_ext: kernels before 4.5
HW_DIR = "hw_counters"
NOT_COUNTERS = frozenset({"lifespan"})  # hw_counters/lifespan: the counters' cache time in ms

__all__ = ["RdmaSource", "parse_rate", "parse_state"]


@dataclass(frozen=True)
class _Device:
    name: str
    path: str  # resolved inside the host root
    pci_dir: str
    pci_bus_id: str
    driver: str
    board_id: str = ""
    fw_ver: str = ""
    hca_type: str = ""
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class _PortFiles:
    number: int
    path: str
    link_layer: str
    pma: Files | None  # counters/ and counters_ext/; None: they could not be listed
    hw: Files | None
    blind: str = ""  # why the port's counter directories could not be listed


@dataclass(frozen=True)
class _Layout:
    device_hw: Files
    ports: tuple[_PortFiles, ...]

    @property
    def complete(self) -> bool:
        """Every port's counter directories listed: only such a listing is trusted (held), so a
        port that could not be listed is listed again each collection."""
        return all(port.pma is not None and port.hw is not None for port in self.ports)


def parse_rate(text: str) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0, ``"2.5 Gb/sec (1X SDR)"`` -> 2.5; None otherwise."""
    head = text.split(" ", 1)[0]
    try:
        value = float(head)
    except ValueError:
        return None
    return value if value >= 0 and value == value and value != float("inf") else None


class RdmaSource:
    """Reads every non-EFA RDMA port under ``<host_root>/sys/class/infiniband`` once per ``collect``.

    One ``collect`` at a time (the loop's ``DeadlineSource`` never overlaps two); ``fault`` is a
    test's fault hook (``sysfs_paths.FaultHook``), None in production.
    """

    name = "rdma"

    def __init__(self, host_root: str, fault: FaultHook | None = None) -> None:
        self.host_root = os.path.abspath(host_root)
        self.errors = ErrorTally(self.name)
        self.reader: ClassReader[_Device] = ClassReader(self.name, self.host_root, self.errors, READ_LIMIT, fault)
        self._gpus: dict[str, tuple[str, ...]] | None = None  # the PCI tree's GPUs, this collection

    def collect(self, now: float) -> SourceResult:
        try:
            scan = self.reader.scan(self._identify, lambda device, layout, reading:
                                    self._read_device(device, now, layout, reading))
        finally:
            self._gpus = None
        if not scan.listed:  # no class directory: no RDMA device (up); one that cannot be listed: down
            return self._result(scan.up, scan.detail, ())
        ports: tuple[RdmaPort, ...] = scan.items
        detail = f"{len(ports)} RDMA ports on {len({p.device for p in ports})} devices"
        if scan.unobserved:
            return self._result(False, blind_detail(detail, scan.unobserved, "not down"), ports,
                                tuple(scan.unobserved))
        return self._result(True, detail if ports else "no RDMA ports outside EFA", ports)

    def close(self) -> None:
        self.reader.close()

    def _result(self, up: bool, detail: str, ports: tuple[RdmaPort, ...], blind: tuple[str, ...] = ()) -> SourceResult:
        health = SourceHealth(source=self.name, up=up, detail=detail, errors=self.errors.snapshot(),
                              unobserved=tuple(sorted(blind, key=natural_key)))
        return SourceResult(health=health, rdma=ports)

    # -- which devices are ours ---------------------------------------------------------------------

    def _identify(self, links: Links) -> _Device | object | None:
        """Ours (a PCI function not bound to efa), ``NOT_OURS``, or None when it has no driver
        (asked again next cycle)."""
        driver = self.reader.driver(links)
        if driver is None:
            return None
        if driver == EFA_DRIVER:
            return NOT_OURS
        if self._gpus is None:
            self._gpus = gpu_paths(self.host_root)
        text = self.reader.text
        return _Device(name=links.name, path=links.path, pci_dir=links.pci_dir, driver=driver,
                       pci_bus_id=canonical_pci_bus_id(os.path.basename(links.pci_dir)) or "",
                       board_id=text(os.path.join(links.path, "board_id")),
                       fw_ver=text(os.path.join(links.path, "fw_ver")),
                       hca_type=text(os.path.join(links.path, "hca_type")),
                       gpus=gpus_near(links.pci_dir, self._gpus))

    # -- one device -------------------------------------------------------------------------------

    def _list(self, device: _Device, reading: Reading) -> _Layout:
        reader = self.reader
        ports = []
        for number, path in reader.ports(device.path, reading):
            try:
                pma = tuple(f for d in PMA_DIRS for f in reader.listing(device.path, os.path.join(path, d), reading))
                hw = reader.listing(device.path, os.path.join(path, HW_DIR), reading, NOT_COUNTERS)
            except Unobserved as exc:
                ports.append(_PortFiles(number, path, "", None, None, exc.reason))
                continue
            ports.append(_PortFiles(number, path, reader.text(os.path.join(path, "link_layer")), pma, hw))
        return _Layout(reader.listing(device.path, os.path.join(device.path, HW_DIR), reading, NOT_COUNTERS),
                       tuple(ports))

    def _netdevs(self, device: _Device) -> dict[int, str]:
        """Port number -> network interface (``device/net/*``; by ``dev_port`` when several)."""
        net = os.path.join(device.pci_dir, "net")
        try:
            names = sorted(e.name for e in self.reader.list_dir(net))[:MAX_NETDEVS]
        except OSError:
            return {}
        if len(names) == 1:
            return {0: names[0]}  # 0: every port of the function
        found: dict[int, str] = {}
        for name in names:
            text = self.reader.text(os.path.join(net, name, "dev_port"))
            if text.isdigit():
                found.setdefault(int(text) + 1, name)
        return found

    def _read_device(self, device: _Device, now: float, layout: _Layout | None, reading: Reading) -> _Layout:
        """The device's ports into ``reading``; the layout read (``layout``: a trusted one, files held)."""
        reader, held = self.reader, layout is not None
        netdevs = self._netdevs(device)
        if layout is None:
            layout = self._list(device, reading)
        reader.spend_ports(len(layout.ports), reading)
        device_hw = self._counters(device, layout.device_hw, held, reading, NO_WIDTHS)
        for port in layout.ports:
            name = f"{device.name}/{port.number}"
            try:
                read = self._port(device, port, now, held, reading, netdevs, device_hw)
            except Unobserved as exc:  # counted where it was found
                reading.unobserved(name, exc)
                continue
            if read is not None:
                reading.items.append(read)
        reader.present(device.path)
        return layout

    def _port(self, device: _Device, port: _PortFiles, now: float, held: bool, reading: Reading,
              netdevs: dict[int, str], device_hw: dict[str, int]) -> RdmaPort | None:
        """One port; None when it went away under us; ``Unobserved`` when it cannot be seen."""
        reader = self.reader
        if port.pma is None or port.hw is None:
            raise Unobserved(port.blind)
        try:
            state = reader.state(device.path, os.path.join(port.path, "state"), held, PORT_STATES)
            phys = reader.state(device.path, os.path.join(port.path, "phys_state"), held, PHYS_STATES)
        except Unobserved as exc:
            reading.count(exc.kind, f"port={device.name}/{port.number} {exc.reason}")
            raise
        if state is None or phys is None:
            return None  # the port went away under us: not reported this cycle
        rate_text = reader.port_text(device.path, os.path.join(port.path, "rate"), held, reading)
        return RdmaPort(
            device=device.name, port=port.number, state_id=state[0], state=state[1],
            phys_state_id=phys[0], phys_state=phys[1], link_layer=port.link_layer,
            rate_gbps=parse_rate(rate_text), rate_text=rate_text, pci_bus_id=device.pci_bus_id,
            driver=device.driver, board_id=device.board_id, fw_ver=device.fw_ver, hca_type=device.hca_type,
            netdev=netdevs.get(port.number, netdevs.get(0, "")), gpus=device.gpus,
            counters=self._counters(device, port.pma, held, reading, PMA_WIDTHS),
            hw_counters={**device_hw, **self._counters(device, port.hw, held, reading, NO_WIDTHS)}, timestamp=now)

    def _counters(self, device: _Device, files: Files, held: bool, reading: Reading,
                  widths: dict[str, int]) -> dict[str, int]:
        return self.reader.counters(device.path, files, held, reading, widths)
