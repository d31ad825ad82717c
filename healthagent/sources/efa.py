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
rest of that device is still reported.

**Gone or unobserved.** Only ENOENT says a device is gone (its class entry, its PCI function or
its directory no longer exists). Any other error where the device itself is read says nothing
about the device: EACCES for an agent without CAP_DAC_OVERRIDE, EIO from a device whose driver
cannot answer, and just as much ELOOP (a looping class or ``device`` link), ENOTDIR (a file where
a directory of the path belongs) or EISDIR. The real driver makes none of the last ones, so a tree
that shows them was changed by someone, and whatever hides a device cannot prove it gone. Such a
device is *unobserved*, named in ``SourceHealth.unobserved`` with the errno, counted
(``unreadable``) and logged with it, and the source reports down (``source_up`` 0, the alert says
which device and why) while it still reports every device it could read. Policy counts an
unobserved device as present, never as missing, so neither a permission problem nor a broken link
can ever taint a node. Where the device is read: its identity
(class link, ``device`` link, vendor, device id, driver), the listing of its ports and counter
directories, and its counters as a whole (a device none of whose counter files can be read,
whatever the errno); one bad counter file among readable ones is only that counter, absent and
counted.

This runs every 10 s over ~32 devices x ~40 files, so it uses ``os.scandir``, and the sysfs files
of a device whose listing is trusted (below) are held open and read with one ``pread`` each
(``sysfs_files.HeldFiles``: reopened when their device is unregistered, let go when a collection
no longer reads them); any other file is one small ``os.read``.

What cannot change while a device exists is kept between cycles (``_Known``): whether it is an EFA
(vendor, device id, driver), its canonical PCI id, its resolved directory, and the listing of its
ports and counter directories. A cycle then reads only the counter values and the port state. The
cache is keyed by the device's identity - the class link's target, the device directory's
(st_dev, st_ino, st_ctime_ns) and its ``device`` link's target - checked each cycle with three
cheap calls; sysfs (kernfs) hands out inode numbers cyclically with a generation in the upper
bits, so a device that is unregistered and registered again (driver reload, hot plug) has a new
identity and is resolved from scratch. A listing is trusted only after two reads in a row listed
the same (the kernel adds a device's class link before its attribute files, so one read can catch
a device half-registered), and any file a trusted listing names that has gone drops the cache and
reads the device afresh in the same cycle, with the uncached semantics.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from typing import Callable

from healthagent.model import EFA_NOT_COUNTERS, EfaSample, SourceHealth, canonical_pci_bus_id, natural_key
from healthagent.common import ErrorTally
from healthagent.sources.base import SourceResult, host_path
from healthagent.sources.sysfs_files import HeldFiles, parse_counter, read_once
from healthagent.sources.sysfs_paths import FaultHook, device_identity, errno_text, resolve_in_root

log = logging.getLogger(__name__)

CLASS_DIR = "/sys/class/infiniband"
EFA_VENDOR_ID = 0x1D0F
EFA_DEVICE_ID_PREFIX = "0xefa"
EFA_DRIVER = "efa"
# Enough for any u64 in decimal plus a newline, with room for whitespace the driver never adds.
READ_LIMIT = 64
MAX_PORTS = 16
MAX_COUNTER_FILES = 256
_COUNTER_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class _Vanished(Exception):
    """The device directory disappeared while it was being read."""


class _Stale(Exception):
    """A file a cached listing names has gone: read the device again with fresh listings."""


class _Unreadable(Exception):
    """The device is there but cannot be read (not ENOENT): unobserved, with the reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class _EfaDevice:
    name: str
    path: str  # the device's directory, resolved inside the host root
    pci_bus_id: str


# A counter directory's entries as (file name, path), sorted and capped; () when the directory
# does not exist (this driver keeps no counters there).
Listing = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class _Port:
    number: int
    path: str
    counters: Listing | None


@dataclass(frozen=True)
class _Layout:
    """What a device's directories list: the device counters, the ports and theirs."""

    counters: Listing
    ports: tuple[_Port, ...]


@dataclass
class _Known:
    """What the source knows about one class entry while its identity stays the same.

    ``device`` is None for a device that is not an EFA (another vendor's, or bound to another
    driver): skipped without reading it again. ``layout`` is the trusted listing (seen twice in a
    row), ``seen`` the last one read.
    """

    identity: tuple
    device: _EfaDevice | None
    layout: _Layout | None = None
    seen: _Layout | None = None


