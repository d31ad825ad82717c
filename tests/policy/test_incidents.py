"""XID incidents, dedupe across sources, and how long each class of finding drives the verdict."""

import json

import pytest

from healthagent.model import Action
from tests.support.policy import verdict_of, P5_PCI, T0, classifier, collect, gpus, only, policy, xid

REBOOT_154 = "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"


def test_burst_of_40_xids_is_one_incident_with_a_stable_key():
    clf = classifier()
    keys = set()
    for i in range(40):  # one XID per cycle, 2 s apart: the key must not move
        burst = [xid(94, t=T0 + 2 * i)] if i % 4 == 0 else [xid(45, t=T0 + 2 * i)]
        verdict = verdict_of(clf, collect(T0 + 2 * i, gpus=gpus(), xids=burst))
        keys.add(only(verdict, "GPU_XID").key)
    finding = only(verdict, "GPU_XID")
    assert len(keys) == 1
    assert finding.xids == (45, 94)
    assert finding.count == 40
    assert finding.action is Action.REPLACE_NODE
    assert (finding.gpu_index, finding.pci_bus_id) == (3, P5_PCI[3])
    assert finding.uuid.startswith("GPU-00000003")
    assert finding.first_seen == T0 and finding.last_seen == T0 + 78
    assert "XID 45 x30, 94 x10 on GPU 3 (0000:86:00.0) between 09:51:12 and 09:52:30 UTC on 2024-05-01" \
        in finding.evidence
    assert "the node must be replaced" in finding.summary
    assert verdict.exit_code == 2


def test_silence_longer_than_quiet_starts_a_new_incident():
    clf = classifier(policy(incident_quiet_seconds=180))
    first = only(verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(13, t=T0)])), "GPU_XID")
    same = only(verdict_of(clf, collect(T0 + 170, gpus=gpus(), xids=[xid(13, t=T0 + 170)])), "GPU_XID")
    assert same.key == first.key and same.count == 2
    verdict = verdict_of(clf, collect(T0 + 400, gpus=gpus(), xids=[xid(13, t=T0 + 400)]))
    incidents = [f for f in verdict.findings if f.code == "GPU_XID"]
    assert len(incidents) == 2
    assert {f.first_seen for f in incidents} == {T0, T0 + 400}
    assert len({f.key for f in incidents}) == 2


def test_incidents_are_per_gpu():
    clf = classifier()
    verdict = verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(13, index=0), xid(13, index=5)]))
    assert sorted(f.pci_bus_id for f in verdict.findings) == [P5_PCI[0], P5_PCI[5]]


def test_most_severe_member_decides_and_application_xid_alone_stays_mild():
    clf = classifier()
    verdict = verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(13), xid(31, t=T0 + 1)]))
    finding = only(verdict, "GPU_XID")
    assert finding.action is Action.RESTART_APP
    assert finding.summary.startswith("the application on GPU 3 (0000:86:00.0) faulted")
    assert verdict.exit_code == 1
    verdict = verdict_of(clf, collect(T0 + 5, gpus=gpus(), xids=[xid(79, t=T0 + 5),
                                                             xid(154, t=T0 + 6, message=REBOOT_154)]))
    finding = only(verdict, "GPU_XID")
    assert finding.xids == (13, 31, 79, 154) and finding.action is Action.REBOOT_NODE


def test_xid154_text_raises_the_incident():
    clf = classifier()
    text = "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
    verdict = verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(13), xid(154, t=T0 + 1, message=text)]))
    finding = only(verdict, "GPU_XID")
    assert finding.action is Action.RESET_GPU
    assert "GPU Reset Required" in finding.evidence


def test_same_xid_from_kmsg_and_nvml_counts_once():
    clf = classifier(policy(xid_dedupe_seconds=10))
    events = [xid(94, t=T0, source="kmsg"), xid(94, t=T0 + 0.5, source="kmsg"),
              xid(94, t=T0 + 3, source="nvml"), xid(94, t=T0 + 3.5, source="nvml")]
    finding = only(verdict_of(clf, collect(T0 + 4, gpus=gpus(), xids=events)), "GPU_XID")
    assert finding.count == 2
    assert "(source: kmsg)" in finding.evidence
    # the NVML copy arriving in the next cycle still pairs with the kernel-log one
    later = verdict_of(clf, collect(T0 + 8, gpus=gpus(), xids=[xid(94, t=T0 + 6, source="kmsg"),
                                                           xid(94, t=T0 + 7, source="nvml")]))
    assert only(later, "GPU_XID").count == 3


