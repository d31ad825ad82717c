"""One reading layer for ``/sys/class/infiniband``: every RDMA sysfs source (EFA, InfiniBand/RoCE)
reads its devices through it, so what it guarantees holds for each of them.

**Gone or unobserved.** Only ENOENT says a device is gone: its class entry, its PCI function or
its directory no longer exists (``Gone``, or no entry at all: the device is simply not reported,
and policy remembers the devices it saw). Every other error says nothing about the device:
EACCES for an agent without CAP_DAC_OVERRIDE, EIO from a driver that cannot answer, and just as
much ELOOP (a looping link), ENOTDIR (a file where a directory belongs) or EISDIR, which the kernel
never makes. Whatever hides a device cannot prove it gone, so the part it hides is *unobserved*
(``Unobserved``: named in ``SourceHealth.unobserved`` with the errno, counted and logged), and a
source never decides "missing" from an error itself. Where the device is read: its identity
(class link, ``device`` link, driver link), the listing of its ports and counter directories, and
its counters as a whole (none of a directory's counter files readable, whatever the errno); one
bad counter file among readable ones is only that counter, absent and counted.

**Values.** What the kernel cannot print is never evidence (``sysfs_values``): a port state
outside its enum makes the port unobserved, a counter past its width is absent and counted
(``parse``).

**Bounds.** A collection reads at most ``MAX_DEVICES`` class entries (in natural order),
``MAX_PORTS_PER_DEVICE`` ports of a device and ``MAX_PORTS`` ports in all. What is past a bound is
not read: the entries and devices left out are named unobserved (so policy never takes them for
missing) and counted as ``too_many`` in ``healthagent_source_errors_total``. The bounds are far
above a real node (a p5 has 32 EFA devices of one port each, a DGX about a dozen InfiniBand and
RoCE ports), so memory, CPU and the series a scrape carries stay bounded whatever the tree holds.

**Held files and identity.** Once two collections in a row list the same files for a device,
those files stay open and are read with one ``pread`` each (``sysfs_files.HeldFiles``); a listed
file that has gone (ENOENT) raises ``Stale``, the read is thrown away (its errors too) and the
device is listed again at once. What cannot change while a device stays registered is cached by
its identity (``sysfs_paths.device_identity``), so a driver reload or hot plug is identified from
scratch. Links are resolved inside the host root (``sysfs_paths.resolve_in_root``).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from healthagent.common import ErrorTally
from healthagent.model import natural_key
from healthagent.sources.base import host_path
from healthagent.sources.sysfs_files import HeldFiles, parse_counter, read_once
from healthagent.sources.sysfs_paths import FaultHook, device_identity, errno_text, resolve_in_root
from healthagent.sources.sysfs_values import U64, kernel_state, no_counter

log = logging.getLogger(__name__)

CLASS_DIR = "/sys/class/infiniband"
MAX_DEVICES = 64  # class entries read per collection
MAX_PORTS_PER_DEVICE = 16  # an adapter has one or two
MAX_PORTS = 64  # ports read per collection, all devices together
MAX_COUNTER_FILES = 256
TOO_MANY = "too_many"  # the error kind of what a bound left out
_COUNTER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")

Files = tuple[tuple[str, str], ...]  # (file name, path), sorted
Device = TypeVar("Device")


class Gone(Exception):
    """The device's directory disappeared while it was being read: not reported this cycle."""


class Stale(Exception):
    """A file a trusted listing names has gone: read the device again with fresh listings."""


class Unobserved(Exception):
    """There, but not readable (any error but ENOENT, or a value the kernel cannot produce)."""

    def __init__(self, reason: str, kind: str = "unreadable") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class NotOurs:
    """What a source's ``identify`` answers for a device another source reads (cached)."""


NOT_OURS = NotOurs()


@dataclass(frozen=True)
class Links:
    """A class entry resolved inside the host root: its directory, PCI function and identity."""

    name: str
    path: str
    pci_dir: str
    identity: tuple


@dataclass
class Entry:
    """What is known of one class entry while its identity holds (``device`` None: not ours);
    ``trusted`` is the listing seen twice in a row, ``seen`` the last one read."""

    name: str
    identity: tuple
    device: Any
    trusted: Any = None
    seen: Any = None


