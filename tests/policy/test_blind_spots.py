"""What the verdict could not see (``Verdict.unobserved``), XIDs from earlier boots (counted, never
judged) and NVSwitch SXids by the severity the driver prints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from healthagent.model import Action, SourceHealth, Verdict
from healthagent.policy.catalog import load_catalog, sxid_severity
from healthagent.policy.classify import classify_event
from healthagent.policy.settings import parse_policy
from tests.support.policy import verdict_of, T0, classifier, codes, collect, efa, gpus, only, xid


def up(source: str) -> SourceHealth:
    return SourceHealth(source=source, up=True, detail="ok")


def down(source: str, detail: str = "unavailable: libnvidia-ml.so.1 not found") -> SourceHealth:
    return SourceHealth(source=source, up=False, detail=detail)


# -- unobserved ----------------------------------------------------------------------------------

@pytest.mark.parametrize("health, with_gpus, expected_gpus, unobserved", [
    # NVML asked for and down, nothing else: the GPUs were not seen.
    ([down("nvml"), up("efa"), up("kmsg")], False, None, ("gpu",)),
    ([down("nvml"), up("efa"), up("kmsg")], False, 8, ("gpu",)),
    # dcgm-exporter fills in for a missing NVML: the GPUs were seen.
    ([down("nvml"), up("dcgm"), up("efa"), up("kmsg")], True, 8, ()),
    ([down("nvml"), down("dcgm", "cannot connect"), up("efa"), up("kmsg")], False, None, ("gpu",)),
    # No GPU source configured (--no-nvml) but GPUs expected: still not seen.
    ([up("efa"), up("kmsg")], False, 8, ("gpu",)),
    # No GPU source and no expectation (a CPU node): nothing to see.
    ([up("efa"), up("kmsg")], False, None, ()),
    ([up("efa"), up("kmsg")], False, 0, ()),
    ([up("nvml"), down("efa", "cannot read /sys/class/infiniband: Permission denied"), up("kmsg")],
     True, 8, ("efa",)),
    ([up("nvml"), up("efa"), down("kmsg", "/dev/kmsg not found")], True, 8, ("kernel_log",)),
    ([down("nvml"), down("efa", "x"), down("kmsg", "y")], False, 8, ("efa", "gpu", "kernel_log")),
    # A replay without health entries that carries GPU samples saw its GPUs.
    ([], True, 8, ()),
])
def test_unobserved_names_what_no_source_could_see(health, with_gpus, expected_gpus, unobserved):
    verdict = verdict_of(classifier(), collect(T0, gpus=gpus() if with_gpus else (), health=health,
                                           expected_gpus=expected_gpus))
    assert verdict.unobserved == unobserved
    assert verdict.action is Action.NONE  # an unseen GPU is not a finding either


def test_unseen_gpus_do_not_hide_what_was_seen():
    verdict = verdict_of(classifier(), collect(T0, xids=[xid(94)], health=[down("nvml"), up("efa"), up("kmsg")]))
    assert verdict.unobserved == ("gpu",)
    assert verdict.action is Action.REPLACE_NODE and codes(verdict) == ["GPU_XID"]


def test_verdict_of_stays_backward_compatible():
    assert Verdict.of([], 0).unobserved == ()
    assert Verdict.of([], 0, unobserved=["kernel_log", "gpu", "gpu"]).unobserved == ("gpu", "kernel_log")


# -- earlier boots -------------------------------------------------------------------------------

def test_xids_from_an_earlier_boot_are_counted_never_judged():
    clf = classifier()
    ten_months_ago = T0 - 300 * 86_400
    old = [replace(xid(94, t=ten_months_ago), previous_boot=True),
           replace(xid(79, index=5, t=ten_months_ago + 60), previous_boot=True)]
    seen = clf.observe(collect(T0, gpus=gpus(), xids=old))
    verdict = seen.verdict
    assert verdict.findings == () and verdict.action is Action.NONE
    assert [x.xid for x in seen.earlier_boot_xids] == [94, 79]
    assert seen.counted_xids == ()  # so healthagent_xid_errors_total does not count them
    # The current boot's XIDs in the same batch are judged as ever.
    seen = clf.observe(collect(T0 + 10, gpus=gpus(T0 + 10), xids=[*old, xid(13, t=T0 + 5)]))
    verdict = seen.verdict
    assert only(verdict, "GPU_XID").xids == (13,) and verdict.action is Action.RESTART_APP
    assert [x.xid for x in seen.counted_xids] == [13]
    assert clf.earlier_boot_total == 4


# -- NVSwitch SXids ------------------------------------------------------------------------------

FATAL = "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 10 LTSSM Fault Up"
NON_FATAL = "nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)"
SEVERITY_1 = "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 22013, Severity 1 Engine instance 02 Sub-engine instance 00"
SEVERITY_0 = "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 22013, Severity 0 Engine instance 02 Sub-engine instance 00"
DATA_ONLY = "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 22013, Data {0x00000002, 0x00000002}"


@pytest.mark.parametrize("line, severity", [
    (FATAL, "fatal"), (NON_FATAL, "non-fatal"), (SEVERITY_1, "fatal"), (SEVERITY_0, "non-fatal"),
    (DATA_ONLY, ""), ("", ""), ("NVRM: Xid (PCI:0000:86:00): 94, Contained", ""),
    ("nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20034, FATAL, Link 10", "fatal"),
])
def test_sxid_severity(line, severity):
    assert sxid_severity(line) == severity


def sxid_event(line: str, number: int, pci: str = "0000:c3:00.0"):
    return replace(xid(number, kind="sxid", pci=pci), message=line, line=f"[ 25.9] {line}")


@pytest.mark.parametrize("line, number, action, words", [
    (FATAL, 20034, Action.REBOOT_NODE, "reboot_node: fatal SXid (Fabric Manager guide"),
    (NON_FATAL, 12028, Action.MONITOR, "monitor: non-fatal SXid"),
    (SEVERITY_1, 22013, Action.REBOOT_NODE, "reboot_node: fatal SXid"),
    (DATA_ONLY, 22013, Action.MONITOR, "monitor: SXid without a stated severity"),
])
def test_fatal_sxids_take_the_node_out_non_fatal_ones_are_watched(line, number, action, words):
    verdict = verdict_of(classifier(), collect(T0, gpus=gpus(), xids=[sxid_event(line, number)]))
    finding = only(verdict, "NVSWITCH_SXID")
    assert finding.action is action and verdict.action is action
    assert words in finding.evidence


def test_the_policy_file_overrides_sxids_either_way():
    pol = parse_policy({"sxid": {20034: "monitor", 12028: "reboot_node"}})
    clf = classifier(pol)
    verdict = verdict_of(clf, collect(T0, gpus=gpus(), xids=[sxid_event(FATAL, 20034)]))
    finding = only(verdict, "NVSWITCH_SXID")
    assert finding.action is Action.MONITOR
    assert "fatal SXid; operator override (monitor)" in finding.evidence
    verdict = verdict_of(classifier(pol), collect(T0, gpus=gpus(), xids=[sxid_event(NON_FATAL, 12028, "0000:86:00.0")]))
    assert only(verdict, "NVSWITCH_SXID").action is Action.REBOOT_NODE


def test_classify_output_keeps_its_keys_and_says_the_action():
    catalog = load_catalog(parse_policy({}))
    row = classify_event(sxid_event(FATAL, 20034), catalog)
    assert sorted(row) == ["action", "line", "name", "pci_bus_id", "sxid"]
    assert (row["sxid"], row["name"], row["action"]) == (20034, "SXID_20034", "reboot_node")
    assert classify_event(sxid_event(NON_FATAL, 12028), catalog)["action"] == "monitor"


def test_efa_samples_do_not_count_as_gpu_observation():
    verdict = verdict_of(classifier(), collect(T0, efa=[efa("rdmap79s0")], health=[down("nvml"), up("efa")],
                                           expected_gpus=8))
    assert verdict.unobserved == ("gpu",)