def test_nvml_event_without_pci_finds_its_gpu_by_uuid_and_pairs():
    clf = classifier()
    nvml_event = xid(94, index=None, t=T0 + 2, source="nvml")
    nvml_event = nvml_event.__class__(**{**nvml_event.__dict__, "uuid": gpus()[3].uuid, "gpu_index": 3})
    verdict = verdict_of(clf, collect(T0 + 3, gpus=gpus(), xids=[xid(94, t=T0), nvml_event]))
    finding = only(verdict, "GPU_XID")
    assert finding.count == 1 and finding.pci_bus_id == P5_PCI[3]


def test_repeats_beyond_the_dedupe_window_are_counted():
    clf = classifier(policy(xid_dedupe_seconds=2))
    events = [xid(94, t=T0, source="kmsg"), xid(94, t=T0 + 30, source="nvml")]
    assert only(verdict_of(clf, collect(T0 + 31, gpus=gpus(), xids=events)), "GPU_XID").count == 2


def test_xid_without_a_gpu_is_a_node_level_finding():
    clf = classifier()
    verdict = verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(48, index=None)]))
    finding = only(verdict, "GPU_XID")
    assert finding.subject == "node" and finding.gpu_index is None
    assert finding.action is Action.RESET_GPU
    assert "did not name" in finding.summary


def test_unknown_xid_is_monitor_not_dropped():
    finding = only(verdict_of(classifier(), collect(T0, gpus=gpus(), xids=[xid(4242)])), "GPU_XID")
    assert finding.action is Action.MONITOR and finding.xids == (4242,)
    assert "UNKNOWN_XID_4242" in finding.summary


def test_low_class_incident_expires_after_the_window():
    clf = classifier(policy(xid_window_seconds=3600))
    verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(13)]))
    assert verdict_of(clf, collect(T0 + 3500, gpus=gpus(T0 + 3500))).action is Action.RESTART_APP
    assert verdict_of(clf, collect(T0 + 3601, gpus=gpus(T0 + 3601))).findings == ()


def test_old_xid_replayed_by_check_does_not_drive_the_verdict():
    verdict = verdict_of(classifier(), collect(T0 + 5 * 3600, gpus=gpus(), xids=[xid(31, t=T0)]))
    assert verdict.findings == () and verdict.exit_code == 0


def test_reboot_class_stays_until_the_boot_id_changes():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(79)], boot_id="boot-1"))
    later = verdict_of(clf, collect(T0 + 10 * 3600, gpus=gpus(T0 + 10 * 3600), boot_id="boot-1"))
    assert later.action is Action.REBOOT_NODE
    no_boot_id = verdict_of(clf, collect(T0 + 11 * 3600, gpus=gpus(T0 + 11 * 3600), boot_id=""))
    assert no_boot_id.action is Action.REBOOT_NODE  # `check` has no boot id: not a reboot
    after = verdict_of(clf, collect(T0 + 12 * 3600, gpus=gpus(T0 + 12 * 3600), boot_id="boot-2"))
    assert after.findings == ()


def test_replace_class_survives_reboot_until_clear():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(94), xid(79, index=1)], boot_id="boot-1"))
    verdict = verdict_of(clf, collect(T0 + 86400, gpus=gpus(T0 + 86400), boot_id="boot-2"))
    assert [(f.code, f.pci_bus_id, f.action) for f in verdict.findings] == [
        ("GPU_XID", P5_PCI[3], Action.REPLACE_NODE)]
    assert clf.clear(T0 + 86401, "vendor swapped the HBM stack") == 1
    assert verdict_of(clf, collect(T0 + 86402, gpus=gpus(T0 + 86402), boot_id="boot-2")).findings == ()
    fresh = verdict_of(clf, collect(T0 + 86403, gpus=gpus(T0 + 86403), xids=[xid(94, t=T0 + 86403)]))
    assert only(fresh, "GPU_XID").first_seen == T0 + 86403  # a new incident after a clear


