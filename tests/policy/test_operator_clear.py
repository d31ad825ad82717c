"""An operator's clear reaches policy as an input (``Collection.operator_clear``), once per token."""

import json
from dataclasses import replace

from healthagent.model import Action
from tests.support.policy import T0, classifier, collect, efa, gpus, only, xid


def test_a_new_token_forgets_every_open_finding_once_and_survives_a_restart():
    clf = classifier()
    assert clf.observe(collect(T0, gpus=gpus(), xids=[xid(94)])).verdict.action is Action.REPLACE_NODE
    cleared = clf.observe(replace(collect(T0 + 60, gpus=gpus(T0 + 60)), operator_clear="ticket-1"))
    assert cleared.cleared == 1 and cleared.verdict.findings == ()
    # the same token again (every cycle carries it while it is on the node) clears nothing new
    clf.observe(collect(T0 + 70, gpus=gpus(T0 + 70), xids=[xid(94, t=T0 + 70)]))
    again = clf.observe(replace(collect(T0 + 80, gpus=gpus(T0 + 80)), operator_clear="ticket-1"))
    assert again.cleared == 0 and again.verdict.action is Action.REPLACE_NODE
    restarted = classifier()
    restarted.restore_state(clf.export_state())
    assert restarted.clear_token == "ticket-1"
    after = restarted.observe(replace(collect(T0 + 90, gpus=gpus(T0 + 90)), operator_clear="ticket-1"))
    assert after.cleared == 0 and after.verdict.action is Action.REPLACE_NODE
    fresh = restarted.observe(replace(collect(T0 + 95, gpus=gpus(T0 + 95)), operator_clear="ticket-2"))
    assert fresh.cleared == 1 and fresh.verdict.findings == ()


def clear(clf, t, token, as_of):
    return clf.observe(replace(collect(t, gpus=gpus(t)), operator_clear=token, operator_clear_as_of=as_of))


def test_an_xid_that_joined_the_cleared_incident_after_the_clear_is_a_new_finding():
    """The effects cleared the verdict of observation ``seen``; before the loop heard of it, XID 94
    came again and joined the open incident. The clear closes the incident as the operator saw it
    and reopens what came after: a new finding, with a new key, at replace_node."""
    clf = classifier()
    seen = clf.observe(collect(T0, gpus=gpus(), xids=[xid(94, t=T0), xid(45, t=T0)])).verdict
    old = only(seen, "GPU_XID")
    late = clf.observe(collect(T0 + 2, gpus=gpus(T0 + 2), xids=[xid(94, t=T0 + 2)])).verdict
    assert only(late, "GPU_XID").key == old.key  # joined the incident the operator is clearing
    after = clear(clf, T0 + 4, "ticket-1", seen.observation)
    assert after.cleared == 1
    new = only(after.verdict, "GPU_XID")
    assert new.key != old.key and new.action is Action.REPLACE_NODE
    assert (new.xids, new.count, new.first_seen) == ((94,), 1, T0 + 2)
    assert "94 x1" in new.evidence and "45" not in new.evidence
    # joins go on into the new incident; a clear of the newest verdict closes it
    more = clf.observe(collect(T0 + 6, gpus=gpus(T0 + 6), xids=[xid(94, t=T0 + 6)])).verdict
    assert only(more, "GPU_XID").key == new.key and only(more, "GPU_XID").count == 2
    assert clear(clf, T0 + 8, "ticket-2", more.observation).verdict.findings == ()


def test_a_clear_keeps_what_was_opened_after_it_and_closes_what_the_operator_saw():
    clf = classifier()
    seen = clf.observe(collect(T0, gpus=gpus(), xids=[xid(94, index=3)])).verdict
    clf.observe(collect(T0 + 1, gpus=gpus(T0 + 1), xids=[xid(79, index=5, t=T0 + 1)]))  # another GPU, after
    after = clear(clf, T0 + 2, "ticket-1", seen.observation)
    assert after.cleared == 1
    (kept,) = after.verdict.findings
    assert (kept.code, kept.gpu_index, kept.xids) == ("GPU_XID", 5, (79,))


def test_a_clear_without_its_cut_off_closes_everything_open():
    """A clear whose verdict is unknown (an older agent's state) closes all, as before."""
    clf = classifier()
    clf.observe(collect(T0, gpus=gpus(), xids=[xid(94)]))
    clf.observe(collect(T0 + 2, gpus=gpus(T0 + 2), xids=[xid(79, index=5, t=T0 + 2)]))
    after = clear(clf, T0 + 4, "ticket-1", None)
    assert after.cleared == 2 and after.verdict.findings == ()


def test_a_flood_after_the_clear_that_outgrew_the_tail_keeps_the_whole_incident():
    """More distinct joins after the clear than the incident remembers: the incident is kept whole
    (a cleared XID counted again), never lost."""
    from healthagent.policy.book import MAX_TAIL

    clf = classifier()
    seen = clf.observe(collect(T0, gpus=gpus(), xids=[xid(94)])).verdict
    for i in range(MAX_TAIL + 1):  # each observation a different XID: one tail item each
        clf.observe(collect(T0 + 1 + i, gpus=gpus(T0 + 1 + i), xids=[xid(13 if i % 2 else 31, t=T0 + 1 + i)]))
    after = clear(clf, T0 + 100, "ticket-1", seen.observation)
    new = only(after.verdict, "GPU_XID")
    assert new.action is Action.REPLACE_NODE and set(new.xids) == {13, 31, 94}
    assert new.key != only(seen, "GPU_XID").key


