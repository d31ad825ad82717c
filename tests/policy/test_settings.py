"""Operator policy files: what they can change, and the one-line error for every kind of mistake."""

from pathlib import Path

import pytest

from healthagent.model import Action
from healthagent.policy.settings import THRESHOLDS, Policy, PolicyError, load_policy

EXAMPLE = Path(__file__).parents[1] / "fixtures" / "policy" / "policy-example.yaml"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_defaults_without_a_file():
    policy = load_policy(None)
    assert policy == Policy()
    assert policy.incident_quiet_seconds == 180
    assert policy.xid_window_seconds == 3600
    assert policy.efa_rx_drops_per_minute == 100
    assert policy.xid_actions == {} and policy.disabled_rules == frozenset()
    assert set(policy.thresholds) == set(THRESHOLDS)


def test_example_file_loads_everything_it_says(tmp_path):
    policy = load_policy(str(EXAMPLE))
    assert policy.xid_actions == {94: Action.RESTART_APP, 43: Action.NONE}
    assert policy.sxid_actions == {12028: Action.REBOOT_NODE}
    assert policy.disabled_rules == frozenset({"GPU_POWER_THROTTLE"})
    assert not policy.enabled("GPU_POWER_THROTTLE") and policy.enabled("GPU_XID")
    assert policy.incident_quiet_seconds == 300
    assert policy.xid_window_seconds == 7200
    assert policy.condition_clear_evaluations == 5
    assert policy.pcie_replay_per_minute == 8  # untouched default
    assert policy.source == str(EXAMPLE)


def test_empty_file_is_the_default(tmp_path):
    assert load_policy(write(tmp_path, "")).thresholds == Policy().thresholds


def test_action_names_are_case_insensitive_and_keys_may_be_strings(tmp_path):
    policy = load_policy(write(tmp_path, "xid: {'13': Reset_GPU}\ndisabled_rules: [gpu_sbe_storm]\n"))
    assert policy.xid_actions == {13: Action.RESET_GPU}
    assert policy.disabled_rules == frozenset({"GPU_SBE_STORM"})


@pytest.mark.parametrize("text,key,fix", [
    ("bogus: 1\n", "'bogus'", "valid keys: xid, sxid, disabled_rules, thresholds"),
    ("xid: {94: nuke}\n", "xid.94", "use one of: none, monitor, restart_app, reset_gpu, reboot_node, replace_node"),
    ("xid: {abc: monitor}\n", "xid.abc", "use an integer such as 94"),
    ("xid: {94: 3}\n", "xid.94", "use one of:"),
    ("xid: [94]\n", "xid:", "must be a mapping"),
    ("sxid: {12028: explode}\n", "sxid.12028", "use one of:"),
    ("thresholds: {incident_quiet_seconds: -5}\n", "thresholds.incident_quiet_seconds", "use 0 or more"),
    ("thresholds: {incident_quiet_seconds: soon}\n", "thresholds.incident_quiet_seconds", "use a number, e.g. 180"),
    ("thresholds: {incident_quiet_seconds: true}\n", "thresholds.incident_quiet_seconds", "use a number"),
    ("thresholds: {incident_quiet_seconds: .nan}\n", "thresholds.incident_quiet_seconds", "finite"),
    ("thresholds: {incident_quiet_seconds: 0}\n", "thresholds.incident_quiet_seconds", "greater than 0"),
    ("thresholds: {incident_quiet_secs: 5}\n", "thresholds.incident_quiet_secs", "unknown threshold"),
    ("thresholds: {condition_clear_evaluations: 2.5}\n", "thresholds.condition_clear_evaluations", "whole number"),
    ("thresholds: {sbe_acceleration_factor: 0.5}\n", "thresholds.sbe_acceleration_factor", "at least 1"),
    ("thresholds: [1, 2]\n", "thresholds:", "must be a mapping"),
    ("disabled_rules: [GPU_FOO]\n", "disabled_rules", "use a finding code"),
    ("disabled_rules: GPU_XID\n", "disabled_rules", "must be a list"),
    ("- just\n- a list\n", "policy:", "must be a mapping"),
    ("xid: {94: restart_app\n", "policy:", "not valid YAML at line"),
])
def test_every_mistake_is_one_line_naming_key_and_fix(tmp_path, text, key, fix):
    with pytest.raises(PolicyError) as err:
        load_policy(write(tmp_path, text))
    message = str(err.value)
    assert "\n" not in message
    assert key in message
    assert fix in message


def test_unreadable_file(tmp_path):
    with pytest.raises(PolicyError, match="cannot read .*fix --policy-file"):
        load_policy(str(tmp_path / "missing.yaml"))