class _Deferred:
    """Errors of a read that may be thrown away (a cached read that found its listing stale)."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []

    def count(self, kind: str, message: str) -> None:
        self.errors.append((kind, message))

    def commit(self, tally: ErrorTally) -> None:
        for kind, message in self.errors:
            tally.count(kind, message)


def _read_small(path: str) -> bytes:
    return read_once(path, READ_LIMIT)  # non-blocking: a FIFO must not block the loop


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
        self.fault = fault
        self._known: dict[str, _Known] = {}  # class entry name -> what stays true while it exists
        self._files = HeldFiles(self.name)  # the trusted listings' files, held open between cycles

    # -- the cycle -------------------------------------------------------------------------------

    def collect(self, now: float) -> SourceResult:
        try:
            return self._collect(now)
        finally:
            self._files.sweep()  # close what this collection did not read: a device gone, a new listing

    def _collect(self, now: float) -> SourceResult:
        class_dir = host_path(self.host_root, CLASS_DIR)
        try:
            names = sorted((e.name for e in os.scandir(class_dir)), key=natural_key)
        except FileNotFoundError:
            self._known = {}
            return self._result(True, f"no {CLASS_DIR} (no RDMA devices on this host)", ())
        except OSError as exc:
            self.errors.count("unreadable", f"path={class_dir} error={errno_text(exc)}")
            return self._result(False, f"cannot read {CLASS_DIR}: {errno_text(exc)}", ())
        samples: list[EfaSample] = []
        known: dict[str, _Known] = {}  # only the entries listed now: the cache cannot outgrow sysfs
        unobserved: dict[str, str] = {}  # there, but not readable: never "missing" (module docstring)
        for name in names:
            try:
                entry = self._still_known(class_dir, name) or self._identify(name)
                if entry is None:
                    continue
                known[name] = entry
                if entry.device is None:
                    continue
                samples.extend(self._read(entry, now))
            except _Vanished:
                known.pop(name, None)
                log.info("source=efa device=%s vanished while being read; not reported this cycle", name)
            except _Unreadable as exc:
                known.pop(name, None)
                unobserved[name] = exc.reason
        self._known = known
        devices = len({s.device for s in samples})
        if unobserved:
            return self._result(False, _blind_detail(devices, unobserved), tuple(samples), tuple(unobserved))
        if devices == 0:
            return self._result(True, "no EFA devices", ())
        return self._result(True, f"{devices} EFA devices", tuple(samples))

    def close(self) -> None:
        """Close the counter files held open between cycles."""
        self._files.close()

    def _result(self, up: bool, detail: str, samples: tuple[EfaSample, ...],
                unobserved: tuple[str, ...] = ()) -> SourceResult:
        health = SourceHealth(source=self.name, up=up, detail=detail, errors=self.errors.snapshot(),
                              unobserved=unobserved)
        return SourceResult(health=health, efa=samples)

    # -- filesystem access (every path passes the fault hook) --------------------------------------

    def _touch(self, path: str) -> None:
        if self.fault is not None:
            self.fault(path)

    def _read_small(self, path: str) -> bytes:
        self._touch(path)
        return _read_small(path)

    def _read_file(self, path: str, cached: bool) -> bytes:
        """A file of a trusted listing (``cached``) through a held descriptor, any other opened and
        closed: a device being registered, or one whose listing just changed, holds none."""
        if not cached:
            return self._read_small(path)
        self._touch(path)
        return self._files.read(path, READ_LIMIT)

    def _list(self, path: str) -> list[os.DirEntry]:
        self._touch(path)
        return list(os.scandir(path))

    def _resolve(self, rel: str) -> str:
        return resolve_in_root(self.host_root, rel, self._touch)

    def _read(self, entry: _Known, now: float) -> list[EfaSample]:
        """The device's samples: from its trusted listing when there is one, else listing afresh
        (and trusting the listing once two reads in a row agree)."""
        device = entry.device
        assert device is not None
        if entry.layout is not None:
            deferred = _Deferred()
            try:
                samples, _ = self._read_device(device, now, entry.layout, deferred.count)
            except _Unreadable:
                deferred.commit(self.errors)
                raise
            except _Stale:
                log.info("source=efa device=%s a listed file has gone; listing the device again", device.name)
                entry.layout = entry.seen = None
            else:
                deferred.commit(self.errors)
                return samples
        samples, layout = self._read_device(device, now, None, self.errors.count)
        if layout == entry.seen:
            entry.layout = layout
        entry.seen = layout
        return samples

    # -- which devices are EFA -------------------------------------------------------------------

    def _still_known(self, class_dir: str, name: str) -> _Known | None:
        """The cached entry if the class entry still names the same device directory, else None."""
        entry = self._known.get(name)
        if entry is None:
            return None
        try:
            if self._identity(os.path.join(class_dir, name), entry.identity[1]) == entry.identity:
                return entry
        except OSError:
            pass  # gone or changed: resolved from scratch (which counts what deserves counting)
        return None

    def _identify(self, name: str) -> _Known | None:
        """What the class entry is: an EFA bound to the efa driver (``device`` set), another device
        (``device`` None), or None when it is gone or is no EFA now (vanished, unbound, not backed
        by a PCI function): asked again next cycle. Raises ``_Unreadable`` when it is there but
        cannot be read: then whether it is an EFA is unknown, and so is its health."""
        rel = f"{CLASS_DIR}/{name}"
        try:
            path = self._resolve(rel)
            pci_dir = self._resolve(self._rel(path) + "/device")
            identity = self._identity(host_path(self.host_root, rel), path)
        except FileNotFoundError:
            return None  # vanished, or not backed by a PCI function (rxe, siw): not an EFA
        except OSError as exc:  # a looping or unreadable link hides the device, never shows it gone
            raise self._unreadable("unreadable", name, f"device={name} error={errno_text(exc)}", exc) from None
        try:
            vendor = self._read_small(os.path.join(pci_dir, "vendor")).strip().decode("ascii", "replace")
            dev_id = self._read_small(os.path.join(pci_dir, "device")).strip().decode("ascii", "replace")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._unreadable("unreadable", name, f"device={name} pci={pci_dir} error={errno_text(exc)}",
                                   exc) from None
        try:
            is_efa_id = int(vendor, 16) == EFA_VENDOR_ID and dev_id.lower().startswith(EFA_DEVICE_ID_PREFIX)
        except ValueError:
            raise self._unreadable("parse", name, f"device={name} vendor={vendor[:32]!r} not hex") from None
        if not is_efa_id:
            return _Known(identity, None)
        try:
            driver = os.path.basename(self._resolve(self._rel(pci_dir) + "/driver"))
        except FileNotFoundError:
            return None  # unbound: no driver, no counters
        except OSError as exc:
            raise self._unreadable("unreadable", name, f"device={name} driver link error={errno_text(exc)}",
                                   exc) from None
        if driver != EFA_DRIVER:
            return _Known(identity, None)
        return _Known(identity, _EfaDevice(name=name, path=path,
                                           pci_bus_id=canonical_pci_bus_id(os.path.basename(pci_dir)) or ""))

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.host_root)

    def _identity(self, class_entry: str, device_dir: str) -> tuple:
        self._touch(device_dir)
        return device_identity(class_entry, device_dir)

    def _unreadable(self, kind: str, name: str, message: str, exc: OSError | None = None) -> _Unreadable:
        """Count why a device cannot be read; the exception that makes it unobserved."""
        self.errors.count(kind, message)
        return _Unreadable(errno_text(exc) if exc is not None else message)

    # -- counters ------------------------------------------------------------------------------------

    def _read_device(self, device: _EfaDevice, now: float, layout: _Layout | None,
                     count: Callable[[str, str], None]) -> tuple[list[EfaSample], _Layout]:
        """One sample per port, and the layout read (a listing that fails makes the device
        unobserved: ``_Unreadable``).

        With ``layout`` the listings are not read again, and a file they name that has gone
        raises ``_Stale``; without, each directory is listed, as the uncached source always did.
        """
        cached = layout is not None
        device_counters, listing = self._read_counters(
            device, os.path.join(device.path, "hw_counters"), layout.counters if cached else None, cached, count)
        if cached:
            ports = layout.ports
        else:
            ports_dir = os.path.join(device.path, "ports")
            try:
                numbered = sorted((int(e.name), e.path) for e in self._list(ports_dir) if e.name.isdigit())
            except FileNotFoundError:
                self._check_present(device)
                return [], _Layout(listing, ())  # a device without ports has no port to report
            except OSError as exc:
                count("unreadable", f"device={device.name} path={ports_dir} error={errno_text(exc)}")
                raise _Unreadable(f"{errno_text(exc)} listing its ports") from None
            ports = tuple(_Port(port, port_dir, None) for port, port_dir in numbered[:MAX_PORTS])
        samples = []
        listed: list[_Port] = []
        for port in ports:
            port_counters, port_listing = self._read_counters(
                device, os.path.join(port.path, "hw_counters"), port.counters, cached, count)
            if not cached:
                listed.append(_Port(port.number, port.path, port_listing))
            # Old drivers list every counter in both places: one value per name, never a sum.
            counters = {**device_counters, **port_counters}
            samples.append(EfaSample(
                device=device.name, port=port.number, counters=counters, pci_bus_id=device.pci_bus_id,
                port_state=self._read_text(device, os.path.join(port.path, "state"), cached, count),
                phys_state=self._read_text(device, os.path.join(port.path, "phys_state"), cached, count),
                timestamp=now,
            ))
        self._check_present(device)
        return samples, layout if layout is not None else _Layout(listing, tuple(listed))

    def _read_counters(self, device: _EfaDevice, directory: str, listing: Listing | None, cached: bool,
                       count: Callable[[str, str], None]) -> tuple[dict[str, int], Listing]:
        """The counters in ``directory`` and its listing; raises ``_Unreadable`` when it cannot be
        listed, or not one of its counters read."""
        if listing is None:
            try:
                entries = sorted(e.name for e in self._list(directory))[:MAX_COUNTER_FILES]
            except FileNotFoundError:
                self._check_present(device)
                return {}, ()  # this driver keeps no counters here
            except OSError as exc:
                count("unreadable", f"device={device.name} path={directory} error={errno_text(exc)}")
                raise _Unreadable(f"{errno_text(exc)} listing {os.path.basename(directory)}") from None
            listing = tuple((name, os.path.join(directory, name)) for name in entries)
        counters: dict[str, int] = {}
        failed: list[str] = []  # counter files that answered an error (any but ENOENT)
        attempted = 0
        for name, path in listing:
            if name in EFA_NOT_COUNTERS:
                continue
            if not _COUNTER_NAME.match(name):
                count("parse", f"device={device.name} file={path!r} is not a counter name")
                continue
            attempted += 1
            try:
                raw = self._read_file(path, cached)
            except FileNotFoundError:
                if cached:
                    raise _Stale(path) from None
                self._check_present(device)
                count("unreadable", f"device={device.name} file={path} vanished")
                continue
            except OSError as exc:
                count("unreadable", f"device={device.name} file={path} error={errno_text(exc)}")
                failed.append(errno_text(exc))
                continue
            value = parse_counter(raw)
            if value is None:
                count("parse", f"device={device.name} file={path} value={raw[:32]!r}")
                continue
            counters[name] = value
        if failed and len(failed) == attempted:
            # Not one counter could be read (EIO, EACCES, EISDIR... from every file): nothing is seen.
            raise _Unreadable(f"{failed[0]} reading every counter in {os.path.basename(directory)}")
        return counters, listing

    def _read_text(self, device: _EfaDevice, path: str, cached: bool, count: Callable[[str, str], None]) -> str:
        try:
            return self._read_file(path, cached).decode("ascii", "replace").strip()
        except FileNotFoundError:
            if cached:
                raise _Stale(path) from None
            self._check_present(device)
            return ""
        except OSError as exc:
            count("unreadable", f"device={device.name} file={path} error={errno_text(exc)}")
            return ""

    def _check_present(self, device: _EfaDevice) -> None:
        """After an ENOENT: if the whole device is gone, stop reading it (it is not an error). Only
        ENOENT says gone; a device whose directory cannot be looked at (EACCES, EIO, ELOOP,
        ENOTDIR) or is no directory now is unobserved, never taken for gone: the kernel removes a
        device's directory, it never leaves something else in its place."""
        try:
            self._touch(device.path)
            is_dir = stat.S_ISDIR(os.stat(device.path).st_mode)
        except FileNotFoundError:
            raise _Vanished(device.name) from None
        except OSError as exc:
            raise _Unreadable(f"{errno_text(exc)} looking at its directory") from None
        if not is_dir:
            raise _Unreadable("its directory is not a directory now")


def _blind_detail(devices: int, unobserved: dict[str, str]) -> str:
    """The health detail while devices cannot be read: how many, which, why (bounded)."""
    names = sorted(unobserved, key=natural_key)
    shown = ", ".join(f"{n} ({unobserved[n]})" for n in names[:4]) + (f" and {len(names) - 4} more"
                                                                       if len(names) > 4 else "")
    if any(unobserved[n].startswith(("EACCES", "EPERM")) for n in names):
        fix = ("the agent needs read access to /sys/class/infiniband (run it as root with CAP_DAC_OVERRIDE, "
               "or privileged)")
    else:  # ELOOP, ENOTDIR, EISDIR: the kernel makes none of these; EIO: the driver does not answer
        fix = ("sysfs under /sys/class/infiniband is not as the kernel makes it, or the driver does not "
               "answer: look at those paths on the host")
    return (f"{devices} EFA devices read; {len(names)} could not be read, so they are unobserved (not "
            f"missing): {shown}; {fix}")
