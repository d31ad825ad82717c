"""Where the command line reads and writes when the user did not say: ``classify``'s input and
``run``'s state file outside a pod.

Why apart from the parser: both are decisions a person relies on without reading the code
(which log ``classify`` read, where ``run`` keeps its state), so each is a small pure function
with its wording next to it, tested on its own.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import sys
from dataclasses import dataclass, fields
from typing import Iterator, Mapping, TextIO

from healthagent.config import ENV_PREFIX, ConfigError, Settings, read_yaml

SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
POD_STATE_FILE: str = next(f.default for f in fields(Settings) if f.name == "state_file")
KERNEL_LOG = "dev/kmsg"  # under the host root, as check and run read it


class CannotRun(Exception):
    """A command cannot do its job (an input file that cannot be read); ``str()`` is one line."""


class InputUnreadable(Exception):
    """``classify``'s input cannot be read; ``str()`` is one line with the fix."""


# -- run: the state file ----------------------------------------------------------------------------

def in_a_pod(env: Mapping[str, str], token_path: str = SERVICE_ACCOUNT_TOKEN) -> bool:
    """Kubernetes started this process: the kubelet sets KUBERNETES_SERVICE_HOST in every
    container and mounts the service account's token (unless the pod opts out)."""
    return bool(env.get("KUBERNETES_SERVICE_HOST")) or os.path.exists(token_path)


def user_state_file(env: Mapping[str, str], home: str) -> str:
    """The state file of an agent run by hand: ``$XDG_STATE_HOME/healthagent/state.json``, else
    ``~/.local/state/healthagent/state.json`` (the XDG base directory rule; a relative
    XDG_STATE_HOME is ignored, as the rule says)."""
    base = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(home, ".local", "state")
    return os.path.join(base, "healthagent", "state.json")


def state_file_given(flag: str | None, set_values: Mapping[str, str], env: Mapping[str, str],
                     config_file: str | None) -> bool:
    """Whether the user named a state file anywhere: the flag, ``--set``, the environment or the
    settings file (which ``load_settings`` has already read and validated)."""
    if flag is not None or "state_file" in set_values or f"{ENV_PREFIX}STATE_FILE" in env:
        return True
    config_file = config_file or env.get(f"{ENV_PREFIX}CONFIG")
    if not config_file:
        return False
    data = read_yaml(config_file, "config", "the path", ConfigError) or {}
    return any(str(key).replace("-", "_") == "state_file" for key in data)


@dataclass(frozen=True)
class StateChoice:
    """Where ``run`` keeps its state, and the log line that says so (empty: nothing to say)."""

    path: str
    note: str = ""


def choose_state_file(given: bool, in_pod: bool, env: Mapping[str, str], home: str) -> StateChoice:
    """Outside a pod, an agent run by hand keeps its state in the user's own state directory,
    never in the pod's default: that file, on the node's hostPath, belongs to the DaemonSet's
    agent on this node, and a trial run (as root, on a GPU node) would overwrite its kernel-log
    cursor and open findings. A named file, or a run in a pod, is left as it is."""
    if given or in_pod:
        return StateChoice(path="")
    path = user_state_file(env, home)
    return StateChoice(path=path, note=(
        f"not in a pod: state goes to {path} ({POD_STATE_FILE} is the DaemonSet's; choose another "
        "with --state-file FILE)"))


# -- run: the node a dry run reports as -------------------------------------------------------------

@dataclass(frozen=True)
class NodeChoice:
    """The node name ``run`` uses when none was given (empty: none chosen), and the line saying so."""

    name: str
    note: str = ""


def dry_run_node_name(kube: str, node_name: str, in_pod: bool, hostname: str) -> NodeChoice:
    """The node name a dry run by hand uses when none was given: this host's name, lower case, as
    the kubelet registers a node by default.

    Only for ``dry-run`` outside a pod: it writes nothing, so a name that is not the node's
    misleads no one but the log, and ``run --kube dry-run`` then works as printed. In a pod the
    hostname is the pod's name, and a mode that writes (in-cluster, kubeconfig) must be told which
    node it acts on, never guess."""
    name = hostname.strip().lower()
    if kube != "dry-run" or node_name or in_pod or not name:
        return NodeChoice(name="")
    return NodeChoice(name=name, note=(
        f"not in a pod: the dry run reports as node {name!r}, this host's name (choose another with "
        "--node-name NAME)"))


