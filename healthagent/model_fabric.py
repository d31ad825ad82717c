"""The records of what the sysfs sources read off the fabric and the PCIe bus: EFA device ports,
InfiniBand/RoCE ports and PCIe AER statistics. Frozen values every layer may carry, like
``model.py`` (which re-exports them): one job per module keeps the shared records readable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class EfaSample:
    """Counters of one EFA device port (port counters) merged with its device counters.

    ``counters`` holds every integer hw_counter file read, by file name (``lifespan`` excluded: it
    is a cache setting, not a counter). ``port_state``/``phys_state`` are the raw sysfs text; the
    driver hard-codes them, so policy treats a *missing device* as the signal, not the state.
    """

    device: str
    port: int
    counters: Mapping[str, int]
    pci_bus_id: str = ""
    port_state: str = ""
    phys_state: str = ""
    timestamp: float = 0.0


@dataclass(frozen=True)
class RdmaPort:
    """One port of an InfiniBand or RoCE (mlx5 and other non-EFA) RDMA device, as read from sysfs.

    ``state_id``/``phys_state_id`` are the numbers of the kernel's ``"4: ACTIVE"``/``"5: LinkUp"``
    text (``state``/``phys_state`` keep the words); ``rate_gbps`` is the rate file's number
    (``"400 Gb/sec (4X NDR)"`` -> 400.0), None when it could not be read. ``counters`` holds the
    IB PortCounters (``counters/*``, and the older ``counters_ext/*``) by file name, as the file
    says (the data counters in 4-octet words); ``hw_counters`` the driver's own counters
    (``hw_counters/*``: out_of_buffer, np_cnp_sent, ...), the device's merged under the port's.
    ``netdev`` is the port's network interface (``ib0``, ``ens1f0np0``; "" when it has none) and
    ``gpus`` the canonical PCI ids of the GPUs behind the same PCIe switch.
    """

    device: str
    port: int
    state_id: int
    phys_state_id: int
    state: str = ""
    phys_state: str = ""
    link_layer: str = ""  # "InfiniBand" or "Ethernet" (RoCE)
    rate_gbps: float | None = None
    rate_text: str = ""
    pci_bus_id: str = ""
    driver: str = ""
    board_id: str = ""
    fw_ver: str = ""
    hca_type: str = ""
    netdev: str = ""
    gpus: tuple[str, ...] = ()
    counters: Mapping[str, int] = field(default_factory=dict)
    hw_counters: Mapping[str, int] = field(default_factory=dict)
    timestamp: float = 0.0

    @property
    def name(self) -> str:
        """``mlx5_0/1``: the port as findings, logs and people name it."""
        return f"{self.device}/{self.port}"

    @property
    def up(self) -> bool:
        """ACTIVE (or ACT_DEFER) and the physical link up (or recovering from an error)."""
        return self.state_id in (4, 5) and self.phys_state_id in (5, 6)


@dataclass(frozen=True)
class PcieAerSample:
    """The PCIe AER statistics of one PCI function (a GPU's, or an RDMA adapter's), from its
    ``aer_dev_correctable``/``aer_dev_nonfatal``/``aer_dev_fatal`` files.

    ``correctable``/``nonfatal``/``fatal`` are the files' TOTAL lines (error messages of that
    severity since the function was enumerated); None: the file is absent (no AER on this function
    or kernel), unreadable or not what the kernel writes. ``errors`` holds the non-zero counts by
    ``severity:name`` (``fatal:CmpltTO``), for the evidence. ``role`` is ``gpu`` or ``nic``;
    ``device`` the RDMA device's name for a NIC (``mlx5_0``, ``rdmap79s0``).
    """

    pci_bus_id: str
    role: str
    device: str = ""
    correctable: int | None = None
    nonfatal: int | None = None
    fatal: int | None = None
    errors: Mapping[str, int] = field(default_factory=dict)
    timestamp: float = 0.0
