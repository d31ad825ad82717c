"""GPU_MISSING and EFA_DEVICE_MISSING: fewer devices than the node should have, or one seen earlier
that is gone now.

Judged only when the source answered: a GPU source (NVML or dcgm-exporter) or the EFA source that
reported up, or samples without any health entry (tests, replays). A library missing from the pod
or an unreadable sysfs is a source problem (``healthagent_source_up``), not missing hardware, and
must not taint a node. The EFA source reports *up with no devices* when the driver's class
directory is gone, and that is exactly a missing-device fault.
"""

from __future__ import annotations

from typing import Iterator

from healthagent.model import Collection
from healthagent.policy.book import CONDITION, Signal, Where
from healthagent.policy.findings import FINDINGS, gpu_words, steps_for

MAX_KNOWN = 256  # devices remembered by id; a bound for garbage input, far above a real node
GPU_SOURCES = ("nvml", "dcgm")


def source_answered(collection: Collection, sources: tuple[str, ...], have_samples: bool) -> bool:
    health = [h for h in collection.health if h.source in sources]
    if health:
        return any(h.up for h in health)
    return have_samples


def missing(code: str, noun: str, present: dict[str, str], count: int, known: dict[str, str],
            expected: int | None) -> Signal:
    """One node-level condition; ``present``/``known`` map a device id to the words naming it."""
    for key, words in present.items():
        if key in known or len(known) < MAX_KNOWN:
            known[key] = words
    gone = sorted(k for k in known if k not in present)
    short = expected is not None and count < expected
    parts = [f"{count} {noun} read" + (f", expected {expected}" if expected is not None else "")]
    if gone:
        parts.append("not seen any more: " + ", ".join(known[k] for k in gone))
    info = FINDINGS[code]
    return Signal(code=code, where=Where(), bad=short or bool(gone), kind=CONDITION, action=info.action,
                  summary=f"the node: {info.title}", evidence="; ".join(parts), next_steps=steps_for(code),
                  signature=f"{count}/{','.join(gone)}")


def inventory(collection: Collection, known_gpus: dict[str, str], known_efa: dict[str, str]) -> Iterator[Signal]:
    if source_answered(collection, GPU_SOURCES, bool(collection.gpus)):
        present = {g.pci_bus_id: gpu_words(g.index, g.pci_bus_id) for g in collection.gpus if g.pci_bus_id}
        yield missing("GPU_MISSING", "GPUs", present, len(collection.gpus), known_gpus, collection.expected_gpus)
    if source_answered(collection, ("efa",), bool(collection.efa)):
        devices = {s.device: s.device for s in collection.efa if s.device}
        yield missing("EFA_DEVICE_MISSING", "EFA devices", devices, len(devices), known_efa,
                      collection.expected_efa_devices)


def unobserved(collection: Collection) -> tuple[str, ...]:
    """The subsystems this collection could not see (``Verdict.unobserved``), so an empty finding
    list there reads "unknown", never "healthy".

    - ``gpu``: no GPU source (NVML, dcgm-exporter) is up, while GPUs are expected
      (``expected_gpus`` > 0) or a GPU source is configured (it reported a health entry). A
      collection without health entries (tests, replays) that carries GPU samples saw its GPUs.
    - ``efa``: the EFA source reported down (an unreadable sysfs; *no devices* is up).
    - ``kernel_log``: the kernel-log source reported down.
    """
    missing: list[str] = []
    gpu_health = [h for h in collection.health if h.source in GPU_SOURCES]
    gpu_seen = any(h.up for h in gpu_health) or (not gpu_health and bool(collection.gpus))
    if not gpu_seen and (gpu_health or (collection.expected_gpus or 0) > 0):
        missing.append("gpu")
    down = {h.source for h in collection.health if not h.up}
    if "efa" in down:
        missing.append("efa")
    if "kmsg" in down:
        missing.append("kernel_log")
    return tuple(missing)