def test_replace_class_clears_when_the_gpu_is_physically_replaced():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(95), xid(13, index=0)]))
    swapped = gpus(T0 + 60, g3={"uuid": "GPU-new-board"})
    verdict = verdict_of(clf, collect(T0 + 60, gpus=swapped))
    assert [(f.pci_bus_id, f.xids) for f in verdict.findings] == [(P5_PCI[0], (13,))]


def test_clear_returns_how_many_it_closed_including_replace_class():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(94), xid(13, index=0), xid(79, index=1)]))
    assert clf.clear(T0 + 1, "operator") == 3
    assert clf.clear(T0 + 2, "again") == 0


def test_export_restore_mid_incident_keeps_keys_and_counts():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(94, t=T0 + i) for i in range(5)]))
    before = only(verdict_of(clf, collect(T0 + 6, gpus=gpus(T0 + 6))), "GPU_XID")
    state = json.loads(json.dumps(clf.export_state()))
    restored = classifier()
    restored.restore_state(state)
    verdict = verdict_of(restored, collect(T0 + 20, gpus=gpus(T0 + 20), xids=[xid(94, t=T0 + 19)]))
    after = only(verdict, "GPU_XID")
    assert after.key == before.key
    assert after.count == 6
    assert restored.restore_errors == 0


def test_disabled_xid_rule_and_silenced_xid():
    from healthagent.policy.settings import parse_policy

    silenced = parse_policy({"xid": {43: "none"}})
    assert verdict_of(classifier(silenced), collect(T0, gpus=gpus(), xids=[xid(43)])).findings == ()
    disabled = parse_policy({"disabled_rules": ["GPU_XID"]})
    assert verdict_of(classifier(disabled), collect(T0, gpus=gpus(), xids=[xid(94)])).findings == ()


def test_sxid_incident_uses_its_own_code_and_overrides():
    from healthagent.policy.settings import parse_policy

    clf = classifier(parse_policy({"sxid": {12028: "reboot_node"}}))
    verdict = verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(12028, kind="sxid", pci="0000:05:00.0"),
                                                         xid(11004, kind="sxid", pci="0000:05:00.0")]))
    finding = only(verdict, "NVSWITCH_SXID")
    assert finding.xids == (11004, 12028) and finding.action is Action.REBOOT_NODE
    assert finding.pci_bus_id == "0000:05:00.0" and finding.gpu_index is None
    assert "SXid 11004 x1, 12028 x1 on NVSwitch 0000:05:00.0" in finding.evidence


def test_incidents_per_gpu_are_bounded_mildest_first():
    clf = classifier(policy(max_incidents_per_gpu=3, incident_quiet_seconds=10, xid_window_seconds=10**6))
    verdict_of(clf, collect(T0, gpus=gpus(), xids=[xid(94, t=T0)]))
    for i in range(1, 6):
        verdict_of(clf, collect(T0 + 100 * i, gpus=gpus(T0 + 100 * i), xids=[xid(13, t=T0 + 100 * i)]))
    verdict = verdict_of(clf, collect(T0 + 1000, gpus=gpus(T0 + 1000)))
    kept = sorted((f.first_seen - T0, f.xids) for f in verdict.findings)
    assert kept == [(0.0, (94,)), (400.0, (13,)), (500.0, (13,))]


def test_xid79_from_three_reporters_counts_once():
    clf = classifier()
    events = [xid(79, t=T0, source="kmsg"), xid(79, t=T0, source="kmsg", kind="fallen_off_bus"),
              xid(79, t=T0 + 2, source="nvml")]
    finding = only(verdict_of(clf, collect(T0 + 3, gpus=gpus(), xids=events)), "GPU_XID")
    assert (finding.xids, finding.count, finding.action) == ((79,), 1, Action.REBOOT_NODE)


def test_counted_xids_leave_out_the_second_reporter():
    clf = classifier()
    kmsg, nvml = xid(94, t=T0, source="kmsg"), xid(94, t=T0 + 1, source="nvml")
    assert clf.observe(collect(T0 + 2, gpus=gpus(), xids=[kmsg, nvml])).counted_xids == (kmsg,)
    assert clf.observe(collect(T0 + 3, gpus=gpus())).counted_xids == ()


def folded(number: int, repeats: int, t: float = T0, source: str = "kmsg"):
    """A kernel-log flood of one XID folded into one event that stands for ``repeats`` reports."""
    from dataclasses import replace
    return replace(xid(number, t=t, source=source), repeats=repeats)


