"""What a newcomer meets on a fresh machine: two agents side by side, a mistyped input, the demo
prepared twice or into the wrong place, a missing C compiler. Every error is one line and exit 3,
never a traceback; what the user did not name and is absent stays unobserved.

Real parts: sockets on 127.0.0.1, ``python -m healthagent`` as a subprocess, real folders.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from healthagent.cli_inputs import SERVICE_ACCOUNT_TOKEN
from healthagent.config import ConfigError, load_settings
from tests.test_cli import REPO, healthagent, one_error_line, run_args


def free_port_pair() -> int:
    """A loopback port ``p`` free with ``p + 2`` free too (the agent's port and its intake's)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + 2 > 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 2))
            except OSError:
                continue
        return port
    raise AssertionError("no free pair of loopback ports")


# -- run: two agents on one machine -----------------------------------------------------------------

def test_two_agents_on_one_machine_each_get_the_intake_beside_their_own_port(tmp_path):
    """The intake follows ``--listen``: two ports up from it (9410 -> 9412), so a second agent
    moved with ``--listen`` does not collide with the first on the intake."""
    from healthagent.wiring import AgentRuntime

    with ExitStack() as stack:
        runtimes = []
        for name in ("a", "b"):
            port = free_port_pair()
            (tmp_path / name).mkdir()
            settings = load_settings(env={}, flags={
                "host_root": str(tmp_path / name), "nvml": "false", "kube": "off", "listen": f"127.0.0.1:{port}",
                "state_file": str(tmp_path / name / "state.json"), "log_level": "WARNING"})
            runtime = AgentRuntime(settings)
            runtime.start()
            stack.callback(runtime.stop)
            runtimes.append((port, runtime))
        for port, runtime in runtimes:
            assert (runtime.server.port, runtime.server.intake_port) == (port, port + 2)


def test_the_default_intake_port_is_the_daemonsets():
    assert load_settings(env={}).training_listen_address() == ("0.0.0.0", 9412)
    assert load_settings(env={}, flags={"training_listen": "0.0.0.0:7000"}).training_listen_address()[1] == 7000


def test_a_listen_port_with_no_room_for_the_intake_is_refused():
    with pytest.raises(ConfigError, match=r"^training_listen: listen's port 65534 leaves no port 2 above it"):
        load_settings(env={}, flags={"listen": "0.0.0.0:65534"})
    assert load_settings(env={}, flags={"listen": "0.0.0.0:65534", "training_intake": "off"}).listen.endswith("65534")


def test_an_intake_port_taken_beside_listen_is_one_line_naming_it(tmp_path):
    port = free_port_pair()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))
        taken.listen()
        proc = healthagent(*run_args(tmp_path, "--kube", "dry-run", "--listen", f"127.0.0.1:{port}"))
    assert proc.returncode == 3
    line = one_error_line(proc, "healthagent: config error: training_listen:")
    assert f"cannot listen on 127.0.0.1:{port + 2} " in line and "--training-listen" in line


# -- check: a named input that is not there ---------------------------------------------------------

@pytest.mark.parametrize("how", ["flag", "set"])
def test_check_with_a_named_kernel_log_that_does_not_exist_is_an_error(tmp_path, how):
    """``--kernel-log /var/log/kern.lgo`` (a typo) used to print "healthy as far as seen", exit 0."""
    missing = str(tmp_path / "kern.lgo")
    named = ["--kernel-log", missing] if how == "flag" else ["--set", f"kernel_log={missing}"]
    proc = healthagent("check", "--no-nvml", "--host-root", str(tmp_path), *named)
    assert proc.returncode == 3 and proc.stdout == b""
    line = one_error_line(proc, f"healthagent: check: kernel_log (--kernel-log) '{missing}' does not exist")
    assert "/var/log/kern.log" in line


def test_check_with_a_named_kernel_log_that_is_a_folder_is_an_error(tmp_path):
    proc = healthagent("check", "--no-nvml", "--host-root", str(tmp_path), "--kernel-log", str(tmp_path))
    assert proc.returncode == 3
    one_error_line(proc, f"healthagent: check: kernel_log (--kernel-log) '{tmp_path}' is a folder")


