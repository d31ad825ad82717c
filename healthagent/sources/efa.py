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
rest of that device is still reported. This runs every 10 s over ~32 devices x ~40 files, so it
uses ``os.scandir`` and one small ``os.read`` per file.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from dataclasses import dataclass

from healthagent.model import EfaSample, SourceHealth, canonical_pci_bus_id, natural_key
from healthagent.sources.base import ErrorTally, SourceResult, host_path

log = logging.getLogger(__name__)

CLASS_DIR = "/sys/class/infiniband"
EFA_VENDOR_ID = 0x1D0F
EFA_DEVICE_ID_PREFIX = "0xefa"
EFA_DRIVER = "efa"
NOT_A_COUNTER = frozenset({"lifespan"})
MAX_COUNTER_VALUE = 2**64 - 1
# Enough for any u64 in decimal plus a newline, with room for whitespace the driver never adds.
READ_LIMIT = 64
MAX_SYMLINKS = 40
MAX_PORTS = 16
MAX_COUNTER_FILES = 256
_COUNTER_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class _Vanished(Exception):
    """The device directory disappeared while it was being read."""


@dataclass(frozen=True)
class _EfaDevice:
    name: str
    path: str  # the device's directory, resolved inside the host root
    pci_bus_id: str


def resolve_in_root(root: str, path: str) -> str:
    """Resolve ``path`` (relative to ``root``) following symlinks as if ``root`` were ``/``.

    Absolute link targets restart at ``root`` and ``..`` never climbs above it, so whatever the
    links say, the answer is a path under ``root``. Raises OSError (ELOOP on a link cycle,
    ENOENT/EACCES as the filesystem says) like ``open`` would.
    """
    root = os.path.abspath(root)
    pending = [p for p in path.split("/") if p not in ("", ".")]
    pending.reverse()
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root, *resolved, part)
        st = os.lstat(candidate)
        if not stat.S_ISLNK(st.st_mode):
            resolved.append(part)
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise OSError(errno.ELOOP, "too many levels of symbolic links", candidate)
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = []
        parts = [p for p in target.split("/") if p not in ("", ".")]
        pending.extend(reversed(parts))
    return os.path.join(root, *resolved)


