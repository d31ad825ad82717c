"""The InfiniBand demo node: a host root shaped like a DGX H100, for ``healthagent demo --fabric ib``.

A DGX H100 has no EFA: its GPUs talk over eight single-port ConnectX-7 InfiniBand cards, one per
GPU behind the same PCIe switch (NCCL's rails), and a dual-port ConnectX-7 in Ethernet mode carries
storage traffic over RoCE. The sysfs tree of those ten ports, with the GPUs' PCI functions beside
them, is ``rdma_tree.build_rdma_tree`` (the tree the RDMA tests read too); around it, what every
demo node has (``node.write_demo_node``): the 8 x H100 NVML scenario, placed at this layout's PCI
ids so NVML and sysfs agree on which GPU sits behind which switch, a DGX's boot in the kernel log,
``proc/`` and the firmware's product name, ``DGXH100``, which names no EC2 instance type, so the
agent's expected GPU count comes from its settings.

``IbDemoNode.pull_cable`` then takes a port down the way a pulled cable or a dead transceiver
does: its files are rewritten in place (atomically), and the adapter's driver logs the cable's
going (``Port module event: module 0, Cable unplugged``, the catalog's ``module_unplugged``); the
agent reads both as it reads a real node's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from healthagent.demo.boot_log import dgx_boot_log
from healthagent.demo.node import DemoNode, write_demo_node
from healthagent.demo.rdma_tree import DOWN, POLLING, Port, RdmaTree, build_rdma_tree
from healthagent.policy.mlx5_catalog import bundled_rows

PRODUCT_NAME = "DGXH100"  # what a DGX H100's firmware says in DMI
IB_CLASS, ETHERNET_CLASS = "0x020700", "0x020000"  # the PCI class of a ConnectX function by its mode
UNPLUGGED = "module_unplugged"  # the mlx5 catalog's row for a cable pulled out of a port's cage
KERNEL_INFO = 6  # the priority mlx5_core logs a plugged or unplugged cable at (dev_info)


def unplugged_line(pci: str, module: int = 0) -> str:
    """The driver's line for a cable pulled from ``module`` of the adapter at ``pci``, in the
    wording the mlx5 catalog holds (so the demo's line is one the agent recognises)."""
    text = next(row["kernel_text"] for row in bundled_rows() if row["event"] == UNPLUGGED)
    return f"mlx5_core {pci}: " + text.replace("%u", str(module))


@dataclass(frozen=True)
class IbDemoNode:
    """A built InfiniBand demo node: ``node`` (GPUs, kernel log, NVML scenario: ``DemoNode``'s
    injections all work) and ``fabric``, its InfiniBand and RoCE ports."""

    node: DemoNode
    fabric: RdmaTree

    def port_beside(self, gpu: int) -> Port:
        """The InfiniBand port behind the same PCIe switch as GPU index ``gpu`` (its NCCL rail)."""
        if not 0 <= gpu < len(self.node.gpu_pci_bus_ids):
            raise IndexError(f"GPU {gpu} does not exist on this node (0..{len(self.node.gpu_pci_bus_ids) - 1})")
        pci = self.node.gpu_pci_bus_ids[gpu]
        return next(port for port in self.fabric.ports if port.gpu == pci)

    def pull_cable(self, device: str, phys_state: str = POLLING) -> str:
        """Take ``device``'s port down as a pulled cable does: the driver logs the cable unplugged
        (the single-port card's module 0), ``state`` reads ``1: DOWN``, ``phys_state`` ``2: Polling``
        (the port looks for a peer; ``3: Disabled`` is a port switched off), and the port's
        ``link_downed`` counter counts the drop. Returns the kernel-log line."""
        pci = next(port.pci for port in self.fabric.ports if port.device == device)
        line = unplugged_line(pci)
        self.node.log_kernel(KERNEL_INFO, line, {"SUBSYSTEM": "pci", "DEVICE": f"+pci:{pci}"})
        self.fabric.set_state(device, DOWN, phys_state)
        self.fabric.bump(device, "link_downed", 1)
        return line


def build_ib_demo_root(root: Path) -> IbDemoNode:
    """Write the InfiniBand demo host root into ``root`` (created; must not already hold a node)."""
    root = Path(root).absolute()
    fabric = build_rdma_tree(root)
    nics = [(port.pci, IB_CLASS if port.link_layer == "InfiniBand" else ETHERNET_CLASS, port.netdev)
            for port in fabric.ports]
    gpus = [port.gpu for port in fabric.ports if port.gpu]
    node = write_demo_node(root, PRODUCT_NAME, [], lambda found, driver: dgx_boot_log(found, nics, driver),
                           gpu_pci_bus_ids=gpus)
    return IbDemoNode(node=node, fabric=fabric)
