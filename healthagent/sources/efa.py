"""EFA devices and their driver counters from sysfs (``/sys/class/infiniband/<dev>/``).

What is read, per device that really is an EFA (its PCI function has vendor ``0x1d0f``, a device id
``0xefa*`` and is bound to the ``efa`` driver; mlx5 and soft-RDMA devices are skipped):

- device counters ``<dev>/hw_counters/*`` and port counters ``<dev>/ports/<n>/hw_counters/*``;
  drivers older than 1.14 put one combined list in *both* directories, so both are read and
  merged by name (never summed: the two files are the same driver counter);
- port ``state``/``phys_state`` as raw text (the driver hard-codes them; policy looks for missing
  devices instead);
- the device's canonical PCI id, so a finding names the hardware to replace.

One ``EfaSample`` per port carries its counters with the device counters merged in. ``lifespan``
is a cache setting in rdma-core, not a counter, and is never reported.

sysfs is full of relative symlinks (``class/infiniband/x -> ../../devices/...``,
``device -> ../../../0000:4f:00.0``, ``driver -> ../../../bus/pci/drivers/efa``). Under a host
root (``--host-root /host``) they are resolved *inside* the root, as ``openat2(RESOLVE_IN_ROOT)``
would, so a link can never lead the agent out to the container's own ``/sys``.

Devices come and go (driver reload, hot unplug) and a file can vanish between listing and
reading: a vanished device is simply not reported (its absence is the signal policy acts on);
an unreadable or garbage counter file is counted (``unreadable``/``parse``) and skipped, and the
rest of that device is still reported. Every file is read through ``sysfs_reader`` (the reading
layer every RDMA sysfs source shares): it decides gone or unobserved, checks values, bounds the
devices and ports read, and holds files open.

**Gone or unobserved** (``sysfs_reader``): only ENOENT says a device is gone. Any other error
where the device itself is read (EACCES, EIO, ELOOP, ENOTDIR, EISDIR: its identity - class link,
``device`` link, vendor, device id, driver -, the listing of its ports and counter directories,
or every one of its counter files) makes it *unobserved*: named in ``SourceHealth.unobserved``
with the errno, counted and logged, and the source reports down while it still reports every
device it could read. Policy counts an unobserved device as present, never as missing, so neither
a permission problem nor a broken link can ever taint a node.

This runs every 10 s over ~32 devices x ~40 files: what cannot change while a device exists
(whether it is an EFA, its PCI id, its directory, the listing of its ports and counter
directories, trusted after two reads in a row agree) is kept by the device's identity, and a
trusted listing's files are held open and read with one ``pread`` each (``sysfs_reader``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from healthagent.common import ErrorTally
from healthagent.model import EFA_NOT_COUNTERS, EfaSample, SourceHealth, canonical_pci_bus_id, natural_key
from healthagent.sources.base import SourceResult
from healthagent.sources.sysfs_files import HeldFiles
from healthagent.sources.sysfs_paths import FaultHook
from healthagent.sources.sysfs_reader import NOT_OURS, ClassReader, Files, Links, Reading, blind_detail
from healthagent.sources.sysfs_values import NO_WIDTHS

CLASS_DIR = "/sys/class/infiniband"
EFA_VENDOR_ID = 0x1D0F
EFA_DEVICE_ID_PREFIX = "0xefa"
EFA_DRIVER = "efa"
# Enough for any u64 in decimal plus a newline, with room for whitespace the driver never adds.
READ_LIMIT = 64


@dataclass(frozen=True)
class _EfaDevice:
    name: str
    path: str  # the device's directory, resolved inside the host root
    pci_bus_id: str


@dataclass(frozen=True)
class _Port:
    number: int
    path: str
    counters: Files


@dataclass(frozen=True)
class _Layout:
    """What a device's directories list: the device counters, the ports and theirs."""

    counters: Files
    ports: tuple[_Port, ...]


