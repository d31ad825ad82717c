"""GPU_MISSING and EFA_DEVICE_MISSING: fewer devices than the node should have, or one seen earlier
that is gone now.

**Unobserved is not missing.** A device is *missing* only when it is positively seen gone: absent
from a listing the source could read (NVML's device count, dcgm-exporter's GPU series, the
``/sys/class/infiniband`` directory). A device the source knows is there but could not read (an
EFA device whose sysfs answers EACCES or EIO, a GPU dcgm-exporter lists without any health field)
is *unobserved*: the source names it in ``SourceHealth.unobserved``; it counts as present for the
expected number, is never "not seen any more", and makes the subsystem unobserved in the verdict
(``unobserved``). A library missing from the pod or an unreadable class directory is a source
problem (``healthagent_source_up``), not missing hardware: nothing is judged. No unobserved part
ever leads to a node action.

Judged when the source answered: a GPU source (NVML or dcgm-exporter) that reported up; the EFA
source when it could list the class directory (up, or down naming the devices it could not read);
or samples without any health entry (tests, replays). The EFA source reports *up with no devices*
when the driver's class directory is gone, and that is exactly a missing-device fault.
"""

from __future__ import annotations

from typing import Iterator

from healthagent.model import Collection
from healthagent.policy.book import CONDITION, Signal, Where
from healthagent.policy.findings import FINDINGS, gpu_words, steps_for

MAX_KNOWN = 256  # devices remembered by id; a bound for garbage input, far above a real node
GPU_SOURCES = ("nvml", "dcgm")
# The finding codes this module's rules produce (each has its row in findings.csv; a test checks both ways).
PRODUCES = ("GPU_MISSING", "EFA_DEVICE_MISSING")


def source_answered(collection: Collection, sources: tuple[str, ...], have_samples: bool,
                    listed: bool = False) -> bool:
    """Did a source of ``sources`` see the devices? Up, or (``listed``) down but naming the devices
    it could not read: it could list them, so a device it does not name is really absent."""
    health = [h for h in collection.health if h.source in sources]
    if health:
        return any(h.up or (listed and h.unobserved) for h in health)
    return have_samples


def unseen(collection: Collection, sources: tuple[str, ...]) -> tuple[str, ...]:
    """The devices the sources of ``sources`` know are there but could not read."""
    return tuple(sorted({name for h in collection.health if h.source in sources for name in h.unobserved}))


def missing(code: str, noun: str, present: dict[str, str], count: int, known: dict[str, str],
            expected: int | None, blind: tuple[str, ...] = ()) -> Signal:
    """One node-level condition; ``present``/``known`` map a device id to the words naming it;
    ``blind`` names the devices there but unreadable: counted as there, never as gone."""
    for key, words in present.items():
        if key in known or len(known) < MAX_KNOWN:
            known[key] = words
    gone = sorted(k for k in known if k not in present and k not in blind)
    short = expected is not None and count + len(blind) < expected
    parts = [f"{count} {noun} read" + (f", {len(blind)} could not be read (unobserved)" if blind else "")
             + (f", expected {expected}" if expected is not None else "")]
    if gone:
        parts.append("not seen any more: " + ", ".join(known[k] for k in gone))
    info = FINDINGS[code]
    return Signal(code=code, where=Where(), bad=short or bool(gone), kind=CONDITION, action=info.action,
                  summary=f"the node: {info.title}", evidence="; ".join(parts), next_steps=steps_for(code),
                  signature=f"{count}+{len(blind)}/{','.join(gone)}")


def inventory(collection: Collection, known_gpus: dict[str, str], known_efa: dict[str, str]) -> Iterator[Signal]:
    if source_answered(collection, GPU_SOURCES, bool(collection.gpus)):
        present = {g.pci_bus_id: gpu_words(g.index, g.pci_bus_id) for g in collection.gpus if g.pci_bus_id}
        up = tuple(h.source for h in collection.health if h.source in GPU_SOURCES and h.up)
        yield missing("GPU_MISSING", "GPUs", present, len(collection.gpus), known_gpus, collection.expected_gpus,
                      unseen(collection, up))
    if source_answered(collection, ("efa",), bool(collection.efa), listed=True):
        devices = {s.device: s.device for s in collection.efa if s.device}
        yield missing("EFA_DEVICE_MISSING", "EFA devices", devices, len(devices), known_efa,
                      collection.expected_efa_devices, unseen(collection, ("efa",)))


def unobserved(collection: Collection) -> tuple[str, ...]:
    """The subsystems this collection could not see (``Verdict.unobserved``), so an empty finding
    list there reads "unknown", never "healthy".

    - ``gpu``: no GPU source (NVML, dcgm-exporter) is up and sees every GPU it lists, while GPUs
      are expected (``expected_gpus`` > 0) or a GPU source is configured (it reported a health
      entry). A collection without health entries (tests, replays) that carries GPU samples saw
      its GPUs.
    - ``efa``: the EFA source reported down (an unreadable class directory, or a device it may
      not read; *no devices* is up).
    - ``rdma``: the InfiniBand/RoCE source reported down (a device or port it may not read).
    - ``kernel_log``: the kernel-log source reported down.
    """
    missing: list[str] = []
    gpu_health = [h for h in collection.health if h.source in GPU_SOURCES]
    gpu_seen = any(h.up and not h.unobserved for h in gpu_health) or (not gpu_health and bool(collection.gpus))
    if not gpu_seen and (gpu_health or (collection.expected_gpus or 0) > 0):
        missing.append("gpu")
    down = {h.source for h in collection.health if not h.up or (h.source in ("efa", "rdma") and h.unobserved)}
    if "efa" in down:
        missing.append("efa")
    if "rdma" in down:
        missing.append("rdma")
    if "kmsg" in down:
        missing.append("kernel_log")
    return tuple(missing)
