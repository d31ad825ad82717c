"""Where the command line reads and writes when the user did not say: ``classify``'s input and
summary line, and ``run``'s state file outside a pod (``healthagent/cli_inputs.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from healthagent.cli_inputs import (
    dry_run_node_name,
    POD_STATE_FILE,
    ClassifyInput,
    choose_state_file,
    classify_input,
    in_a_pod,
    state_file_given,
    summary,
    user_state_file,
)

HOME = "/home/sre"


# -- run's state file ------------------------------------------------------------------------------

def test_outside_a_pod_the_state_goes_to_the_users_state_directory():
    choice = choose_state_file(given=False, in_pod=False, env={}, home=HOME)
    assert choice.path == "/home/sre/.local/state/healthagent/state.json"
    assert choice.note == ("not in a pod: state goes to /home/sre/.local/state/healthagent/state.json "
                           f"({POD_STATE_FILE} is the DaemonSet's; choose another with --state-file FILE)")


def test_xdg_state_home_is_used_when_absolute():
    assert user_state_file({"XDG_STATE_HOME": "/var/tmp/st"}, HOME) == "/var/tmp/st/healthagent/state.json"
    assert user_state_file({"XDG_STATE_HOME": "rel"}, HOME) == "/home/sre/.local/state/healthagent/state.json"


@pytest.mark.parametrize("given,in_pod", [(True, False), (False, True), (True, True)])
def test_a_named_file_or_a_pod_keeps_the_setting_and_says_nothing(given, in_pod):
    choice = choose_state_file(given=given, in_pod=in_pod, env={}, home=HOME)
    assert (choice.path, choice.note) == ("", "")


def test_in_a_pod_from_the_environment_or_the_token(tmp_path):
    token = tmp_path / "token"
    assert not in_a_pod({}, str(token))
    assert in_a_pod({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, str(token))
    token.write_text("x")
    assert in_a_pod({}, str(token))


def test_a_state_file_named_anywhere_counts_as_given(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("state-file: /srv/state.json\n")
    other = tmp_path / "other.yaml"
    other.write_text("log_level: DEBUG\n")
    assert state_file_given("/srv/s.json", {}, {}, None)
    assert state_file_given(None, {"state_file": "/srv/s.json"}, {}, None)
    assert state_file_given(None, {}, {"HEALTHAGENT_STATE_FILE": "/srv/s.json"}, None)
    assert state_file_given(None, {}, {}, str(config))
    assert state_file_given(None, {}, {"HEALTHAGENT_CONFIG": str(config)}, None)
    assert not state_file_given(None, {}, {}, str(other))
    assert not state_file_given(None, {"log_level": "DEBUG"}, {}, None)


# -- classify's input and summary -----------------------------------------------------------------

def test_classify_reads_the_file_else_the_host_roots_kernel_log_else_stdin(tmp_path):
    assert classify_input("kern.log", str(tmp_path)) == ClassifyInput("kern.log", "kern.log")
    assert classify_input("-", None) == ClassifyInput("-", "stdin")
    assert classify_input(None, str(tmp_path)) == ClassifyInput(str(tmp_path / "dev" / "kmsg"),
                                                                str(Path(tmp_path) / "dev" / "kmsg"))
    assert classify_input(None, None) == ClassifyInput("-", "stdin")


@pytest.mark.parametrize("counts,words", [
    ((0, 0, 4), "0 XID lines in kern.log (4 lines read)"),
    ((1, 0, 1), "1 XID line in kern.log (1 line read)"),
    ((2, 1, 40), "2 XID lines and 1 SXid line in kern.log (40 lines read)"),
    ((0, 0, 0), "0 XID lines in kern.log (0 lines read)"),
])
def test_the_summary_counts_what_was_read_and_found(counts, words):
    assert summary(*counts, "kern.log") == words


def test_the_summary_counts_connectx_events_only_when_there_are_some():
    assert summary(0, 0, 9, "kern.log", adapter_events=1) == (
        "0 XID lines and 1 ConnectX (mlx5) event line in kern.log (9 lines read)")
    assert summary(2, 1, 40, "kern.log", adapter_events=3) == (
        "2 XID lines, 1 SXid line and 3 ConnectX (mlx5) event lines in kern.log (40 lines read)")


@pytest.mark.parametrize("kube,node_name,in_pod,hostname,expected", [
    ("dry-run", "", False, "GPU-Node-7", "gpu-node-7"),  # as the kubelet registers a node
    ("dry-run", "named", False, "host", ""),  # a name given is kept
    ("dry-run", "", True, "healthagent-x7k2p", ""),  # in a pod the hostname is the pod's
    ("kubeconfig", "", False, "host", ""),  # a mode that writes is never told a guess
    ("in-cluster", "", False, "host", ""),
    ("dry-run", "", False, "", ""),
])
def test_a_dry_run_by_hand_reports_as_this_host(kube, node_name, in_pod, hostname, expected):
    choice = dry_run_node_name(kube, node_name, in_pod, hostname)
    assert choice.name == expected and bool(choice.note) == bool(expected)
