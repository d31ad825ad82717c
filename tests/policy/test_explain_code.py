"""``healthagent explain CODE`` through the real command line: the rule that opens a finding, the
built-in one merged with the policy file, each field saying where it came from."""

from pathlib import Path

import pytest

from healthagent.cli import main

NVLINK = "findings:\n  GPU_NVLINK_ERRORS: {count: 3, window: 10m, after_boot_grace: 15m}\n"


def explained(capsys, *argv: str) -> list[str]:
    assert main(["explain", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def policy_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_built_in_rule_opens_nvlink_errors_at_once(capsys):
    lines = explained(capsys, "GPU_NVLINK_ERRORS")
    assert lines[0] == "GPU_NVLINK_ERRORS: NVLink errors growing"
    assert "Opens: at once" in lines
    assert "  count: 1, at once (built-in)" in lines and "  after_boot_grace: none (built-in)" in lines
    assert lines[-1] == "Runbook: docs/findings.md#gpu_nvlink_errors"


def test_the_policy_file_changes_the_rule_and_each_field_says_where_it_came_from(tmp_path, capsys):
    path = policy_file(tmp_path, NVLINK)
    lines = explained(capsys, "gpu_nvlink_errors", "--policy-file", path)
    assert "Opens: 3 within 10 min, not within 15 min of the node's boot" in lines
    assert f"  count: 3 (policy file {path}: findings.GPU_NVLINK_ERRORS.count; built-in: 1, at once)" in lines
    assert f"  window: 10 min (policy file {path}: findings.GPU_NVLINK_ERRORS.window; built-in: none)" in lines
    assert "  sustain: none (built-in)" in lines
    assert (f"  after_boot_grace: 15 min (policy file {path}: findings.GPU_NVLINK_ERRORS.after_boot_grace; "
            "built-in: none)") in lines


def test_an_old_threshold_key_shows_as_the_field_it_sets(tmp_path, capsys):
    path = policy_file(tmp_path, "thresholds: {throttle_sustain_seconds: 120}\n")
    lines = explained(capsys, "GPU_THERMAL_THROTTLE", "--policy-file", path)
    assert "Opens: present for 2 min" in lines
    assert f"  sustain: 2 min (policy file {path}: thresholds.throttle_sustain_seconds; built-in: 5 min)" in lines


def test_explain_xid_names_a_tuned_incident_rule(tmp_path, capsys):
    assert not any(line.startswith("Finding rule:") for line in explained(capsys, "94"))
    path = policy_file(tmp_path, "findings: {GPU_XID: {count: 2, window: 5m}}\n")
    assert "Finding rule: GPU_XID opens 2 within 5 min (`healthagent explain GPU_XID`)" in explained(
        capsys, "94", "--policy-file", path)


def test_a_disabled_rule_says_so(tmp_path, capsys):
    path = policy_file(tmp_path, "disabled_rules: [GPU_POWER_THROTTLE]\n")
    assert "Opens: present for 5 min; the rule is off (disabled_rules)" in explained(
        capsys, "GPU_POWER_THROTTLE", "--policy-file", path)


@pytest.mark.parametrize("text,key", [
    ("findings: {GPU_NVLINK_ERRORS: {count: 3, window: 15s}}\n", "findings.GPU_NVLINK_ERRORS.window"),
    ("findings: {GPU_NVLINK_DOWN: {count: 3}}\n", "findings.GPU_NVLINK_DOWN"),
])
def test_a_bad_rule_is_one_line_and_exit_3(tmp_path, capsys, text, key):
    assert main(["explain", "GPU_NVLINK_ERRORS", "--policy-file", policy_file(tmp_path, text)]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and key in err


def test_the_window_check_uses_the_configured_interval(tmp_path, capsys):
    path = policy_file(tmp_path, "findings: {EFA_RX_DROPS: {count: 3, window: 40s}}\n")
    assert main(["explain", "EFA_RX_DROPS", "--policy-file", path, "--set", "efa_interval_seconds=30"]) == 3
    assert "at least 60s" in capsys.readouterr().err
    assert "Opens: 3 within 40 s" in explained(capsys, "EFA_RX_DROPS", "--policy-file", path)


def test_an_unknown_code_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["explain", "GPU_NVLINK_DOWN"])
    assert exited.value.code == 3
    assert "is not an XID number, a finding code or a ConnectX adapter event id" in capsys.readouterr().err