def _read_small(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block the loop
    try:
        return os.read(fd, READ_LIMIT)
    finally:
        os.close(fd)


def parse_counter(raw: bytes) -> int | None:
    """A sysfs counter's text as a non-negative u64, or None for anything else (empty, '-1', 'x')."""
    text = raw.strip()
    if not text or not text.isdigit() or len(text) > 20:
        return None
    value = int(text)
    return value if value <= MAX_COUNTER_VALUE else None


class EfaSource:
    """Reads every EFA device under ``<host_root>/sys/class/infiniband`` once per ``collect``."""

    name = "efa"

    def __init__(self, host_root: str) -> None:
        self.host_root = os.path.abspath(host_root)
        self.errors = ErrorTally(self.name)

    # -- the cycle -------------------------------------------------------------------------------

    def collect(self, now: float) -> SourceResult:
        class_dir = host_path(self.host_root, CLASS_DIR)
        try:
            names = sorted((e.name for e in os.scandir(class_dir)), key=natural_key)
        except FileNotFoundError:
            return self._result(True, f"no {CLASS_DIR} (no RDMA devices on this host)", ())
        except OSError as exc:
            self.errors.count("unreadable", f"path={class_dir} error={exc.strerror}")
            return self._result(False, f"cannot read {CLASS_DIR}: {exc.strerror}", ())
        samples: list[EfaSample] = []
        for name in names:
            device = self._identify(name)
            if device is None:
                continue
            try:
                samples.extend(self._read_device(device, now))
            except _Vanished:
                log.info("source=efa device=%s vanished while being read; not reported this cycle", name)
        devices = len({s.device for s in samples})
        if devices == 0:
            return self._result(True, "no EFA devices", ())
        return self._result(True, f"{devices} EFA devices", tuple(samples))

    def close(self) -> None:
        """Nothing is held open between cycles."""

    def _result(self, up: bool, detail: str, samples: tuple[EfaSample, ...]) -> SourceResult:
        health = SourceHealth(source=self.name, up=up, detail=detail, errors=self.errors.snapshot())
        return SourceResult(health=health, efa=samples)

    # -- which devices are EFA -------------------------------------------------------------------

    def _identify(self, name: str) -> _EfaDevice | None:
        """The device if it is an EFA bound to the efa driver; None for anything else or if gone."""
        rel = f"{CLASS_DIR}/{name}"
        try:
            path = resolve_in_root(self.host_root, rel)
            pci_dir = resolve_in_root(self.host_root, self._rel(path) + "/device")
        except FileNotFoundError:
            return None  # vanished, or not backed by a PCI function (rxe, siw): not an EFA
        except OSError as exc:
            self.errors.count("unreadable", f"device={name} error={exc.strerror}")
            return None
        try:
            vendor = _read_small(os.path.join(pci_dir, "vendor")).strip().decode("ascii", "replace")
            dev_id = _read_small(os.path.join(pci_dir, "device")).strip().decode("ascii", "replace")
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.errors.count("unreadable", f"device={name} pci={pci_dir} error={exc.strerror}")
            return None
        try:
            is_efa_id = int(vendor, 16) == EFA_VENDOR_ID and dev_id.lower().startswith(EFA_DEVICE_ID_PREFIX)
        except ValueError:
            self.errors.count("parse", f"device={name} vendor={vendor!r} not hex")
            return None
        if not is_efa_id:
            return None
        try:
            driver = os.path.basename(resolve_in_root(self.host_root, self._rel(pci_dir) + "/driver"))
        except FileNotFoundError:
            return None  # unbound: no driver, no counters
        except OSError as exc:
            self.errors.count("unreadable", f"device={name} driver link error={exc.strerror}")
            return None
        if driver != EFA_DRIVER:
            return None
        return _EfaDevice(name=name, path=path,
                          pci_bus_id=canonical_pci_bus_id(os.path.basename(pci_dir)) or "")

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.host_root)

    # -- counters ------------------------------------------------------------------------------------

    def _read_device(self, device: _EfaDevice, now: float) -> list[EfaSample]:
        device_counters = self._read_counters(device, os.path.join(device.path, "hw_counters"))
        ports_dir = os.path.join(device.path, "ports")
        try:
            ports = sorted((int(e.name), e.path) for e in os.scandir(ports_dir) if e.name.isdigit())
        except FileNotFoundError:
            self._check_present(device)
            return []  # a device without ports has no port to report
        except OSError as exc:
            self.errors.count("unreadable", f"device={device.name} path={ports_dir} error={exc.strerror}")
            return []
        samples = []
        for port, port_dir in ports[:MAX_PORTS]:
            port_counters = self._read_counters(device, os.path.join(port_dir, "hw_counters"))
            # Old drivers list every counter in both places: one value per name, never a sum.
            counters = {**device_counters, **port_counters}
            samples.append(EfaSample(
                device=device.name, port=port, counters=counters, pci_bus_id=device.pci_bus_id,
                port_state=self._read_text(device, os.path.join(port_dir, "state")),
                phys_state=self._read_text(device, os.path.join(port_dir, "phys_state")),
                timestamp=now,
            ))
        self._check_present(device)
        return samples

    def _read_counters(self, device: _EfaDevice, directory: str) -> dict[str, int]:
        try:
            entries = [e.name for e in os.scandir(directory)]
        except FileNotFoundError:
            self._check_present(device)
            return {}  # this driver keeps no counters here
        except OSError as exc:
            self.errors.count("unreadable", f"device={device.name} path={directory} error={exc.strerror}")
            return {}
        counters: dict[str, int] = {}
        for name in sorted(entries)[:MAX_COUNTER_FILES]:
            if name in NOT_A_COUNTER:
                continue
            path = os.path.join(directory, name)
            if not _COUNTER_NAME.match(name):
                self.errors.count("parse", f"device={device.name} file={path!r} is not a counter name")
                continue
            try:
                raw = _read_small(path)
            except FileNotFoundError:
                self._check_present(device)
                self.errors.count("unreadable", f"device={device.name} file={path} vanished")
                continue
            except OSError as exc:
                self.errors.count("unreadable", f"device={device.name} file={path} error={exc.strerror}")
                continue
            value = parse_counter(raw)
            if value is None:
                self.errors.count("parse", f"device={device.name} file={path} value={raw[:32]!r}")
                continue
            counters[name] = value
        return counters

    def _read_text(self, device: _EfaDevice, path: str) -> str:
        try:
            return _read_small(path).decode("ascii", "replace").strip()
        except FileNotFoundError:
            self._check_present(device)
            return ""
        except OSError as exc:
            self.errors.count("unreadable", f"device={device.name} file={path} error={exc.strerror}")
            return ""

    def _check_present(self, device: _EfaDevice) -> None:
        """After an ENOENT: if the whole device is gone, stop reading it (it is not an error)."""
        if not os.path.isdir(device.path):
            raise _Vanished(device.name)