# -- check: an input the user named -----------------------------------------------------------------

def named_kernel_log_problem(path: str | None) -> str | None:
    """Why the kernel log the user named (``--kernel-log``, ``kernel_log``) cannot be read, or None.

    A named input that is not there is a mistake to report, not a blind spot: ``check`` would
    otherwise say "healthy as far as seen" about a file it never read (a typo such as
    ``kern.lgo``). The default, ``dev/kmsg`` under the host root, is not named: when it is absent
    the kernel log stays *unobserved*, as the sources report it."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "does not exist" if exc.errno in (errno.ENOENT, errno.ENOTDIR) else "cannot be read"
        return (f"kernel_log (--kernel-log) {path!r} {why} ({exc.strerror or exc}); name the file that "
                "holds the kernel's lines (e.g. /var/log/kern.log, /var/log/messages), or leave it out to "
                "read dev/kmsg under --host-root")
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            return (f"kernel_log (--kernel-log) {path!r} is a folder; name the kernel-log file in it, "
                    "e.g. /var/log/kern.log")
    finally:
        os.close(fd)
    return None


# -- classify: the input ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ClassifyInput:
    """What ``classify`` reads: ``path`` (``-`` for stdin) and how its summary names it."""

    path: str
    where: str


def classify_input(file: str | None, host_root: str | None) -> ClassifyInput:
    """The file given, else the host root's kernel log when ``--host-root`` is given (what check
    and run read there), else stdin (``dmesg | healthagent classify``)."""
    if file is not None:
        return ClassifyInput(file, "stdin" if file == "-" else file)
    if host_root is not None:
        path = os.path.join(host_root, KERNEL_LOG)
        return ClassifyInput(path, path)
    return ClassifyInput("-", "stdin")


def open_lines(path: str) -> Iterator[str]:
    """The input's lines, decoded as UTF-8 with undecodable bytes as U+FFFD (never the locale's
    lone surrogates, which would leak into the JSON). A character device (``/dev/kmsg``) is read
    record by record up to its end, without waiting for new ones."""
    if path == "-":
        with io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace") as stream:
            yield from stream
        return
    try:
        is_device = stat.S_ISCHR(os.stat(path).st_mode)
        stream: TextIO | None = None if is_device else open(path, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise InputUnreadable(_unreadable(path, exc)) from None
    if stream is None:
        yield from _device_lines(path)
        return
    with stream:
        try:
            yield from stream
        except OSError as exc:  # a directory opens and fails at the first read
            raise InputUnreadable(_unreadable(path, exc)) from None


def _device_lines(path: str) -> Iterator[str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InputUnreadable(_unreadable(path, exc)) from None
    try:
        while True:
            try:
                record = os.read(fd, 16384)  # /dev/kmsg: one record per read
            except BlockingIOError:
                return  # the end of what the kernel holds now
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on from the next
                    continue
                raise InputUnreadable(_unreadable(path, exc)) from None
            if not record:
                return
            yield from record.decode("utf-8", errors="replace").splitlines(keepends=True)
    finally:
        os.close(fd)


def _unreadable(path: str, exc: OSError) -> str:
    return (f"classify: cannot read {path!r} ({exc.strerror or exc}); pass a file of kernel-log text "
            "(dmesg, journalctl -k) or - for stdin")


def summary(xids: int, sxids: int, lines: int, where: str, adapter_events: int = 0) -> str:
    """The line ``classify`` prints on stderr when it is done: how many of the lines it read were
    XIDs (and SXids and ConnectX adapter events, when there were any), so "nothing on stdout"
    reads as "none found", not "nothing read"."""
    def count(n: int, what: str) -> str:
        return f"{n} {what} line{'' if n == 1 else 's'}"

    parts = [count(xids, "XID")] + ([count(sxids, "SXid")] if sxids else []) + (
        [count(adapter_events, "ConnectX (mlx5) event")] if adapter_events else [])
    found = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{found} in {where} ({lines} line{'' if lines == 1 else 's'} read)"