class EfaSource:
    """Reads every EFA device under ``<host_root>/sys/class/infiniband`` once per ``collect``.

    Not thread-safe: one ``collect`` at a time (the loop's ``DeadlineSource`` never starts a
    second while one runs), which is what lets it keep its per-device cache without a lock.
    ``fault`` is a test's fault hook (``FaultHook``); production leaves it None.
    """

    name = "efa"

    def __init__(self, host_root: str, fault: FaultHook | None = None) -> None:
        self.host_root = os.path.abspath(host_root)
        self.errors = ErrorTally(self.name)
        self.reader: ClassReader[_EfaDevice] = ClassReader(self.name, self.host_root, self.errors, READ_LIMIT, fault)

    @property
    def fault(self) -> FaultHook | None:
        return self.reader.fault

    @fault.setter
    def fault(self, hook: FaultHook | None) -> None:
        self.reader.fault = hook

    @property
    def _files(self) -> HeldFiles:
        return self.reader.files

    @_files.setter
    def _files(self, files: HeldFiles) -> None:
        self.reader.files = files

    @property
    def _known(self) -> dict:
        return self.reader.known

    # -- the cycle -------------------------------------------------------------------------------

    def collect(self, now: float) -> SourceResult:
        scan = self.reader.scan(self._identify, lambda device, layout, reading:
                                self._read_device(device, now, layout, reading))
        if not scan.listed:
            return self._result(scan.up, scan.detail, ())
        samples: tuple[EfaSample, ...] = scan.items
        devices = len({s.device for s in samples})
        if scan.unobserved:
            detail = blind_detail(f"{devices} EFA devices read", scan.unobserved, "not missing")
            return self._result(False, detail, samples, tuple(sorted(scan.unobserved, key=natural_key)))
        if devices == 0:
            return self._result(True, "no EFA devices", ())
        return self._result(True, f"{devices} EFA devices", samples)

    def close(self) -> None:
        """Close the counter files held open between cycles."""
        self.reader.close()

    def _result(self, up: bool, detail: str, samples: tuple[EfaSample, ...],
                unobserved: tuple[str, ...] = ()) -> SourceResult:
        health = SourceHealth(source=self.name, up=up, detail=detail, errors=self.errors.snapshot(),
                              unobserved=unobserved)
        return SourceResult(health=health, efa=samples)

    # -- which devices are EFA -------------------------------------------------------------------

    def _identify(self, links: Links) -> _EfaDevice | object | None:
        """An EFA bound to the efa driver, ``NOT_OURS`` (another vendor's, or bound to another
        driver), or None when it is gone or is no EFA now (vanished, unbound): asked again next
        cycle. ``Unobserved`` when it is there but cannot be read: then whether it is an EFA is
        unknown, and so is its health."""
        reader = self.reader
        vendor = reader.identity_file(links, os.path.join(links.pci_dir, "vendor"))
        dev_id = reader.identity_file(links, os.path.join(links.pci_dir, "device"))
        if vendor is None or dev_id is None:
            return None
        try:
            is_efa_id = int(vendor, 16) == EFA_VENDOR_ID and dev_id.lower().startswith(EFA_DEVICE_ID_PREFIX)
        except ValueError:
            raise reader.unobserved("parse", f"device={links.name} vendor={vendor[:32]!r} not hex",
                                    f"device={links.name} vendor={vendor[:32]!r} not hex") from None
        if not is_efa_id:
            return NOT_OURS
        driver = reader.driver(links)
        if driver is None:
            return None  # unbound: no driver, no counters
        if driver != EFA_DRIVER:
            return NOT_OURS
        return _EfaDevice(name=links.name, path=links.path,
                          pci_bus_id=canonical_pci_bus_id(os.path.basename(links.pci_dir)) or "")

    # -- counters ------------------------------------------------------------------------------------

    def _read_device(self, device: _EfaDevice, now: float, layout: _Layout | None, reading: Reading) -> _Layout:
        """One sample per port into ``reading``, and the layout read.

        With ``layout`` (trusted) the listings are not read again and the files are held; a file
        they name that has gone raises ``Stale``. Without, each directory is listed.
        """
        reader, held = self.reader, layout is not None
        if layout is None:
            def counter_files(directory: str) -> Files:
                return reader.listing(device.path, os.path.join(directory, "hw_counters"), reading, EFA_NOT_COUNTERS)

            counters = counter_files(device.path)
            layout = _Layout(counters, tuple(_Port(n, path, counter_files(path))
                                             for n, path in reader.ports(device.path, reading)))
        reader.spend_ports(len(layout.ports), reading)
        device_counters = self._counters(device, layout.counters, held, reading)
        for port in layout.ports:
            # Old drivers list every counter in both places: one value per name, never a sum.
            counters = {**device_counters, **self._counters(device, port.counters, held, reading)}
            reading.items.append(EfaSample(
                device=device.name, port=port.number, counters=counters, pci_bus_id=device.pci_bus_id,
                port_state=reader.port_text(device.path, os.path.join(port.path, "state"), held, reading),
                phys_state=reader.port_text(device.path, os.path.join(port.path, "phys_state"), held, reading),
                timestamp=now,
            ))
        reader.present(device.path)
        return layout

    def _counters(self, device: _EfaDevice, files: Files, held: bool, reading: Reading) -> dict[str, int]:
        return self.reader.counters(device.path, files, held, reading, NO_WIDTHS)

