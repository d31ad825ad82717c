"""Builders for policy tests: an 8 x H100 node's GPUs, XID events, EFA samples, collections.

Real records (the frozen dataclasses of healthagent.model), nothing faked: the classifier is pure,
so a test is a sequence of Collections and the verdicts they produce.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from healthagent.model import Collection, EccCounts, EfaSample, GpuSample, SourceHealth, Verdict, XidEvent
from healthagent.policy.catalog import load_catalog
from healthagent.policy.classify import Classifier
from healthagent.policy.settings import Policy, parse_policy

# The PCI ids of a p5.48xlarge's eight H100s, by NVML index.
P5_PCI = ("0000:53:00.0", "0000:64:00.0", "0000:75:00.0", "0000:86:00.0",
          "0000:97:00.0", "0000:a8:00.0", "0000:b9:00.0", "0000:ca:00.0")
T0 = 1_714_557_072.0  # 2024-05-01 09:51:12 UTC


def policy(**thresholds: float) -> Policy:
    return parse_policy({"thresholds": thresholds}) if thresholds else Policy()


def verdict_of(clf: Classifier, collection: Collection) -> Verdict:
    """The verdict of one observation (what most policy tests look at)."""
    return clf.observe(collection).verdict


def classifier(pol: Policy | None = None) -> Classifier:
    pol = pol or Policy()
    return Classifier(pol, load_catalog(pol))


def gpu(index: int, t: float = T0, **fields) -> GpuSample:
    sample = GpuSample(index=index, uuid=f"GPU-{index:08x}-0000-0000-0000-000000000000",
                       pci_bus_id=P5_PCI[index], name="NVIDIA H100 80GB HBM3", timestamp=t,
                       ecc=EccCounts(0, 0, 0, 0))
    return replace(sample, **fields) if fields else sample


def gpus(t: float = T0, count: int = 8, **per_index) -> tuple[GpuSample, ...]:
    """``per_index={3: {"lost": True}}``-style overrides as ``g3={...}`` keywords."""
    return tuple(gpu(i, t, **per_index.get(f"g{i}", {})) for i in range(count))


def xid(number: int, index: int | None = 3, t: float = T0, source: str = "kmsg", message: str = "",
        kind: str = "xid", pci: str | None = None) -> XidEvent:
    pci_id = pci if pci is not None else (P5_PCI[index] if index is not None else "")
    return XidEvent(xid=number, pci_bus_id=pci_id, message=message or f"test xid {number}",
                    line=f"NVRM: Xid (PCI:{pci_id[:-2]}): {number}, {message or 'test'}", timestamp=t,
                    source=source, kind=kind)


def efa(device: str, t: float = T0, **counters: int) -> EfaSample:
    return EfaSample(device=device, port=1, counters=dict(counters), pci_bus_id="", port_state="4: ACTIVE",
                     phys_state="5: LinkUp", timestamp=t)


def collect(t: float, *, gpus: Iterable[GpuSample] = (), xids: Iterable[XidEvent] = (),
            efa: Iterable[EfaSample] = (), boot_id: str = "boot-1", expected_gpus: int | None = None,
            expected_efa_devices: int | None = None, health: Iterable[SourceHealth] = ()) -> Collection:
    return Collection(timestamp=t, gpus=tuple(gpus), xids=tuple(xids), efa=tuple(efa), health=tuple(health),
                      boot_id=boot_id, expected_gpus=expected_gpus, expected_efa_devices=expected_efa_devices)


def codes(verdict) -> list[str]:
    return [f.code for f in verdict.findings]


def only(verdict, code: str):
    found = [f for f in verdict.findings if f.code == code]
    assert len(found) == 1, f"expected one {code}, got {[(f.code, f.subject) for f in verdict.findings]}"
    return found[0]