def test_the_cut_off_survives_a_restart_of_the_classifier():
    clf = classifier()
    seen = clf.observe(collect(T0, gpus=gpus(), xids=[xid(94)])).verdict
    clf.observe(collect(T0 + 2, gpus=gpus(T0 + 2), xids=[xid(94, t=T0 + 2)]))
    restarted = classifier()
    restarted.restore_state(json.loads(json.dumps(clf.export_state())))
    after = clear(restarted, T0 + 4, "ticket-1", seen.observation)
    assert only(after.verdict, "GPU_XID").first_seen == T0 + 2


def test_a_counter_finding_that_recurred_after_the_clear_comes_back_with_a_new_key():
    clf = classifier()
    clf.observe(collect(T0, efa=[efa("rdmap79s0", T0, rx_drops=0)]))
    seen = clf.observe(collect(T0 + 30, efa=[efa("rdmap79s0", T0 + 30, rx_drops=900)])).verdict
    old = only(seen, "EFA_RX_DROPS")
    clf.observe(collect(T0 + 60, efa=[efa("rdmap79s0", T0 + 60, rx_drops=1900)]))
    after = clf.observe(replace(collect(T0 + 61), operator_clear="ticket-1",
                                operator_clear_as_of=seen.observation)).verdict
    new = only(after, "EFA_RX_DROPS")
    assert new.key != old.key and new.first_seen == T0 + 60


def test_an_unreadable_saved_token_adopts_the_next_one_without_clearing():
    """A clear applied twice would wipe faults found since: when the saved token cannot be read,
    the token the node shows is taken as already applied."""
    clf = classifier()
    clf.observe(collect(T0, gpus=gpus(), xids=[xid(94)]))
    state = clf.export_state()
    state["clear_token"] = {"not": "text"}
    restarted = classifier()
    restarted.restore_state(state)
    after = clear(restarted, T0 + 4, "ticket-1", None)
    assert after.cleared == 0 and only(after.verdict, "GPU_XID").action is Action.REPLACE_NODE
    assert restarted.restore_errors == 1
    assert clear(restarted, T0 + 5, "ticket-2", None).cleared == 1  # the next clear acts


def test_a_wall_clock_set_back_between_the_clear_and_a_new_xid_cannot_hide_the_xid():
    """The cut-off is an observation number, not a time: a clock stepped back an hour puts the new
    XID's time before the cleared one's, and it is still the new fault it is."""
    clf = classifier()
    seen = clf.observe(collect(T0 + 3600, gpus=gpus(T0 + 3600), xids=[xid(94, t=T0 + 3600)])).verdict
    clf.observe(collect(T0 + 1, gpus=gpus(T0 + 1), xids=[xid(94, t=T0 + 1)]))  # the clock went back
    after = clear(clf, T0 + 2, "ticket-1", seen.observation)
    (kept,) = after.verdict.findings
    assert (kept.gpu_index, kept.action, kept.first_seen) == (3, Action.REPLACE_NODE, T0 + 1)


def test_finding_ids_are_integers_never_reused_across_a_clear_or_a_restart():
    """A finding's key is its code, subject and an integer id from a counter in the classifier's
    state: an XID that recurs in the same millisecond as the cleared one still gets a key of its
    own, and a restored classifier never hands out an id an earlier finding had."""
    clf = classifier()
    seen = clf.observe(collect(T0, gpus=gpus(), xids=[xid(94, t=T0)])).verdict
    old = only(seen, "GPU_XID")
    assert isinstance(old.id, int) and old.id >= 1 and old.key == f"GPU_XID/{old.pci_bus_id}/{old.id}"
    clf.observe(collect(T0, gpus=gpus(), xids=[xid(94, t=T0)]))  # joins at the same instant
    new = only(clear(clf, T0, "ticket-1", seen.observation).verdict, "GPU_XID")
    assert new.first_seen == old.first_seen and new.id > old.id and new.key != old.key
    state = json.loads(json.dumps(clf.export_state()))
    restored = classifier()
    restored.restore_state(state)
    cleared = clear(restored, T0 + 1, "ticket-2", None)
    assert cleared.cleared == 1
    again = only(restored.observe(collect(T0 + 2, gpus=gpus(T0 + 2), xids=[xid(94, t=T0 + 2)])).verdict,
                 "GPU_XID")
    assert again.id > new.id


def test_a_saved_finding_whose_id_is_not_an_integer_is_dropped_and_counted():
    clf = classifier()
    clf.observe(collect(T0, gpus=gpus(), xids=[xid(94, t=T0)]))
    state = json.loads(json.dumps(clf.export_state()))
    entries = state["book"]["entries"]
    for entry in entries.values():
        entry["id"] = 1.5
    restored = classifier()
    restored.restore_state(state)
    assert restored.restore_errors >= 1
    assert restored.observe(collect(T0 + 1, gpus=gpus(T0 + 1))).verdict.findings == ()
