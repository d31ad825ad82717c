"""EffectsState: what the effects keep across restarts, a frozen value restored tolerantly."""

import dataclasses
import json

import pytest

from healthagent.effects.record import MAX_REPORTED, AppliedTaint, EffectsState, saved_part


def test_reported_actions_survive_a_round_trip_and_keep_the_newest():
    state = EffectsState().with_reported("a", "reboot_node").with_reported("b", "monitor")
    state = state.with_reported("a", "replace_node")  # an escalation moves the finding to the newest end
    restored = EffectsState.from_state(json.loads(json.dumps(state.to_state())))
    assert restored.reported == (("b", "monitor"), ("a", "replace_node"))
    assert restored.reported_action("a") == "replace_node" and restored.reported_action("c") is None


def test_reported_actions_are_bounded_oldest_first():
    state = EffectsState()
    for n in range(MAX_REPORTED + 5):
        state = state.with_reported(f"k{n}", "monitor")
    assert len(state.reported) == MAX_REPORTED
    assert state.reported_action("k0") is None and state.reported_action(f"k{MAX_REPORTED + 4}") == "monitor"


def test_a_bad_field_falls_back_to_its_default_or_skips_bad_entries():
    assert EffectsState.from_state({"reported": ["not", "a", "dict"]}).reported == ()
    assert EffectsState.from_state({"reported": {"a": 3, "b": "reboot_node"}}).reported == (("b", "reboot_node"),)
    assert EffectsState.from_state({"budget_blocked_total": True}).budget_blocked_total == 0
    assert EffectsState.from_state({"taint": {"value": "replace_node"}}).taint is None  # no effect, no since
    assert EffectsState.from_state("garbage") == EffectsState()


def test_the_state_is_a_value_and_the_drivers_parts_are_saved_beside_it():
    state = EffectsState(taint=AppliedTaint("replace_node", "NoSchedule", 10.0, "GPU_XID"),
                         clear_to_write="taint-removed-1700000000")
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.taint = None  # type: ignore[misc]
    saved = state.to_state({"emitted": {"finding/k": 1.0}, "outbox": [], "dry_run_node": None})
    assert EffectsState.from_state(saved) == state
    assert saved_part(saved, "emitted", dict, {}) == {"finding/k": 1.0}
    assert saved_part(saved, "outbox", dict, {}) == {}  # a list where a mapping belongs: the default
    assert saved_part(None, "outbox", list, []) == []
