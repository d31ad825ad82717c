"""Which GPUs sit behind the same PCIe switch as a network adapter, from the sysfs PCI tree.

Why: on a GPU node each RDMA port serves the GPUs next to it (GPUDirect RDMA goes through the
shared PCIe switch without touching the CPU), so NCCL uses the port beside each GPU. A port that is
down or slow hurts exactly those GPUs' traffic first, and a finding that names them tells the
on-call engineer which ranks are affected.

The kernel's device directory of a PCI function is its path from the root complex:
``/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:02.0/0000:1a:00.0`` is the function
``0000:1a:00.0`` below the root port ``15:01.0``, a switch's upstream port ``16:00.0`` and its
downstream port ``17:02.0``. Two endpoints share a switch when their paths share the root port
*and* the switch's upstream port (two bridges): behind one root port alone, without a switch,
nothing is shared but the CPU's root complex.

Every path is resolved inside the host root (``sysfs_paths.resolve_in_root``), and nothing here
raises: a tree that cannot be read gives no GPUs, which only leaves the evidence shorter.
"""

from __future__ import annotations

import os

from healthagent.model import canonical_pci_bus_id
from healthagent.sources.base import host_path
from healthagent.sources.sysfs_paths import resolve_in_root

PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_VENDOR = 0x10DE
# PCI class codes of a GPU: 0x0300 VGA compatible, 0x0302 3D controller (data-centre GPUs).
# NVSwitches are 0x0680 (bridge, other) and are not GPUs.
GPU_CLASSES = (0x0300, 0x0302)
SHARED_BRIDGES = 2  # a root port and a switch's upstream port
MAX_PCI_FUNCTIONS = 4096  # a bound for a garbage tree; a real node has a few hundred


def ancestors(device_dir: str) -> tuple[str, ...]:
    """The canonical PCI ids on the path of a resolved PCI function directory, root port first,
    the function itself last (components that are not PCI ids, like ``pci0000:15``, are left out)."""
    ids = []
    for part in device_dir.split(os.sep):
        pci = canonical_pci_bus_id(part) if part.count(":") == 2 else None
        if pci is not None:
            ids.append(pci)
    return tuple(ids)


def share_switch(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether two functions (``ancestors`` of each) sit behind one PCIe switch."""
    shared = 0
    for x, y in zip(a[:-1], b[:-1]):
        if x != y:
            break
        shared += 1
    return shared >= SHARED_BRIDGES


def _hex_file(path: str) -> int | None:
    try:
        with open(path, "rb") as fh:
            return int(fh.read(32).strip(), 16)
    except (OSError, ValueError):
        return None


def gpu_paths(host_root: str) -> dict[str, tuple[str, ...]]:
    """Every NVIDIA GPU function in the host's PCI tree: canonical id -> its ``ancestors``."""
    directory = host_path(host_root, PCI_DEVICES)
    try:
        names = sorted(os.listdir(directory))[:MAX_PCI_FUNCTIONS]
    except OSError:
        return {}
    found: dict[str, tuple[str, ...]] = {}
    for name in names:
        rel = f"{PCI_DEVICES}/{name}"
        try:
            resolved = resolve_in_root(host_root, rel)
        except OSError:
            continue
        if _hex_file(os.path.join(resolved, "vendor")) != NVIDIA_VENDOR:
            continue
        klass = _hex_file(os.path.join(resolved, "class"))
        if klass is None or (klass >> 8) not in GPU_CLASSES:
            continue
        pci = canonical_pci_bus_id(name)
        if pci is not None:
            found[pci] = ancestors(resolved)
    return found


def gpus_near(function_dir: str, gpus: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The GPUs of ``gpus`` behind the same PCIe switch as the function at ``function_dir``."""
    mine = ancestors(function_dir)
    return tuple(sorted(pci for pci, path in gpus.items() if share_switch(mine, path)))
