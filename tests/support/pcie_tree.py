"""A node's PCI functions with their AER statistics under a host root: NVIDIA GPUs (listed in
``/sys/bus/pci/devices`` as the kernel lists them) and RDMA adapters (``/sys/class/infiniband``),
written as the kernel writes them (``healthagent.demo.rdma_tree.write_aer_stats``)."""

from __future__ import annotations

from pathlib import Path

from healthagent.demo.node import pci_function_dir, write_pci_function, write_rdma_device
from healthagent.demo.rdma_tree import write_aer_stats

GPUS = ("0000:1a:00.0", "0000:3a:00.0")
NICS = (("mlx5_0", "0000:4b:00.0"), ("rdmap79s0", "0000:4f:00.0"))


def write_gpu_function(root: Path, pci: str) -> Path:
    """An H100's PCI function, with the ``/sys/bus/pci/devices`` link that lists it."""
    function = write_pci_function(root, pci, vendor="0x10de", device_id="0x2330", driver="nvidia",
                                  class_code="0x030200")
    link = root / "sys" / "bus" / "pci" / "devices" / pci
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(f"../../../devices/{function.parent.name}/{pci}")
    return function


def write_node(root: Path) -> dict[str, Path]:
    """Two GPUs and two adapters (a ConnectX, an EFA), all healthy: PCI id -> function directory."""
    functions = {pci: write_gpu_function(root, pci) for pci in GPUS}
    for name, pci in NICS:
        efa = name.startswith("rdmap")
        write_rdma_device(root, name, pci, device_counters={}, port_counters={},
                          **({} if efa else {"vendor": "0x15b3", "device_id": "0x1021", "driver": "mlx5_core"}))
        functions[pci] = pci_function_dir(root, pci)
    return functions


def set_aer(function: Path, correctable: int = 0, nonfatal: int = 0, fatal: int = 0) -> None:
    write_aer_stats(function, correctable, nonfatal, fatal)
