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

**Unobserved, never missing.** Only ENOENT says something is gone, and only for a device: its class
entry or its directory no longer exists, and the device is simply not reported (policy remembers
the devices it saw and calls that missing). Every other error says nothing about the hardware:
a class link or ``device`` link that cannot be followed (EACCES, ELOOP, EIO) makes the device
*unobserved*, and a port whose ``state`` or ``phys_state`` cannot be read or understood makes that
port unobserved (``mlx5_3/1``), never down. Both are named in ``SourceHealth.unobserved`` with the
reason, counted (``unreadable``/``parse``) and the source reports down, while every other port is
still reported. A counter file that cannot be read is only that counter: absent, and counted.
``N/A (no PMA)`` (a port without a performance management agent) is absent, not an error.

Files are read as the EFA source reads them (``sysfs_files.HeldFiles``): once two collections in a
row list the same files for a device, those files stay open and are read with one ``pread`` each;
a listed file that has gone (ENOENT) drops that listing and the device is read again at once, from
fresh listings. What cannot change while a device stays registered is cached by its identity
(``sysfs_paths.device_identity``), so a driver reload or hot plug is identified from scratch.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Callable

from healthagent.common import ErrorTally
from healthagent.model import RdmaPort, SourceHealth, canonical_pci_bus_id, natural_key
from healthagent.sources.base import SourceResult, host_path
from healthagent.sources.pci_topology import gpu_paths, gpus_near
from healthagent.sources.sysfs_files import HeldFiles, parse_counter, read_once
from healthagent.sources.sysfs_paths import FaultHook, device_identity, errno_text, resolve_in_root

log = logging.getLogger(__name__)

CLASS_DIR = "/sys/class/infiniband"
EFA_DRIVER = "efa"
READ_LIMIT = 96  # a u64, a state line or a rate line ("400 Gb/sec (4X NDR)") with room to spare
MAX_PORTS = 16
MAX_COUNTER_FILES = 256
MAX_NETDEVS = 16
PMA_DIRS = ("counters", "counters_ext")  # IB PortCounters; counters_ext: kernels before 4.5
HW_DIR = "hw_counters"
NOT_COUNTERS = frozenset({"lifespan"})  # hw_counters/lifespan: the counters' cache time in ms
_STATE = re.compile(r"^\s*(\d{1,3})\s*:\s*(\S.*?)\s*$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")

Count = Callable[[str, str], None]
Files = tuple[tuple[str, str], ...]  # (file name, path), sorted


class _Gone(Exception):
    """The device directory disappeared while it was being read: not reported this cycle."""


class _Stale(Exception):
    """A file a trusted listing names has gone: list the device again."""


class _Blind(Exception):
    """There, but not readable (any error but ENOENT): unobserved, with the reason."""


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
    pma: Files  # counters/ and counters_ext/
    hw: Files


@dataclass(frozen=True)
class _Layout:
    device_hw: Files
    ports: tuple[_PortFiles, ...]


@dataclass
class _Entry:
    """What is known of one class entry while its identity holds (``device`` None: not ours)."""

    identity: tuple
    device: _Device | None
    trusted: _Layout | None = None
    seen: _Layout | None = None


@dataclass
class _Read:
    """One device's reading: its ports, the ports it could not see, and the errors to count."""

    ports: list[RdmaPort] = field(default_factory=list)
    blind: dict[str, str] = field(default_factory=dict)
    errors: list[tuple[str, str]] = field(default_factory=list)

    def count(self, kind: str, message: str) -> None:
        self.errors.append((kind, message))