def test_a_folded_kernel_log_flood_and_nvmls_single_events_of_it_count_once():
    clf = classifier(policy(xid_dedupe_seconds=10))
    singles = [xid(13, t=T0 + 0.01 * i, source="nvml") for i in range(50)]
    assessment = clf.observe(collect(T0 + 2, gpus=gpus(), xids=[folded(13, 50), *singles]))
    assert only(assessment.verdict, "GPU_XID").count == 50
    assert sum(x.repeats for x in assessment.counted_xids) == 50


def test_nvmls_single_events_first_then_the_folded_flood_counts_once():
    clf = classifier(policy(xid_dedupe_seconds=10))
    singles = [xid(13, t=T0 + 0.01 * i, source="nvml") for i in range(30)]
    first = clf.observe(collect(T0 + 1, gpus=gpus(), xids=singles))
    later = clf.observe(collect(T0 + 2, gpus=gpus(), xids=[folded(13, 30, t=T0 + 0.5)]))
    assert only(later.verdict, "GPU_XID").count == 30
    assert sum(x.repeats for x in first.counted_xids) == 30 and later.counted_xids == ()


def test_a_folded_flood_larger_than_the_other_reporters_counts_what_only_it_saw():
    """NVML's event queue overflowed after 20 of the 50: the other 30 are real and counted."""
    clf = classifier(policy(xid_dedupe_seconds=10))
    singles = [xid(13, t=T0 + 0.01 * i, source="nvml") for i in range(20)]
    assessment = clf.observe(collect(T0 + 2, gpus=gpus(), xids=[*singles, folded(13, 50, t=T0 + 0.5)]))
    assert only(assessment.verdict, "GPU_XID").count == 50
    (kmsg,) = [x for x in assessment.counted_xids if x.source == "kmsg"]
    assert kmsg.repeats == 30


def test_pairing_state_survives_a_restart_in_part():
    """A folded report half paired before a restart pairs its other half after it; an item of
    another shape is refused (the classifier's restore counts it and starts that part clean)."""
    from healthagent.policy.incidents import XidIncidents
    clf = classifier(policy(xid_dedupe_seconds=10))
    clf.observe(collect(T0 + 1, gpus=gpus(), xids=[folded(13, 10), *[xid(13, t=T0 + 0.1, source="nvml")] * 4]))
    saved = json.loads(json.dumps(clf.incidents.to_dict()))
    restored = XidIncidents(clf.incidents.policy, clf.incidents.catalog)
    restored.load(saved)
    assert restored.to_dict() == clf.incidents.to_dict()
    clf.incidents = restored
    after = clf.observe(collect(T0 + 2, gpus=gpus(), xids=[xid(13, t=T0 + 0.2, source="nvml")] * 8))
    assert sum(x.repeats for x in after.counted_xids) == 2  # 6 paired with the rest of the 10
    other = XidIncidents(clf.incidents.policy, clf.incidents.catalog)
    with pytest.raises((IndexError, TypeError, ValueError, AttributeError)):
        other.load({"recent": {"3/xid/94": {"items": [[T0, ["kmsg/xid", "nvml/xid"]]],
                                            "next": {"kmsg/xid": 1}}}, "paired": 1})


def test_a_log_naming_hundreds_of_pci_ids_cannot_grow_the_incidents_without_end():
    """Garbage or a confused driver names a new PCI id in every XID line: the node keeps at most
    MAX_INCIDENTS open incidents, the mildest and oldest dropped first, so the action stays."""
    from healthagent.policy.incidents import MAX_INCIDENTS
    from tests.support.policy import T0, classifier, collect, xid

    clf = classifier()
    ids = [f"0001:{bus:02x}:{dev:02x}.0" for bus in range(40) for dev in range(20)]  # 800 PCI ids
    verdict = None
    for i, pci in enumerate(ids):
        number = 94 if i == 3 else 13  # one replace_node among 799 restart_app
        verdict = clf.observe(collect(T0 + i, xids=[xid(number, index=None, t=T0 + i, pci=pci)])).verdict
    incidents = [f for f in verdict.findings if f.code == "GPU_XID"]
    assert len(incidents) <= MAX_INCIDENTS  # (the shared bound on names folds most of them first)
    assert verdict.action.value == "replace_node"  # the XID 94 incident, the oldest, was kept
