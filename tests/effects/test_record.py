"""EffectsRecord: what the effects keep across restarts, restored tolerantly."""

from healthagent.effects.record import MAX_REPORTED, EffectsRecord


def test_reported_actions_survive_a_round_trip_and_keep_the_newest():
    record = EffectsRecord()
    record.note_reported("a", "reboot_node")
    record.note_reported("b", "monitor")
    record.note_reported("a", "replace_node")  # an escalation moves the finding to the newest end
    restored = EffectsRecord.from_state(record.to_state())
    assert list(restored.reported.items()) == [("b", "monitor"), ("a", "replace_node")]


def test_reported_actions_are_bounded_oldest_first():
    record = EffectsRecord()
    for n in range(MAX_REPORTED + 5):
        record.note_reported(f"k{n}", "monitor")
    assert len(record.reported) == MAX_REPORTED
    assert "k0" not in record.reported and f"k{MAX_REPORTED + 4}" in record.reported


def test_a_bad_reported_field_falls_back_to_empty_or_skips_bad_entries():
    assert EffectsRecord.from_state({"reported": ["not", "a", "dict"]}).reported == {}
    assert EffectsRecord.from_state({"reported": {"a": 3, "b": "reboot_node"}}).reported == {"b": "reboot_node"}
    assert EffectsRecord.from_state({}).reported == {}  # a state file from before escalations were reported
