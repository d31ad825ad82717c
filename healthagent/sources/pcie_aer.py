"""PCIe AER statistics of the GPUs' and the RDMA adapters' PCI functions, from sysfs.

What is read: for each NVIDIA GPU function (vendor 0x10de, a display class: ``pci_topology``) and
each PCI function behind ``/sys/class/infiniband/<dev>/device`` (EFA, InfiniBand, RoCE), the
three files ``/sys/bus/pci/devices/<id>/aer_dev_correctable``, ``aer_dev_nonfatal`` and
``aer_dev_fatal`` (``sysfs_values.parse_aer_stats`` says what the kernel writes there). The
counts are cumulative since the function was enumerated; policy turns them into growth
(``policy/counters.py``: a smaller number is a new baseline, never a fault).

**Unobserved, never healthy, never faulty.** A file that does not exist says the function or the
kernel has no AER statistics (no ``CONFIG_PCIEAER``, a function without the capability): that
severity is absent, nothing is counted. Any other error (EACCES, EIO, ELOOP) makes the function
unobserved (``0000:1a:00.0/aer_dev_fatal`` in ``SourceHealth.unobserved``, counted
``unreadable``, the source down) and its other files are still read. Text the kernel cannot
write (a garbage line, a missing TOTAL, a count past ``AER_MAX_COUNT`` such as 2**64-1) is
ignored and counted ``parse``: never a count, so never growth.

**Bounds.** At most ``MAX_FUNCTIONS`` functions are read per collection (GPUs first, then the
adapters in natural order); the rest are named unobserved and counted ``too_many``. The PCI
tree is scanned for GPUs only when its listing changes (a hot plug, a rescan), not every cycle.
"""

from __future__ import annotations

import errno
import os

from healthagent.common import ErrorTally
from healthagent.model import PcieAerSample, SourceHealth, canonical_pci_bus_id, natural_key
from healthagent.sources.base import SourceResult, host_path
from healthagent.sources.pci_topology import MAX_PCI_FUNCTIONS, PCI_DEVICES, gpu_paths
from healthagent.sources.sysfs_files import read_once
from healthagent.sources.sysfs_paths import errno_text, resolve_in_root
from healthagent.sources.sysfs_values import AER_FILES, parse_aer_stats

CLASS_DIR = "/sys/class/infiniband"
MAX_FUNCTIONS = 64  # a p5 has 8 GPUs and 32 EFA functions; a DGX 8 GPUs and about a dozen adapters
MAX_RDMA_ENTRIES = 64
READ_LIMIT = 4096  # 33 lines of at most 60 bytes each fit well within it
TOO_MANY = "too_many"


