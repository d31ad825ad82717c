"""The records of ConnectX (mlx5) adapter events, as the kernel log reports them.

Re-exported by ``healthagent.model`` (import them from there); they live in a module of their own
only to keep ``model`` within its size.

Why a type of its own rather than another ``XidEvent.kind``: an XID is a number NVIDIA's catalog
knows, about a GPU; everything that reads ``XidEvent`` (the incident pairing of the kernel log with
NVML and dcgm, ``enrich_xid`` finding the GPU, ``healthagent_xid_errors_total``, ``classify``'s
one-line-per-XID output, XID 154's recovery text) would have to learn to leave an adapter event
alone, and a missed place would count a cable error as an XID or look for a GPU at a network
card's PCI id. An adapter event shares only the kernel-log plumbing (the readers, the cursor, the
facility check, earlier boots, flood folding), and that plumbing takes either record.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterEvent:
    """One event an mlx5_core (ConnectX) adapter logged, recognised from the driver's own wording.

    ``event`` is the row of ``policy/mlx5_events.csv`` (``fatal_error``, ``module_bad_cable``, ...);
    ``pci_bus_id`` the adapter's PCI function, canonical (``""`` when the line did not name it);
    ``device`` its RDMA device (``mlx5_0``) once policy has matched the PCI id to a port the RDMA
    source read, ``""`` before or when none matches; ``detail`` what varies within one event (the
    module number, the firmware command, the PCI channel state, the fatal sensor). ``seq``/
    ``boot_id``, ``previous_boot`` and ``repeats`` mean what they mean on ``XidEvent``: the record's
    identity, a line from an earlier boot (history, never judged), and how many identical lines a
    folded flood stands for.
    """

    event: str
    pci_bus_id: str
    message: str
    line: str
    timestamp: float
    detail: str = ""
    device: str = ""
    source: str = "kmsg"
    seq: int | None = None
    boot_id: str = ""
    previous_boot: bool = False
    repeats: int = 1


@dataclass(frozen=True)
class AdapterCount:
    """Cumulative mlx5 events seen by this agent for one (adapter, event): the data behind
    ``healthagent_mlx5_events_total``."""

    event: str
    count: int
    pci_bus_id: str = ""
    device: str = ""
