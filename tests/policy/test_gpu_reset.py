"""A GPU reset that NVML shows (``GpuSample.reset``) closes the findings a reset answers on that
GPU, and only those: a reboot- or replace-class finding, another GPU's and a condition stay."""

from __future__ import annotations

from tests.support.policy import P5_PCI, T0, classifier, collect, gpus, verdict_of, xid

RESET = "the volatile uncorrected ECC count went from 1 to 0"


def _open(verdict) -> list[tuple[str, tuple[int, ...]]]:
    return sorted((f.pci_bus_id, f.xids) for f in verdict.findings if f.code == "GPU_XID")


def test_a_reset_closes_the_reset_class_incident_on_its_gpu_only():
    clf = classifier()
    verdict = verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(48), xid(119, index=5), xid(95, index=1)]))
    assert _open(verdict) == [(P5_PCI[1], (95,)), (P5_PCI[3], (48,)), (P5_PCI[5], (119,))]
    after = verdict_of(clf, collect(T0 + 60, gpus=gpus(T0 + 60, g3={"reset": RESET})))
    assert _open(after) == [(P5_PCI[1], (95,)), (P5_PCI[5], (119,))]  # GPU 3's closed; a replace stays


def test_an_xid_after_the_reset_opens_a_new_finding():
    clf = classifier()
    first = verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(48)]))
    verdict_of(clf, collect(T0 + 60, gpus=gpus(T0 + 60, g3={"reset": RESET})))
    again = verdict_of(clf, collect(T0 + 120, gpus=gpus(T0 + 120), xids=[xid(48, t=T0 + 120)]))
    (old,), (new,) = first.findings, [f for f in again.findings if f.code == "GPU_XID"]
    assert new.key != old.key and new.first_seen == T0 + 120


def test_no_reset_keeps_the_finding():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(48)]))
    assert _open(verdict_of(clf, collect(T0 + 60, gpus=gpus(T0 + 60)))) == [(P5_PCI[3], (48,))]