def test_check_where_the_default_kernel_log_is_absent_leaves_it_unobserved(tmp_path):
    """Nobody named dev/kmsg under this host root: its absence is no error (the source falls back
    to klogctl where it may, else reports the kernel log unobserved)."""
    proc = healthagent("check", "--no-nvml", "--host-root", str(tmp_path))
    assert proc.returncode == 0, proc.stderr.decode()
    assert f"{tmp_path}/dev/kmsg not found" in proc.stdout.decode() and "Verdict: none" in proc.stdout.decode()


# -- demo: --prepare into a folder that holds something, and no C compiler --------------------------

def demo(*args: str, capsys) -> tuple[int, str, str]:
    from healthagent.cli import main

    code = main(["demo", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def rdma_devices(root: Path) -> set[str]:
    return {p.name for p in (root / "sys" / "class" / "infiniband").iterdir()}


def test_preparing_the_same_demo_node_twice_writes_it_again(tmp_path, capsys):
    """The second ``--prepare DIR`` used to stop on FileExistsError (a traceback, exit 1)."""
    root = tmp_path / "node"
    for _ in range(2):
        code, out, _ = demo("--prepare", str(root), capsys=capsys)
        assert code == 0 and f"demo host root written to {root}" in out
    assert len(rdma_devices(root)) == 32


def test_the_other_fabric_into_a_demo_folder_is_refused_unless_replaced(tmp_path, capsys):
    """``--fabric ib`` into the EFA demo's folder made one host of both (32 EFA devices and 10
    RDMA ports, healthy); it is refused, and ``--replace`` writes the ib node alone."""
    root = tmp_path / "node"
    assert demo("--prepare", str(root), capsys=capsys)[0] == 0
    code, _, err = demo("--fabric", "ib", "--prepare", str(root), capsys=capsys)
    assert code == 3 and err.count("\n") == 1
    assert err.startswith(f"healthagent: demo: --prepare {root}: it holds the efa demo node") and "--replace" in err
    assert len(rdma_devices(root)) == 32  # untouched
    assert demo("--fabric", "ib", "--prepare", str(root), "--replace", capsys=capsys)[0] == 0
    assert rdma_devices(root) == {f"mlx5_{n}" for n in range(10)}


def test_prepare_never_empties_a_folder_it_did_not_write(tmp_path, capsys):
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    code, _, err = demo("--prepare", str(tmp_path), "--replace", capsys=capsys)
    assert code == 3 and "is not empty and holds no demo node" in err and err.count("\n") == 1
    assert keep.read_text() == "mine"


@pytest.mark.parametrize("where,words", [("file", "is a file, not a folder"),
                                         ("/proc/healthagent-demo", "cannot write there")])
def test_prepare_where_no_folder_can_be_written_is_one_line(tmp_path, capsys, where, words):
    target = tmp_path / "file" if where == "file" else Path(where)
    if where == "file":
        target.write_text("x")
    code, _, err = demo("--prepare", str(target), capsys=capsys)
    assert code == 3 and err.startswith(f"healthagent: demo: --prepare {target}: ") and words in err
    assert err.count("\n") == 1


def test_replace_without_prepare_is_a_usage_mistake(capsys):
    code, _, err = demo("--replace", capsys=capsys)
    assert code == 3 and "--replace goes with --prepare DIR" in err


def test_the_demo_without_a_c_compiler_says_what_to_install(tmp_path):
    """The demo's GPUs are a stub library built with ``cc``: without one, the demo said
    StubBuildError in a traceback (exit 1)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = healthagent("demo", env={"PATH": str(empty), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == 3
    line = one_error_line(proc, "healthagent: demo: cc not found: install a C compiler (e.g. apt-get install gcc)")
    assert "--no-nvml" in line


@pytest.mark.parametrize("error,words", [
    (PermissionError(13, "Permission denied", "/var/lib/x"), "healthagent: explain: Permission denied: /var/lib/x"),
    (RuntimeError("a\nb"), "healthagent: explain: unexpected RuntimeError: a b (a bug: please report it)"),
])
def test_any_error_a_command_cannot_act_on_is_one_line_and_exit_3(monkeypatch, capsys, error, words):
    import healthagent.cli as cli

    def fails(_args):
        raise error

    monkeypatch.setitem(cli.COMMANDS, "explain", fails)
    assert cli.main(["explain", "94"]) == 3
    assert capsys.readouterr().err == words + "\n"


# -- the README's commands, as printed ----------------------------------------------------------------

def test_run_kube_dry_run_outside_a_pod_works_as_the_readme_prints_it(tmp_path):
    """``healthagent run --kube dry-run`` (the README's line) stopped on "node_name: ... must be
    told which" outside a pod; it reports as this host, and says so."""
    if os.path.exists(SERVICE_ACCOUNT_TOKEN):
        pytest.skip("this test process runs in a pod")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HEALTHAGENT_", "KUBERNETES_", "NODE_NAME"))}
    env["HOME"] = str(tmp_path)  # the state goes under it
    port = free_port_pair()
    # The README's command; --listen only so that the test does not need 9410 free here.
    agent = subprocess.Popen([sys.executable, "-m", "healthagent", "run", "--kube", "dry-run",
                              "--listen", f"127.0.0.1:{port}"],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in agent.stderr:
            seen.append(line)
            if "agent started" in line or "healthagent:" in line:
                break
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0, "".join(seen)
    finally:
        if agent.poll() is None:
            agent.kill()
    name = socket.gethostname().lower()
    assert any(f"the dry run reports as node {name!r}, this host's name" in line for line in seen), seen
    assert f"node={name} kube=dry-run" in seen[-1]


def test_classify_on_a_terminal_says_it_reads_standard_input(tmp_path):
    """With no file, ``classify`` reads stdin: on a terminal it used to wait without a word."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "healthagent", "classify"], cwd=REPO, stdin=follower,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(follower)
    try:
        # The note comes before any input is read; without one the command waits for input, so
        # the test gives up (a failure, never a hang) if nothing is said in a minute.
        said, _, _ = select.select([proc.stderr], [], [], 60)
        note = proc.stderr.readline() if said else ""
        assert note.startswith("classify: reading kernel-log text from standard input: paste lines, then Ctrl-D")
        os.write(leader, b"\x04")  # Ctrl-D: the end of the input on a terminal
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and out == "" and "0 XID lines in stdin (0 lines read)" in err


def test_classify_from_a_pipe_says_nothing_but_its_summary():
    proc = healthagent("classify", stdin=b"")
    assert proc.returncode == 0 and proc.stderr.decode() == "0 XID lines in stdin (0 lines read)\n"


def test_check_help_gives_the_exit_codes():
    proc = healthagent("check", "--help")
    text = " ".join(proc.stdout.decode().split())
    assert proc.returncode == 0
    assert ("exit codes: 0 healthy; 1 degraded (monitor to reset_gpu: the node stays in); 2 node action required "
            "(reboot_node or replace_node); 3 could not run") in text


def test_the_descriptions_name_every_fabric():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    top = " ".join(healthagent("--help").stdout.decode().split())
    for text in (project["description"], top):
        assert "GPU, EFA and InfiniBand/RoCE health agent" in text


PROVIDERS = ("apt-get install", "Debian package", "pip install", "python -m ", "go install", "(iproute2)", "(util-linux)")


def test_every_skip_for_a_missing_tool_names_what_provides_it(monkeypatch):
    """A newcomer who sees "skipped: X not installed" learns from the same line how to get X."""
    import ast

    from tests.support.deploy import NO_KUBECTL, NO_OLDEST_KUBECTL
    from tests.support.envtest import ASSETS_ENV, missing_reason
    from tests.support.nvml_stub import NO_CC

    monkeypatch.delenv(ASSETS_ENV, raising=False)  # the reason a fresh machine gives

    reasons = [NO_CC, NO_KUBECTL, NO_OLDEST_KUBECTL, missing_reason()]
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("skip", "importorskip"):
                for arg in [*node.args, *(k.value for k in node.keywords if k.arg == "reason")]:
                    text = "".join(part.value for part in ast.walk(arg)
                                   if isinstance(part, ast.Constant) and isinstance(part.value, str))
                    if "not installed" in text:
                        reasons.append(f"{path.name}: {text}")
    missing = [reason for reason in reasons if not any(p in reason for p in PROVIDERS)]
    assert not missing and len(reasons) > 10, missing
