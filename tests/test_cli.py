"""The command line's errors: bad usage, settings, environment and input end in one line and exit 3
(never check's 2, "node action required"), a closed pipe ends quietly, ``--set KEY=VALUE`` can say
every setting and names it as given, and ``training-token`` gives a job its credential.

Commands that start the agent (``run``) run as real subprocesses (``python -m healthagent``): they
install signal handlers and threads that must not land in the test process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from healthagent.cli import EXIT_BROKEN_PIPE, _settings, build_parser, main
from healthagent.cli_inputs import POD_STATE_FILE, SERVICE_ACCOUNT_TOKEN
from healthagent.config import Settings, load_settings
from healthagent.training.access import Grant, IntakeAccess

REPO = Path(__file__).resolve().parents[1]
XID_LINE = "May 01 09:51:12 node kernel: NVRM: Xid (PCI:0000:86:00): 94, pid=1234, name=python, Contained: CE User Channel (0x9)\n"


def healthagent(*args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HEALTHAGENT_", "KUBERNETES_"))}
    base.pop("NODE_NAME", None)
    return subprocess.run([sys.executable, "-m", "healthagent", *args], cwd=REPO, input=stdin,
                          capture_output=True, timeout=60, env={**base, **(env or {})})


def one_error_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    """The single line the command printed about its error (a log line may precede it)."""
    err = proc.stderr.decode()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("healthagent:")]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def run_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["run", "--host-root", str(tmp_path), "--no-nvml", "--state-file", str(tmp_path / "state.json"),
            "--node-name", "n1", "--log-level", "ERROR", *extra]


# -- run: where the state goes outside a pod -----------------------------------------------------

def test_run_outside_a_pod_keeps_its_state_in_the_users_state_directory(tmp_path):
    """A trial run by hand (no KUBERNETES_SERVICE_HOST, no service-account token) never writes
    the DaemonSet's /var/lib/healthagent/state.json; one log line says where the state goes."""
    if os.path.exists(SERVICE_ACCOUNT_TOKEN):
        pytest.skip("this test process runs in a pod")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HEALTHAGENT_", "KUBERNETES_", "XDG_STATE_HOME"))}
    env["HOME"] = str(tmp_path / "home")
    pod_default_existed = os.path.exists(POD_STATE_FILE)
    agent = subprocess.Popen([sys.executable, "-m", "healthagent", "run", "--host-root", str(tmp_path),
                              "--no-nvml", "--kube", "off", "--listen", "127.0.0.1:0"],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    note = ""
    try:
        for line in agent.stderr:  # the note comes before the agent starts; it ends with "agent started"
            if "agent started" in line:
                break
            if "not in a pod" in line:
                note = line
        agent.send_signal(signal.SIGTERM)  # stopping saves the state
        assert agent.wait(60) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
    expected = tmp_path / "home" / ".local" / "state" / "healthagent" / "state.json"
    assert f"state goes to {expected} " in note and "--state-file FILE" in note
    assert expected.is_file()
    assert os.path.exists(POD_STATE_FILE) == pod_default_existed


# -- run: Kubernetes access and the listen address ----------------------------------------------

def test_in_cluster_access_outside_a_cluster(tmp_path):
    proc = healthagent(*run_args(tmp_path, "--kube", "in-cluster", "--listen", "127.0.0.1:0"))
    assert proc.returncode == 3
    line = one_error_line(proc, "healthagent: config error: kube:")
    assert "--kube kubeconfig" in line and "--kube dry-run" in line


@pytest.mark.parametrize("content,words", [
    (None, "cannot read"),  # missing
    ("clusters: [\n", "not valid YAML"),
    ("just a string\n", "is not a kubeconfig"),
    ("apiVersion: v1\nkind: Config\n", "cannot be used"),  # no current-context
])
def test_a_kubeconfig_the_client_cannot_use(tmp_path, content, words):
    kubeconfig = tmp_path / "kubeconfig"
    if content is not None:
        kubeconfig.write_text(content)
    proc = healthagent(*run_args(tmp_path, "--kube", "kubeconfig", "--kubeconfig", str(kubeconfig),
                                 "--listen", "127.0.0.1:0"))
    assert proc.returncode == 3
    line = one_error_line(proc, "healthagent: config error: kubeconfig:")
    assert words in line and ("--kubeconfig" in line or "fix the syntax" in line)


def test_a_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = healthagent(*run_args(tmp_path, "--kube", "dry-run", "--listen", f"127.0.0.1:{port}"))
    assert proc.returncode == 3
    line = one_error_line(proc, "healthagent: config error: listen:")
    assert f"127.0.0.1:{port}" in line and "free port" in line and "--listen" in line
    assert "training" not in line  # the intake's port was not the one in use


def test_the_training_port_in_use_names_that_port_and_its_own_flag(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = healthagent(*run_args(tmp_path, "--kube", "dry-run", "--listen", "127.0.0.1:0",
                                     "--training-listen", f"127.0.0.1:{port}"))
    assert proc.returncode == 3
    line = one_error_line(proc, "healthagent: config error: training_listen:")
    assert f"cannot listen on 127.0.0.1:{port} " in line and "free port" in line
    assert "--training-listen" in line and "--set" not in line


def test_an_address_that_is_not_this_hosts(tmp_path):
    proc = healthagent(*run_args(tmp_path, "--kube", "dry-run", "--listen", "192.0.2.1:0"))  # TEST-NET-1
    assert proc.returncode == 3
    one_error_line(proc, "healthagent: config error: listen:")


@pytest.mark.parametrize("setting,value", [
    ("budget_max_fraction", "nan"),
    ("taint_key", "healthagent.io/not valid"),
    ("budget_node_selector", "nvidia.com/gpu.present in (true"),
    ("state_file", ""),
    ("dcgm_url", "localhost:9400"),
])
def test_bad_settings_through_set_stop_run_with_one_line(tmp_path, setting, value):
    proc = healthagent("run", "--host-root", str(tmp_path), "--no-nvml", "--kube", "dry-run",
                       "--listen", "127.0.0.1:0", "--set", f"{setting}={value}")
    assert proc.returncode == 3
    line = one_error_line(proc, "healthagent: config error:")
    assert setting in line or setting.replace("_", "-") in line


# -- classify: input that cannot be read, a closed pipe, undecodable bytes -----------------------

def test_classify_a_missing_file(capsys):
    assert main(["classify", "/nonexistent/kern.log"]) == 3
    err = capsys.readouterr().err.strip()
    assert err == ("healthagent: classify: cannot read '/nonexistent/kern.log' (No such file or directory); "
                   "pass a file of kernel-log text (dmesg, journalctl -k) or - for stdin")


def test_classify_a_directory(tmp_path, capsys):
    assert main(["classify", str(tmp_path)]) == 3
    assert "cannot read" in capsys.readouterr().err


def test_classify_into_a_pipe_closed_early_ends_quietly(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(XID_LINE * 20_000)  # far more output than a pipe buffer holds
    proc = subprocess.Popen([sys.executable, "-m", "healthagent", "classify", str(log)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()  # what `| head -1` reads
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) == EXIT_BROKEN_PIPE
    assert json.loads(first)["xid"] == 94
    assert err == ""


@pytest.mark.parametrize("locale", ["C", "C.UTF-8"])
def test_classify_from_stdin_replaces_undecodable_bytes(locale):
    line = XID_LINE.replace("name=python", "name=py\xffthon").encode("latin-1")  # \xff is not UTF-8
    proc = healthagent("classify", "-", stdin=line, env={"LC_ALL": locale, "PYTHONIOENCODING": ""})
    assert proc.returncode == 0, proc.stderr.decode()
    row = json.loads(proc.stdout)
    assert "py\ufffdthon" in row["line"]  # like the file path does; never a lone surrogate
    assert "\\udc" not in proc.stdout.decode()


# -- --set: every setting can be said on the command line ----------------------------------------

def parsed(*argv: str):
    return _settings(build_parser().parse_args(list(argv)))


def test_set_says_any_setting_and_a_dedicated_flag_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("HEALTHAGENT_SOURCE_TIMEOUT_SECONDS", "3")
    s = parsed("check", "--host-root", str(tmp_path), "--set", "source_timeout_seconds=7",
               "--set", "budget-max-nodes=2", "--set", f"host_root={REPO}")
    assert s.source_timeout_seconds == 7.0  # a flag beats the environment
    assert s.budget_max_nodes == 2  # dashes work as in the YAML file
    assert s.host_root == str(tmp_path)  # --host-root beats --set host_root=


@pytest.mark.parametrize("item,words", [
    ("nope=1", "'nope' is not a setting; valid keys:"),
    ("source_timeout_seconds", "use KEY=VALUE"),
    ("=1", "use KEY=VALUE"),
    ("source_timeout_seconds=soon", "--set source_timeout_seconds='soon' is not a valid float"),
    ("expected_gpus=-1", "expected_gpus: must be 0 or more"),
])
def test_set_errors_are_one_line(tmp_path, capsys, item, words):
    assert main(["check", "--host-root", str(tmp_path), "--set", item]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("healthagent: config error:") and words in err and "\n" not in err


def test_every_setting_can_be_set_on_the_command_line(tmp_path):
    """config.py promises that flags, env and YAML can each say everything."""
    samples = {"host_root": str(tmp_path), "kernel_log": str(tmp_path / "kmsg"), "listen": "127.0.0.1:9999",
               "node_name": "n7", "kube": "off", "kubeconfig": str(tmp_path / "kc"), "nvml": "false",
               "dcgm_url": "http://localhost:9400/metrics", "policy_file": str(tmp_path / "p.yaml"),
               "state_file": str(tmp_path / "s.json"), "taint_key": "healthagent.io/other",
               "budget_node_selector": "gpu=yes", "hyperpod_labels": "true", "log_level": "DEBUG",
               "training_token": "t0ken-00000000000000000000000000000000", "training_intake": "open",
               "training_listen": "127.0.0.1:9998", "condition_vocabulary": "eks"}
    defaults = Settings()
    for f in fields(Settings):
        if f.name in samples:
            value = samples[f.name]
        elif "bool" in str(f.type):
            value = "false" if getattr(defaults, f.name) else "true"
        else:
            value = "0.5" if "float" in str(f.type) else "3"
        s = parsed("check", "--set", f"host_root={tmp_path}", "--set", f"{f.name}={value}")
        said_by_env = load_settings(env={"HEALTHAGENT_HOST_ROOT": str(tmp_path),
                                         f"HEALTHAGENT_{f.name.upper()}": value})
        assert s == said_by_env and getattr(s, f.name) != getattr(defaults, f.name), f.name


def test_a_flag_beats_set_and_set_beats_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HEALTHAGENT_LISTEN", "127.0.0.1:7001")
    assert parsed("run", "--host-root", str(tmp_path), "--set", "listen=127.0.0.1:7002").listen == "127.0.0.1:7002"
    assert parsed("run", "--host-root", str(tmp_path), "--set", "listen=127.0.0.1:7002",
                  "--listen", "127.0.0.1:7003").listen == "127.0.0.1:7003"


# -- usage errors: exit 3 for every command, never check's 2 --------------------------------------

@pytest.mark.parametrize("argv", [
    ["check", "--jsn"],
    ["explain", "abc"],
    ["explain", "-5"],
    ["demo", "--gpu", "9"],
    ["demo", "--xid", "x"],
    ["classify", "--nope"],
    ["run", "--kube-mode", "dry-run"],
    ["run", "--training-intake", "sometimes"],
    ["training-token"],
    ["no-such-command"],
    [],
], ids=lambda argv: " ".join(argv) or "no command")
def test_usage_errors_exit_3_with_the_usage_and_one_line(argv):
    proc = healthagent(*argv)
    assert proc.returncode == 3
    err = proc.stderr.decode()
    assert "Traceback" not in err and err.startswith("usage: healthagent")
    assert len([line for line in err.splitlines() if ": error: " in line]) == 1, err


@pytest.mark.parametrize("argv,command", [
    (["check", "--bogus"], "check"),
    (["run", "--bogus"], "run"),
    (["classify", "x.log", "y.log"], "classify"),
    (["explain", "94", "--json"], "explain"),
])
def test_an_unknown_argument_shows_its_commands_usage(argv, command):
    proc = healthagent(*argv)
    assert proc.returncode == 3
    err = proc.stderr.decode()
    assert err.startswith(f"usage: healthagent {command} "), err
    assert f"healthagent {command}: error: unrecognized arguments: {argv[-1]}" in err


def test_help_shows_the_defaults():
    run_help = " ".join(healthagent("run", "--help").stdout.decode().split())  # argparse wraps lines
    for words in ("(default in-cluster)", "(default 0.0.0.0:9410)", "in a pod: /var/lib/healthagent/state.json",
                  "outside a pod: $XDG_STATE_HOME/healthagent/state.json", "(default INFO)", "(default token"):
        assert words in run_help, words
    assert "(default ERROR)" in " ".join(healthagent("check", "--help").stdout.decode().split())


def test_demo_names_the_gpus_it_has():
    proc = healthagent("demo", "--gpu", "9")
    assert "the demo node has GPUs 0 to 7" in proc.stderr.decode()


def test_help_and_version_still_exit_0():
    assert healthagent("--help").returncode == 0
    assert healthagent("check", "--help").returncode == 0
    assert healthagent("--version").returncode == 0


# -- the node's name: one rule for every mode that acts on a node ---------------------------------

@pytest.mark.parametrize("kube", ["dry-run", "in-cluster"])
def test_a_mode_that_acts_on_a_node_needs_its_name(tmp_path, kube):
    """In a pod (the hostname is the pod's); a dry run by hand reports as this host instead
    (tests/test_cli_newcomer.py)."""
    proc = healthagent("run", "--host-root", str(tmp_path), "--no-nvml", "--state-file", str(tmp_path / "s.json"),
                       "--kube", kube, "--listen", "127.0.0.1:0", "--log-level", "ERROR",
                       env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert proc.returncode == 3
    line = one_error_line(proc, "healthagent: config error: node_name:")
    assert f"kube={kube}" in line and "NODE_NAME" in line and "--node-name" in line


# -- training-token: the one step that gives a job its credential ---------------------------------

KEY = "0123456789abcdef0123456789abcdef"


def test_training_token_prints_a_token_the_agent_accepts_for_that_job_only():
    proc = healthagent("training-token", "llama3-70b", env={"HEALTHAGENT_TRAINING_TOKEN": KEY})
    assert proc.returncode == 0, proc.stderr.decode()
    token = proc.stdout.decode().strip()
    assert KEY not in token
    assert IntakeAccess("token", KEY).check(f"Bearer {token}") == Grant(job="llama3-70b")
    assert IntakeAccess("token", "another-key").check(f"Bearer {token}") != Grant(job="llama3-70b")


def test_training_token_prints_a_secret_for_the_jobs_namespace():
    proc = healthagent("training-token", "Llama3 70B", "--namespace", "team-a",
                       env={"HEALTHAGENT_TRAINING_TOKEN": KEY})
    assert proc.returncode == 0, proc.stderr.decode()
    secret = json.loads(proc.stdout)
    assert (secret["kind"], secret["metadata"]["namespace"]) == ("Secret", "team-a")
    assert secret["metadata"]["name"] == "healthagent-job-llama3-70b"
    assert secret["stringData"]["job"] == "Llama3 70B"
    grant = IntakeAccess("token", KEY).check(f"Bearer {secret['stringData']['token']}")
    assert grant == Grant(job="Llama3 70B")


@pytest.mark.parametrize("job,env,words", [
    ("llama", {}, "no training key here"),
    ("bad\tjob", {"HEALTHAGENT_TRAINING_TOKEN": KEY}, "'job' must be 1-128 printable characters"),
])
def test_training_token_errors_are_one_line(job, env, words):
    proc = healthagent("training-token", job, env=env)
    assert proc.returncode == 3 and proc.stdout == b""
    assert words in one_error_line(proc, "healthagent: training-token:")