class PcieAerSource:
    """Reads the AER statistics of the GPUs' and RDMA adapters' functions (module docstring)."""

    name = "pcie_aer"

    def __init__(self, host_root: str = "/") -> None:
        self.host_root = os.path.abspath(host_root)
        self.errors = ErrorTally(self.name)
        self._listing: tuple[str, ...] | None = None
        self._gpus: tuple[str, ...] = ()

    def collect(self, now: float) -> SourceResult:
        functions = self._functions()
        if functions is None:
            return self._result(False, f"cannot list {PCI_DEVICES}", (), ())
        blind: dict[str, str] = {}
        if len(functions) > MAX_FUNCTIONS:
            left_out = functions[MAX_FUNCTIONS:]
            self.errors.count(TOO_MANY, f"functions={len(functions)} read={MAX_FUNCTIONS}: the rest are not "
                                        f"read (unobserved)", n=len(left_out))
            blind.update(dict.fromkeys((pci for pci, _, _, _ in left_out),
                                       f"past the first {MAX_FUNCTIONS} functions (not read)"))
            functions = functions[:MAX_FUNCTIONS]
        samples = []
        for pci, role, device, path in functions:
            sample = self._read(pci, role, device, path, now, blind)
            if sample is not None:
                samples.append(sample)
        with_aer = sum(1 for s in samples if (s.correctable, s.nonfatal, s.fatal) != (None, None, None))
        detail = f"AER statistics of {with_aer} of {len(functions)} PCI functions (GPUs and RDMA adapters)"
        if blind:
            return self._result(False, f"{detail}; unobserved, not faulty: {len(blind)}", tuple(samples),
                                tuple(blind))
        return self._result(True, detail, tuple(samples), ())

    def close(self) -> None:
        """Nothing is held between collections."""

    def _result(self, up: bool, detail: str, samples: tuple[PcieAerSample, ...],
                blind: tuple[str, ...]) -> SourceResult:
        health = SourceHealth(source=self.name, up=up, detail=detail, errors=self.errors.snapshot(),
                              unobserved=tuple(sorted(blind, key=natural_key)))
        return SourceResult(health=health, aer=samples)

    # -- which functions -----------------------------------------------------------------------------

    def _functions(self) -> list[tuple[str, str, str, str]] | None:
        """(canonical PCI id, role, RDMA device name, its directory below the host root) of every
        function to read: GPUs, then the RDMA adapters; None when the PCI device directory cannot
        be listed at all."""
        directory = host_path(self.host_root, PCI_DEVICES)
        try:
            listing = tuple(sorted(os.listdir(directory))[:MAX_PCI_FUNCTIONS])
        except FileNotFoundError:
            listing = ()
        except OSError as exc:
            self.errors.count("unreadable", f"path={directory} error={errno_text(exc)}")
            return None
        if listing != self._listing:  # a hot plug or a rescan: find the GPUs again
            self._listing = listing
            self._gpus = tuple(sorted(gpu_paths(self.host_root), key=natural_key)) if listing else ()
        found = [(pci, "gpu", "", f"{PCI_DEVICES}/{pci}") for pci in self._gpus]
        seen = set(self._gpus)
        for name, pci in self._adapters():
            if pci not in seen:
                seen.add(pci)
                found.append((pci, "nic", name, f"{CLASS_DIR}/{name}/device"))
        return found

    def _adapters(self) -> list[tuple[str, str]]:
        """(RDMA device name, canonical PCI id) of every class entry backed by a PCI function."""
        class_dir = host_path(self.host_root, CLASS_DIR)
        try:
            names = sorted(os.listdir(class_dir), key=natural_key)[:MAX_RDMA_ENTRIES]
        except OSError:
            return []  # no RDMA devices, or the RDMA sources report why they cannot list them
        out = []
        for name in names:
            try:
                resolved = resolve_in_root(self.host_root, f"{CLASS_DIR}/{name}/device")
            except OSError:
                continue  # a soft device (rxe, siw) has no PCI function; the RDMA sources judge the rest
            pci = canonical_pci_bus_id(os.path.basename(resolved))
            if pci is not None:
                out.append((name, pci))
        return out

    # -- one function ------------------------------------------------------------------------------

    def _read(self, pci: str, role: str, device: str, path: str, now: float,
              blind: dict[str, str]) -> PcieAerSample | None:
        try:
            base = resolve_in_root(self.host_root, path)
        except FileNotFoundError:
            return None  # gone since it was listed
        except OSError as exc:
            self.errors.count("unreadable", f"path={path} error={errno_text(exc)}")
            blind[pci] = errno_text(exc)
            return None
        totals: dict[str, int | None] = {}
        errors: dict[str, int] = {}
        for severity, file_name in AER_FILES.items():
            totals[severity] = None
            file_path = os.path.join(base, file_name)
            try:
                raw = read_once(file_path, READ_LIMIT)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    continue  # no AER statistics for this severity: absent, not an error
                self.errors.count("unreadable", f"path={file_path} error={errno_text(exc)}")
                blind[f"{pci}/{file_name}"] = errno_text(exc)
                continue
            parsed = parse_aer_stats(raw, severity)
            if parsed is None:
                self.errors.count("parse", f"path={file_path} text={raw[:80]!r}: not what the kernel writes; "
                                           "ignored")
                continue
            totals[severity], named = parsed
            errors.update((f"{severity}:{name}", value) for name, value in named.items())
        return PcieAerSample(pci_bus_id=pci, role=role, device=device, correctable=totals["correctable"],
                             nonfatal=totals["nonfatal"], fatal=totals["fatal"], errors=errors, timestamp=now)
