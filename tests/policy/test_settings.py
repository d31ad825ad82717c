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
