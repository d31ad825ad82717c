"""Which DRA device is which GPU: the agent's node's ResourceSlices read into a map.

Built against NVIDIA's DRA driver for GPUs as released (kubernetes-sigs/dra-driver-nvidia-gpu
v0.4.1, cmd/gpu-kubelet-plugin): the driver is ``gpu.nvidia.com``; its pool is named after the
node (``driver.go``: ``Pools: {nodeName: ...}``); a full GPU is the device ``gpu-<minor>`` (the
device node's minor number, not NVML's index: ``deviceinfo.go`` ``CanonicalName``) with the
string attributes ``type`` (``gpu``; ``mig`` and ``vfio`` devices are others), ``uuid`` (NVML's
``GPU-...``), ``productName`` and the standard ``resource.kubernetes.io/pciBusID``
(``dddd:bb:dd.f``, from ``k8s.io/dynamic-resource-allocation/deviceattribute``). The driver
publishes no ``index`` attribute. A slice that holds only shared counters has no devices.

Why so strict: a device taint on the wrong GPU takes a healthy GPU away and leaves the bad one
in service. A GPU is mapped only when exactly one full-GPU device of the node's pool carries its
UUID and, where both sides name one, the same PCI bus id; anything missing, malformed or claimed
twice leaves it unmapped, and an unmapped GPU falls back to the node (never a guess).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from healthagent.model import canonical_pci_bus_id

NVIDIA_GPU_DRIVER = "gpu.nvidia.com"
DRIVER_VERSION = "v0.4.1"
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
GPU_TYPE = "gpu"
MAX_NAME = 63  # a device name is a DNS label


@dataclass(frozen=True)
class DeviceRef:
    """One published device: what a DeviceTaintRule's selector names."""

    driver: str
    pool: str
    device: str
    uuid: str
    pci_bus_id: str

    @property
    def path(self) -> str:
        return f"{self.driver}/{self.pool}/{self.device}"


@dataclass(frozen=True)
class DeviceMap:
    """The node's GPUs as its DRA driver publishes them; ``skipped``: devices not understood."""

    devices: tuple[DeviceRef, ...] = ()
    skipped: int = 0

    def find(self, uuid: str = "", pci_bus_id: str = "") -> DeviceRef | None:
        """The one device for a GPU named by UUID and/or PCI bus id; None when none or several
        match, or when the two names point at different devices."""
        pci = canonical_pci_bus_id(pci_bus_id) if pci_bus_id else None
        if pci_bus_id and pci is None:
            return None
        hits = [d for d in self.devices
                if (not uuid or d.uuid.lower() == uuid.lower()) and (pci is None or d.pci_bus_id == pci)]
        if not (uuid or pci) or len(hits) != 1:
            return None
        return hits[0]


def _string(attributes: Mapping, name: str) -> str | None:
    value = attributes.get(name)
    if not isinstance(value, dict):
        return None
    text = value.get("string")
    return text if isinstance(text, str) and text else None


def _device(driver: str, pool: str, raw: Any) -> DeviceRef | None:
    if not isinstance(raw, dict):
        return None
    name = raw.get("name")
    attributes = raw.get("attributes")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not isinstance(attributes, dict):
        return None
    if _string(attributes, "type") != GPU_TYPE:
        return None
    uuid = _string(attributes, "uuid")
    raw_pci = _string(attributes, PCI_BUS_ID_ATTRIBUTE)
    pci = canonical_pci_bus_id(raw_pci) if raw_pci else None
    if not uuid or not uuid.startswith("GPU-") or pci is None:
        return None
    return DeviceRef(driver, pool, name, uuid, pci)


def device_map(slices: Iterable[Any], node_name: str, driver: str = NVIDIA_GPU_DRIVER) -> DeviceMap:
    """The full GPUs ``driver`` publishes for ``node_name`` (pool = node name, as the driver
    names it). Slices of another node, driver or pool are ignored; of several generations of a
    pool only the newest counts (the driver replaces a pool's slices by bumping it)."""
    mine = []
    for item in slices:
        spec = item.get("spec") if isinstance(item, dict) else None
        if not isinstance(spec, dict) or spec.get("driver") != driver or spec.get("nodeName") != node_name:
            continue
        pool = spec.get("pool")
        if not isinstance(pool, dict) or pool.get("name") != node_name:
            continue
        generation = pool.get("generation")
        if isinstance(generation, bool) or not isinstance(generation, int):
            continue
        mine.append((generation, spec.get("devices")))
    if not mine:
        return DeviceMap()
    newest = max(g for g, _ in mine)
    found: list[DeviceRef] = []
    skipped = 0
    for generation, devices in mine:
        if generation != newest or not isinstance(devices, list):
            continue
        for raw in devices:
            ref = _device(driver, node_name, raw)
            if ref is None:
                skipped += 1
            else:
                found.append(ref)
    # A UUID, PCI id or name published twice makes every claimant ambiguous: none is mapped.
    keys = [k for d in found for k in (("u", d.uuid.lower()), ("p", d.pci_bus_id), ("n", d.device))]
    twice = {k for k in keys if keys.count(k) > 1}
    unique = tuple(d for d in found if not {("u", d.uuid.lower()), ("p", d.pci_bus_id), ("n", d.device)} & twice)
    return DeviceMap(tuple(sorted(unique, key=lambda d: d.device)), skipped + len(found) - len(unique))