def parse_state(raw: bytes) -> tuple[int, str] | None:
    """``b"4: ACTIVE\\n"`` -> ``(4, "ACTIVE")``; None for anything else."""
    match = _STATE.match(raw.decode("ascii", "replace"))
    return (int(match.group(1)), match.group(2)) if match else None


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
        self.fault = fault
        self._known: dict[str, _Entry] = {}
        self._files = HeldFiles(self.name)
        self._gpus: dict[str, tuple[str, ...]] | None = None  # the PCI tree's GPUs, this collection

    def collect(self, now: float) -> SourceResult:
        try:
            return self._collect(now)
        finally:
            self._files.sweep()
            self._gpus = None

    def close(self) -> None:
        self._files.close()

    def _collect(self, now: float) -> SourceResult:
        class_dir = host_path(self.host_root, CLASS_DIR)
        try:
            names = sorted((e.name for e in self._scan(class_dir)), key=natural_key)
        except OSError as exc:
            return self._unlisted(class_dir, exc)
        ports: list[RdmaPort] = []
        blind: dict[str, str] = {}
        known: dict[str, _Entry] = {}
        for name in names:
            try:
                entry = self._still_known(class_dir, name) or self._identify(name)
            except _Blind as exc:
                blind[name] = str(exc)
                continue
            if entry is None:
                continue
            known[name] = entry
            if entry.device is not None:
                try:
                    reading = self._read(entry, now)
                except _Gone:
                    known.pop(name)
                    log.info("source=rdma device=%s vanished while being read; not reported this cycle", name)
                    continue
                ports.extend(reading.ports)
                blind.update(reading.blind)
        self._known = known
        devices = len({p.device for p in ports})
        detail = f"{len(ports)} RDMA ports on {devices} devices"
        if blind:
            shown = ", ".join(f"{n} ({blind[n]})" for n in sorted(blind, key=natural_key)[:4])
            more = f" and {len(blind) - 4} more" if len(blind) > 4 else ""
            return self._result(False, f"{detail}; could not be read, so unobserved (not down): {shown}{more}",
                                tuple(ports), tuple(sorted(blind, key=natural_key)))
        return self._result(True, detail if ports else "no RDMA ports outside EFA", tuple(ports))

    def _unlisted(self, class_dir: str, exc: OSError) -> SourceResult:
        """No class directory: no RDMA device (up). One that cannot be listed: down, naming no
        device unobserved, so none can be taken for missing either."""
        if isinstance(exc, FileNotFoundError):
            self._known = {}
            return self._result(True, f"no {CLASS_DIR} (no RDMA devices on this host)", ())
        self.errors.count("unreadable", f"path={class_dir} error={errno_text(exc)}")
        return self._result(False, f"cannot read {CLASS_DIR}: {errno_text(exc)}", ())

    def _result(self, up: bool, detail: str, ports: tuple[RdmaPort, ...], blind: tuple[str, ...] = ()) -> SourceResult:
        health = SourceHealth(source=self.name, up=up, detail=detail, errors=self.errors.snapshot(),
                              unobserved=blind)
        return SourceResult(health=health, rdma=ports)

    # -- filesystem access: every path passes the fault hook ----------------------------------------

    def _touch(self, path: str) -> None:
        if self.fault is not None:
            self.fault(path)

    def _small(self, path: str, held: bool = False) -> bytes:
        self._touch(path)
        return self._files.read(path, READ_LIMIT) if held else read_once(path, READ_LIMIT)

    def _scan(self, path: str) -> list[os.DirEntry]:
        self._touch(path)
        return list(os.scandir(path))

    def _resolve(self, rel: str) -> str:
        return resolve_in_root(self.host_root, rel, self._touch)

    def _text(self, path: str) -> str:
        """A small static attribute's text; "" when absent or unreadable (counted)."""
        try:
            return self._small(path).decode("ascii", "replace").strip()
        except FileNotFoundError:
            return ""
        except OSError as exc:
            self.errors.count("unreadable", f"file={path} error={errno_text(exc)}")
            return ""

    # -- which devices are ours ---------------------------------------------------------------------

    def _still_known(self, class_dir: str, name: str) -> _Entry | None:
        entry = self._known.get(name)
        if entry is None:
            return None
        try:
            self._touch(entry.identity[1])
            if device_identity(os.path.join(class_dir, name), entry.identity[1]) == entry.identity:
                return entry
        except OSError:
            pass  # gone or changed: identified afresh, which counts what deserves counting
        return None

    def _identify(self, name: str) -> _Entry | None:
        """The entry for a class entry: ours (a PCI function not bound to efa), not ours, or None
        when it is gone or has no PCI function or driver (asked again next cycle). Raises
        ``_Blind`` when it is there but its links cannot be followed."""
        rel = f"{CLASS_DIR}/{name}"
        try:
            path = self._resolve(rel)
            pci_dir = self._resolve(os.path.relpath(path, self.host_root) + "/device")
            self._touch(path)
            identity = device_identity(host_path(self.host_root, rel), path)
            driver = os.path.basename(self._resolve(os.path.relpath(pci_dir, self.host_root) + "/driver"))
        except FileNotFoundError:
            return None  # vanished, soft RDMA (no PCI function) or unbound
        except OSError as exc:
            self.errors.count("unreadable", f"device={name} error={errno_text(exc)}")
            raise _Blind(errno_text(exc)) from None
        if driver == EFA_DRIVER:
            return _Entry(identity, None)
        if self._gpus is None:
            self._gpus = gpu_paths(self.host_root)
        device = _Device(name=name, path=path, pci_dir=pci_dir, driver=driver,
                         pci_bus_id=canonical_pci_bus_id(os.path.basename(pci_dir)) or "",
                         board_id=self._text(os.path.join(path, "board_id")),
                         fw_ver=self._text(os.path.join(path, "fw_ver")),
                         hca_type=self._text(os.path.join(path, "hca_type")),
                         gpus=gpus_near(pci_dir, self._gpus))
        return _Entry(identity, device)

    # -- one device -------------------------------------------------------------------------------

    def _read(self, entry: _Entry, now: float) -> _Read:
        """The device's ports: through its trusted listing when it has one (held files), else
        listed afresh (trusted once two listings in a row agree)."""
        device = entry.device
        assert device is not None
        netdevs = self._netdevs(device)
        if entry.trusted is not None:
            reading = _Read()
            try:
                self._read_layout(device, entry.trusted, netdevs, now, reading, held=True)
            except _Stale:
                log.info("source=rdma device=%s a listed file has gone; listing the device again", device.name)
                entry.trusted = entry.seen = None
            else:
                return self._counted(reading)
        layout = self._list(device)
        reading = _Read()
        self._read_layout(device, layout, netdevs, now, reading, held=False)
        entry.trusted = layout if layout == entry.seen else None
        entry.seen = layout
        return self._counted(reading)

    def _counted(self, reading: _Read) -> _Read:
        for kind, message in reading.errors:
            self.errors.count(kind, message)
        return reading

    def _present(self, device: _Device) -> None:
        """After an ENOENT inside the device: raise ``_Gone`` when its directory is gone."""
        try:
            self._touch(device.path)
            if stat.S_ISDIR(os.stat(device.path).st_mode):
                return
        except FileNotFoundError:
            raise _Gone(device.name) from None
        except OSError:
            return  # there but not readable: the reads that failed say so, port by port

    def _files_in(self, directory: str) -> Files:
        """A counter directory's files, sorted and capped; () when it does not exist."""
        try:
            names = sorted(e.name for e in self._scan(directory))[:MAX_COUNTER_FILES]
        except FileNotFoundError:
            return ()
        except OSError as exc:
            self.errors.count("unreadable", f"path={directory} error={errno_text(exc)}")
            return ()
        return tuple((n, os.path.join(directory, n)) for n in names if n not in NOT_COUNTERS)

    def _list(self, device: _Device) -> _Layout:
        ports_dir = os.path.join(device.path, "ports")
        try:
            numbered = sorted((int(e.name), e.path) for e in self._scan(ports_dir) if e.name.isdigit())
        except FileNotFoundError:
            self._present(device)
            numbered = []
        except OSError as exc:
            self.errors.count("unreadable", f"device={device.name} path={ports_dir} error={errno_text(exc)}")
            numbered = []
        ports = []
        for number, path in numbered[:MAX_PORTS]:
            pma = tuple(f for d in PMA_DIRS for f in self._files_in(os.path.join(path, d)))
            ports.append(_PortFiles(number, path, self._text(os.path.join(path, "link_layer")), pma,
                                    self._files_in(os.path.join(path, HW_DIR))))
        return _Layout(self._files_in(os.path.join(device.path, HW_DIR)), tuple(ports))

    def _netdevs(self, device: _Device) -> dict[int, str]:
        """Port number -> network interface (``device/net/*``; by ``dev_port`` when several)."""
        net = os.path.join(device.pci_dir, "net")
        try:
            names = sorted(e.name for e in self._scan(net))[:MAX_NETDEVS]
        except OSError:
            return {}
        if len(names) == 1:
            return {0: names[0]}  # 0: every port of the function
        found: dict[int, str] = {}
        for name in names:
            text = self._text(os.path.join(net, name, "dev_port"))
            if text.isdigit():
                found.setdefault(int(text) + 1, name)
        return found

    def _read_layout(self, device: _Device, layout: _Layout, netdevs: dict[int, str], now: float,
                     reading: _Read, held: bool) -> None:
        device_hw = self._counters(device, layout.device_hw, reading, held)
        for port in layout.ports:
            name = f"{device.name}/{port.number}"
            try:
                state = self._state(device, os.path.join(port.path, "state"), held)
                phys = self._state(device, os.path.join(port.path, "phys_state"), held)
            except _Blind as exc:
                reading.count("unreadable" if "parse" not in str(exc) else "parse", f"port={name} {exc}")
                reading.blind[name] = str(exc)
                continue
            if state is None or phys is None:
                continue  # the port went away under us: not reported this cycle
            rate_text = self._rate(device, os.path.join(port.path, "rate"), held, reading)
            reading.ports.append(RdmaPort(
                device=device.name, port=port.number, state_id=state[0], state=state[1],
                phys_state_id=phys[0], phys_state=phys[1], link_layer=port.link_layer,
                rate_gbps=parse_rate(rate_text), rate_text=rate_text, pci_bus_id=device.pci_bus_id,
                driver=device.driver, board_id=device.board_id, fw_ver=device.fw_ver, hca_type=device.hca_type,
                netdev=netdevs.get(port.number, netdevs.get(0, "")), gpus=device.gpus,
                counters=self._counters(device, port.pma, reading, held),
                hw_counters={**device_hw, **self._counters(device, port.hw, reading, held)}, timestamp=now))
        self._present(device)

    def _existing(self, device: _Device, path: str, held: bool) -> bytes | None:
        """A port file's bytes; None when it is gone from a fresh listing (``_Gone`` when the whole
        device went); ``_Stale`` when it is gone from a trusted one. Other errors are raised."""
        try:
            return self._small(path, held)
        except FileNotFoundError:
            if held:
                raise _Stale(path) from None
            self._present(device)
            return None

    def _state(self, device: _Device, path: str, held: bool) -> tuple[int, str] | None:
        """A state file as (number, words); None when the port is gone; ``_Blind`` when it cannot
        be read or understood."""
        try:
            raw = self._existing(device, path, held)
        except OSError as exc:
            raise _Blind(f"{errno_text(exc)} reading {os.path.basename(path)}") from None
        if raw is None:
            return None
        parsed = parse_state(raw)
        if parsed is None:
            raise _Blind(f"parse: {os.path.basename(path)} reads {raw[:32]!r}")
        return parsed

    def _rate(self, device: _Device, path: str, held: bool, reading: _Read) -> str:
        try:
            raw = self._existing(device, path, held)
        except OSError as exc:
            reading.count("unreadable", f"file={path} error={errno_text(exc)}")
            return ""
        return "" if raw is None else raw.decode("ascii", "replace").strip()

    def _counters(self, device: _Device, files: Files, reading: _Read, held: bool) -> dict[str, int]:
        values: dict[str, int] = {}
        for name, path in files:
            if not _NAME.match(name):
                reading.count("parse", f"file={path!r} is not a counter name")
                continue
            try:
                raw = self._existing(device, path, held)
            except OSError as exc:
                reading.count("unreadable", f"file={path} error={errno_text(exc)}")
                continue
            if raw is None:
                continue
            value = parse_counter(raw)
            if value is not None:
                values[name] = value
            elif not raw.lstrip().startswith(b"N/A"):  # "N/A (no PMA)": no counter, no error
                reading.count("parse", f"file={path} value={raw[:32]!r}")
        return values