def test_policy_is_immutable():
    policy = Policy()
    with pytest.raises(Exception):
        policy.disabled_rules = frozenset({"GPU_XID"})  # type: ignore[misc]
    with pytest.raises(TypeError):
        policy.thresholds["incident_quiet_seconds"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        policy.not_a_threshold  # noqa: B018


@pytest.mark.parametrize("text,named", [
    ("xid:\n  94: replace_node\n  13: monitor\n  94: none\n", "key 94 twice (lines 2 and 4)"),
    ("xid:\n  94: replace_node\n  0x5e: none\n", "key 94 twice (lines 2 and 3)"),  # one number, two spellings
    ("thresholds:\n  incident_quiet_seconds: 60\n  incident_quiet_seconds: 600\n",
     "key 'incident_quiet_seconds' twice (lines 2 and 3)"),
    ("xid: {94: replace_node}\nxid: {94: none}\n", "key 'xid' twice (lines 1 and 2)"),
    ("xid: {94: replace_node, '94': none}\n", "xid.94: 94 and '94' both name XID 94"),
    ("xid: {' 94': none, 94: replace_node}\n", "xid.94: ' 94' and 94 both name XID 94"),
    ("sxid: {12028: reboot_node, '12028': none}\n", "sxid.12028: 12028 and '12028' both name SXid 12028"),
])
def test_a_rule_given_twice_is_an_error_naming_both(tmp_path, text, named):
    """PyYAML keeps the last of two equal keys silently: ``94: none`` would take XID 94 off the node."""
    with pytest.raises(PolicyError) as err:
        load_policy(write(tmp_path, text))
    assert named in str(err.value) and "keep one" in str(err.value) and "\n" not in str(err.value)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    """``<<`` is YAML's way to take a mapping and change part of it: that is no key given twice."""
    policy = load_policy(write(tmp_path, "xid:\n  <<: {94: restart_app, 13: monitor}\n  94: none\n"))
    assert policy.xid_actions == {94: Action.NONE, 13: Action.MONITOR}


@pytest.mark.parametrize("text,named,fix", [
    ("xid: {100000000000000000000000: monitor}\n", "xid.100000000000000000000000", "XID numbers are 1 to 999999999"),
    ("xid: {1000000000: monitor}\n", "xid.1000000000", "1 to 999999999"),
    ("xid: {0: monitor}\n", "xid.0", "1 to 999999999"),
    ("sxid: {99999999999: monitor}\n", "sxid.99999999999", "SXid numbers are 1 to 999999999"),
    ("xid: {'٩٤': monitor}\n", "xid.'٩٤'", "use an integer such as 94"),  # Arabic-Indic digits
    ("thresholds: {efa_rx_drops_per_minute: 1e308}\n", "thresholds.efa_rx_drops_per_minute",
     "use at most 1000000000; to turn the rule off use disabled_rules"),
    ("thresholds: {xid_window_seconds: 1.0e+308}\n", "thresholds.xid_window_seconds", "at most 2592000 (30 days)"),
    ("thresholds: {max_incidents_per_gpu: 100000}\n", "thresholds.max_incidents_per_gpu", "at most 64"),
    ("thresholds: {sbe_acceleration_factor: 1e6}\n", "thresholds.sbe_acceleration_factor", "at most 1000"),
    ("thresholds: {condition_raise_evaluations: 1e7}\n", "thresholds.condition_raise_evaluations", "at most 1000000"),
    ("thresholds: {xid_window_seconds: 1" + "0" * 400 + "}\n", "thresholds.xid_window_seconds", "not a number"),
])
def test_numbers_outside_what_they_can_mean_are_refused(tmp_path, text, named, fix):
    with pytest.raises(PolicyError) as err:
        load_policy(write(tmp_path, text))
    message = str(err.value)
    assert named in message and fix in message and "\n" not in message and len(message) < 300


def test_the_largest_values_in_range_are_accepted(tmp_path):
    policy = load_policy(write(tmp_path, "xid: {999999999: monitor}\nthresholds: {xid_window_seconds: 2592000, "
                                        "efa_rx_drops_per_minute: 1000000000, max_incidents_per_gpu: 64}\n"))
    assert policy.xid_actions == {999999999: Action.MONITOR}
    assert policy.xid_window_seconds == 2592000 and policy.max_incidents_per_gpu == 64


def test_a_file_nested_past_the_parser_is_one_line(tmp_path):
    with pytest.raises(PolicyError) as err:
        load_policy(write(tmp_path, "xid: " + "[" * 100_000))
    assert "\n" not in str(err.value) and "policy:" in str(err.value)


def test_a_file_too_large_to_be_a_policy_is_refused_without_reading_it_all(tmp_path):
    with pytest.raises(PolicyError, match="larger than 1048576 bytes"):
        load_policy(write(tmp_path, "# padding\n" * 200_000))
