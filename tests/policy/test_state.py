"""The classifier's memory: export/restore round trips, and garbage that must start clean."""

import json

import pytest

from healthagent.model import Action, RemapState
from tests.support.policy import verdict_of, T0, classifier, collect, efa, gpus, only, xid


def busy_node(clf):
    """A node with one of everything open: an incident, a condition mid-streak, a rate, a lost GPU."""
    verdict_of(clf, collect(T0, gpus=gpus(g2={"remap": RemapState(0, 1, True, False)}),
                        efa=[efa("rdmap79s0", T0, rx_drops=0, no_completion_cmds=0)],
                        xids=[xid(94, t=T0), xid(45, t=T0 + 1)], expected_gpus=8, boot_id="b1"))
    return verdict_of(clf, collect(T0 + 30, gpus=gpus(T0 + 30, count=7, g5={"lost": True}),
                               efa=[efa("rdmap79s0", T0 + 30, rx_drops=900, no_completion_cmds=0)],
                               xids=[xid(45, t=T0 + 29)], expected_gpus=8, boot_id="b1"))


def test_round_trip_gives_the_same_verdicts_afterwards():
    original = classifier()
    before = busy_node(original)
    assert {f.code for f in before.findings} == {
        "GPU_XID", "GPU_ROW_REMAP_PENDING", "EFA_RX_DROPS", "GPU_LOST", "GPU_MISSING"}
    state = json.loads(json.dumps(original.export_state(), allow_nan=False))
    restored = classifier()
    restored.restore_state(state)
    assert restored.export_state() == original.export_state()
    follow_up = collect(T0 + 60, gpus=gpus(T0 + 60, count=7), xids=[xid(94, t=T0 + 59)],
                        efa=[efa("rdmap79s0", T0 + 60, rx_drops=900, no_completion_cmds=1)],
                        expected_gpus=8, boot_id="b1")
    a, b = verdict_of(original, follow_up), verdict_of(restored, follow_up)
    assert a == b
    assert only(b, "GPU_XID").key == only(before, "GPU_XID").key
    assert only(b, "GPU_XID").count == 4


def test_restore_after_a_reboot_clears_reboot_class_on_first_observation():
    clf = classifier()
    busy_node(clf)
    restarted = classifier()
    restarted.restore_state(clf.export_state())
    verdict = verdict_of(restarted, collect(T0 + 900, gpus=gpus(T0 + 900), boot_id="b2", expected_gpus=8,
                                        efa=[efa("rdmap79s0", T0 + 900, rx_drops=0)]))
    assert [(f.code, f.action) for f in verdict.findings] == [("GPU_XID", Action.REPLACE_NODE)]


def test_empty_state_is_a_clean_start_without_complaint():
    clf = classifier()
    clf.restore_state({})
    assert clf.restore_errors == 0
    assert verdict_of(clf, collect(T0, gpus=gpus())).findings == ()


@pytest.mark.parametrize("garbage", [
    None,  # falsy: a clean start, not an error
    [],
    "classifier",
    42,
    {"version": 99},
    {"version": 1, "book": "not a mapping"},
    {"version": 1, "book": {"entries": {"k": {"code": "GPU_XID"}}}},
    {"version": 1, "gpus": {"0000:53:00.0": {"series": {"dbe": {"points": [["x", 1]]}}}}},
    {"version": 1, "incidents": {"recent": {"k": [[1.0]]}}},
    {"version": 1, "known_gpus": ["0000:53:00.0"]},
])
def test_garbage_state_is_counted_and_replaced_by_a_clean_start(garbage):
    clf = classifier()
    busy_node(clf)
    clf.restore_state(garbage)
    assert clf.restore_errors == (1 if garbage else 0)
    assert clf.export_state()["book"]["entries"] == {}
    verdict = verdict_of(clf, collect(T0 + 60, gpus=gpus(T0 + 60), xids=[xid(13, t=T0 + 60)]))
    assert only(verdict, "GPU_XID").action is Action.RESTART_APP
    assert clf.internal_errors == 0