@dataclass
class Reading:
    """One device's read: what it yields, the parts it could not see, and the errors to count
    (only when the read stands: a read through a stale listing is done again)."""

    name: str
    items: list = field(default_factory=list)
    blind: dict[str, str] = field(default_factory=dict)
    errors: list[tuple[str, str]] = field(default_factory=list)

    def count(self, kind: str, message: str) -> None:
        self.errors.append((kind, message))

    def unobserved(self, part: str, exc: Unobserved) -> None:
        self.blind[part] = exc.reason


@dataclass(frozen=True)
class Scan:
    """One collection over the class directory. ``listed`` False: the directory is absent (``up``)
    or cannot be listed (down), and ``detail`` says which."""

    items: tuple = ()
    unobserved: dict[str, str] = field(default_factory=dict)
    listed: bool = True
    up: bool = True
    detail: str = ""


Identify = Callable[[Links], Any]  # a device, NOT_OURS, or None (gone, unbound: asked again next cycle)
ReadDevice = Callable[[Any, Any, Reading], Any]  # (device, trusted layout or None, reading) -> layout


class ClassReader(Generic[Device]):
    """A source's reader of ``<host_root>/sys/class/infiniband``: one ``scan`` per collection.

    One scan at a time (the loop's ``DeadlineSource`` never overlaps two). ``fault`` is a test's
    fault hook (``sysfs_paths.FaultHook``), None in production.
    """

    def __init__(self, source: str, host_root: str, errors: ErrorTally, read_limit: int,
                 fault: FaultHook | None = None) -> None:
        self.source = source
        self.host_root = os.path.abspath(host_root)
        self.errors = errors
        self.read_limit = read_limit
        self.fault = fault
        self.files = HeldFiles(source)
        self.known: dict[str, Entry] = {}  # only the entries listed now: the cache cannot outgrow sysfs
        self._ports_left = MAX_PORTS

    # -- the collection ------------------------------------------------------------------------------

    def scan(self, identify: Identify, read: ReadDevice) -> Scan:
        try:
            return self._scan(identify, read)
        finally:
            self.files.sweep()  # let go of what this collection did not read

    def close(self) -> None:
        self.files.close()

    def _scan(self, identify: Identify, read: ReadDevice) -> Scan:
        class_dir = host_path(self.host_root, CLASS_DIR)
        try:
            names = sorted((e.name for e in self.list_dir(class_dir)), key=natural_key)
        except FileNotFoundError:
            self.known = {}
            return Scan(listed=False, detail=f"no {CLASS_DIR} (no RDMA devices on this host)")
        except OSError as exc:
            self.errors.count("unreadable", f"path={class_dir} error={errno_text(exc)}")
            return Scan(listed=False, up=False, detail=f"cannot read {CLASS_DIR}: {errno_text(exc)}")
        unobserved: dict[str, str] = {}
        if len(names) > MAX_DEVICES:
            left_out = names[MAX_DEVICES:]
            self.errors.count(TOO_MANY, f"path={class_dir} entries={len(names)} read={MAX_DEVICES}: the rest "
                                        f"are not read (unobserved)", n=len(left_out))
            unobserved.update(dict.fromkeys(left_out, f"past the first {MAX_DEVICES} devices (not read)"))
            names = names[:MAX_DEVICES]
        self._ports_left = MAX_PORTS
        items: list = []
        known: dict[str, Entry] = {}
        for name in names:
            try:
                entry = self._still_known(class_dir, name) or self._identify(name, identify)
                if entry is None:
                    continue
                known[name] = entry
                if entry.device is None:
                    continue
                reading = self._read(entry, read)
            except Gone:
                known.pop(name, None)
                log.info("source=%s device=%s vanished while being read; not reported this cycle", self.source, name)
                continue
            except Unobserved as exc:
                known.pop(name, None)  # identified afresh next cycle
                unobserved[name] = exc.reason
                continue
            items.extend(reading.items)
            unobserved.update(reading.blind)
        self.known = known
        return Scan(items=tuple(items), unobserved=unobserved)

    def _read(self, entry: Entry, read: ReadDevice) -> Reading:
        """The device through its trusted listing when it has one (held files), else listed afresh
        (trusted once two listings in a row agree)."""
        name = entry.name
        if entry.trusted is not None:
            reading, ports_left = Reading(name), self._ports_left
            try:
                self._counted(reading, read, entry.device, entry.trusted)
                return reading
            except Stale:
                self._ports_left = ports_left
                log.info("source=%s device=%s a listed file has gone; listing the device again", self.source, name)
                entry.trusted = entry.seen = None
        reading = Reading(name)
        layout = self._counted(reading, read, entry.device, None)
        entry.trusted = layout if layout == entry.seen and getattr(layout, "complete", True) else None
        entry.seen = layout
        return reading

    def _counted(self, reading: Reading, read: ReadDevice, device: Any, layout: Any) -> Any:
        """``read``, counting its errors unless its listing turned out stale (then it is done again)."""
        try:
            result = read(device, layout, reading)
        except Stale:
            raise
        except BaseException:
            self._commit(reading)
            raise
        self._commit(reading)
        return result

    def _commit(self, reading: Reading) -> None:
        for kind, message in reading.errors:
            self.errors.count(kind, message)

    # -- filesystem access: every path passes the fault hook ----------------------------------------

    def touch(self, path: str) -> None:
        if self.fault is not None:
            self.fault(path)

    def read_small(self, path: str, held: bool = False) -> bytes:
        """A small file's bytes: through a held descriptor for a trusted listing (``held``), else
        opened and closed (a device being registered, or one whose listing just changed)."""
        self.touch(path)
        return self.files.read(path, self.read_limit) if held else read_once(path, self.read_limit)

    def list_dir(self, path: str) -> list[os.DirEntry]:
        self.touch(path)
        return list(os.scandir(path))

    def resolve(self, rel: str) -> str:
        return resolve_in_root(self.host_root, rel, self.touch)

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.host_root)

    def unobserved(self, kind: str, message: str, reason: str) -> Unobserved:
        """Count why a device cannot be read; the exception that makes it unobserved."""
        self.errors.count(kind, message)
        return Unobserved(reason, kind)

    # -- which device an entry is ---------------------------------------------------------------------

    def _still_known(self, class_dir: str, name: str) -> Entry | None:
        """The cached entry if the class entry still names the same device directory, else None."""
        entry = self.known.get(name)
        if entry is None:
            return None
        try:
            self.touch(entry.identity[1])
            if device_identity(os.path.join(class_dir, name), entry.identity[1]) == entry.identity:
                return entry
        except OSError:
            pass  # gone or changed: identified afresh, which counts what deserves counting
        return None

    def _identify(self, name: str, identify: Identify) -> Entry | None:
        links = self.links(name)
        if links is None:
            return None
        device = identify(links)
        if device is None:
            return None
        return Entry(name, links.identity, None if device is NOT_OURS else device)

    def links(self, name: str) -> Links | None:
        """The class entry's directory, PCI function and identity; None when it is gone or has no PCI
        function (soft RDMA: rxe, siw); ``Unobserved`` when a link cannot be followed."""
        rel = f"{CLASS_DIR}/{name}"
        try:
            path = self.resolve(rel)
            pci_dir = self.resolve(self.rel(path) + "/device")
            self.touch(path)
            identity = device_identity(host_path(self.host_root, rel), path)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a looping or unreadable link hides the device, never shows it gone
            raise self.unobserved("unreadable", f"device={name} error={errno_text(exc)}", errno_text(exc)) from None
        return Links(name, path, pci_dir, identity)

    def driver(self, links: Links) -> str | None:
        """The PCI function's driver; None when it is unbound (no driver: no counters)."""
        try:
            return os.path.basename(self.resolve(self.rel(links.pci_dir) + "/driver"))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self.unobserved("unreadable", f"device={links.name} driver link error={errno_text(exc)}",
                                  errno_text(exc)) from None

    def identity_file(self, links: Links, path: str) -> str | None:
        """A file that says what the device is (its PCI vendor): None when gone, ``Unobserved``
        on any other error."""
        try:
            return self.read_small(path).strip().decode("ascii", "replace")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self.unobserved("unreadable", f"device={links.name} file={path} error={errno_text(exc)}",
                                  errno_text(exc)) from None

    def text(self, path: str) -> str:
        """A small static attribute's text (``board_id``); "" when absent or unreadable (counted)."""
        try:
            return self.read_small(path).decode("ascii", "replace").strip()
        except FileNotFoundError:
            return ""
        except OSError as exc:
            self.errors.count("unreadable", f"file={path} error={errno_text(exc)}")
            return ""

    # -- inside one device ------------------------------------------------------------------------------

    def present(self, device_path: str) -> None:
        """After an ENOENT inside a device: ``Gone`` when its directory is gone. A directory that
        cannot be looked at, or is no directory now, is ``Unobserved``: the kernel removes a
        device's directory, it never leaves something else in its place."""
        try:
            self.touch(device_path)
            is_dir = stat.S_ISDIR(os.stat(device_path).st_mode)
        except FileNotFoundError:
            raise Gone(device_path) from None
        except OSError as exc:
            raise Unobserved(f"{errno_text(exc)} looking at its directory") from None
        if not is_dir:
            raise Unobserved("its directory is not a directory now")

    def listing(self, device_path: str, directory: str, reading: Reading,
                skip: frozenset[str] = frozenset()) -> Files:
        """A counter directory's counter files, sorted and capped (``skip``: files that are no
        counter, such as ``lifespan``; a name no counter has is counted as ``parse``); () when it
        does not exist (this driver keeps no counters there); ``Unobserved`` when it cannot be
        listed."""
        try:
            names = sorted(e.name for e in self.list_dir(directory))
        except FileNotFoundError:
            self.present(device_path)
            return ()
        except OSError as exc:
            reading.count("unreadable", f"device={reading.name} path={directory} error={errno_text(exc)}")
            raise Unobserved(f"{errno_text(exc)} listing {os.path.basename(directory)}") from None
        if len(names) > MAX_COUNTER_FILES:
            reading.count(TOO_MANY, f"device={reading.name} path={directory} files={len(names)} "
                                    f"read={MAX_COUNTER_FILES}")
        files = []
        for name in names[:MAX_COUNTER_FILES]:
            path = os.path.join(directory, name)
            if not _COUNTER_NAME.match(name):
                reading.count("parse", f"device={reading.name} file={path!r} is not a counter name")
            elif name not in skip:
                files.append((name, path))
        return tuple(files)

    def ports(self, device_path: str, reading: Reading) -> tuple[tuple[int, str], ...]:
        """The device's numbered port directories; () when it has none. ``Unobserved`` when they
        cannot be listed, or there are more than an adapter has (``MAX_PORTS_PER_DEVICE``)."""
        ports_dir = os.path.join(device_path, "ports")
        try:
            numbered = sorted((int(e.name), e.path) for e in self.list_dir(ports_dir) if e.name.isdigit())
        except FileNotFoundError:
            self.present(device_path)
            return ()  # a device without ports has no port to report
        except OSError as exc:
            reading.count("unreadable", f"device={reading.name} path={ports_dir} error={errno_text(exc)}")
            raise Unobserved(f"{errno_text(exc)} listing its ports") from None
        if len(numbered) > MAX_PORTS_PER_DEVICE:
            reading.count(TOO_MANY, f"device={reading.name} ports={len(numbered)} bound={MAX_PORTS_PER_DEVICE}")
            raise Unobserved(f"{len(numbered)} ports, more than the {MAX_PORTS_PER_DEVICE} read of one device",
                             TOO_MANY)
        return tuple(numbered)

    def spend_ports(self, count: int, reading: Reading) -> None:
        """Take ``count`` ports from this collection's ``MAX_PORTS``; ``Unobserved`` (counted
        ``too_many``) when fewer are left: the device is not read."""
        if count > self._ports_left:
            reading.count(TOO_MANY, f"device={reading.name} ports={count} left={self._ports_left} bound={MAX_PORTS}")
            raise Unobserved(f"past the first {MAX_PORTS} ports (not read)", TOO_MANY)
        self._ports_left -= count

    def existing(self, device_path: str, path: str, held: bool) -> bytes | None:
        """A file's bytes; None when it is gone from a fresh listing (``Gone`` when the whole device
        went), ``Stale`` when it is gone from a trusted one. Other errors are raised."""
        try:
            return self.read_small(path, held)
        except FileNotFoundError:
            if held:
                raise Stale(path) from None
            self.present(device_path)
            return None

    def state(self, device_path: str, path: str, held: bool, table: dict[int, str]) -> tuple[int, str] | None:
        """A state file as (number, words); None when it is gone; ``Unobserved`` when it cannot be
        read or reads as nothing the kernel writes (``sysfs_values.kernel_state``)."""
        try:
            raw = self.existing(device_path, path, held)
        except OSError as exc:
            raise Unobserved(f"{errno_text(exc)} reading {os.path.basename(path)}") from None
        if raw is None:
            return None
        parsed = kernel_state(raw, table)
        if parsed is None:
            raise Unobserved(f"parse: {os.path.basename(path)} reads {raw[:32]!r}, not a state the kernel writes",
                             "parse")
        return parsed

    def port_text(self, device_path: str, path: str, held: bool, reading: Reading) -> str:
        """A port file's text (``rate``); "" when gone or unreadable (counted)."""
        try:
            raw = self.existing(device_path, path, held)
        except OSError as exc:
            reading.count("unreadable", f"device={reading.name} file={path} error={errno_text(exc)}")
            return ""
        return "" if raw is None else raw.decode("ascii", "replace").strip()

    def counters(self, device_path: str, files: Files, held: bool, reading: Reading,
                 widths: dict[str, int]) -> dict[str, int]:
        """The counters of ``files`` (a ``listing``) by name, each within its width (``widths``, u64
        when not named). A counter that cannot be read or understood is absent and counted;
        ``Unobserved`` when not one of them could be read (EIO, EACCES, EISDIR... from every file).
        The hot path of every collection: ``existing`` and ``read_small`` inlined."""
        values: dict[str, int] = {}
        failed: list[str] = []
        fault, limit, held_files = self.fault, self.read_limit, self.files
        for name, path in files:
            try:
                if fault is not None:
                    fault(path)
                raw = held_files.read(path, limit) if held else read_once(path, limit)
            except FileNotFoundError:
                if held:
                    raise Stale(path) from None
                self.present(device_path)
                reading.count("unreadable", f"device={reading.name} file={path} vanished")
                continue
            except OSError as exc:
                reading.count("unreadable", f"device={reading.name} file={path} error={errno_text(exc)}")
                failed.append(errno_text(exc))
                continue
            bits = widths.get(name, U64)
            value = parse_counter(raw)
            if value is not None and not value >> bits:  # within its width
                values[name] = value
            elif not no_counter(raw):  # garbage, or past the width: the kernel cannot print it
                reading.count("parse", f"device={reading.name} file={path} value={raw[:32]!r} (a {bits}-bit counter)")
        if failed and len(failed) == len(files):
            raise Unobserved(f"{failed[0]} reading every counter in {os.path.basename(os.path.dirname(files[0][1]))}")
        return values


def blind_detail(read: str, unobserved: dict[str, str], not_what: str) -> str:
    """The health detail while parts cannot be read: how many, which, why (bounded), the fix."""
    names = sorted(unobserved, key=natural_key)
    shown = ", ".join(f"{n} ({unobserved[n]})" for n in names[:4]) + (f" and {len(names) - 4} more"
                                                                       if len(names) > 4 else "")
    if any(unobserved[n].startswith(("EACCES", "EPERM")) for n in names):
        fix = ("the agent needs read access to /sys/class/infiniband (run it as root with CAP_DAC_OVERRIDE, "
               "or privileged)")
    elif all("not read" in unobserved[n] or "read of one device" in unobserved[n] for n in names):
        fix = "more devices or ports than any node has: look at /sys/class/infiniband on the host"
    else:  # ELOOP, ENOTDIR, EISDIR, a value no kernel writes: changed by hand; EIO: the driver does not answer
        fix = ("sysfs under /sys/class/infiniband is not as the kernel makes it, or the driver does not "
               "answer: look at those paths on the host")
    return (f"{read}; {len(names)} could not be read, so they are unobserved ({not_what}): {shown}; {fix}")
