"""One ``Settings`` dataclass from defaults, an optional YAML file, ``HEALTHAGENT_*`` env and flags.

Precedence, lowest first: defaults, YAML file (``--config`` / ``HEALTHAGENT_CONFIG``), environment,
command-line flags. A DaemonSet sets env from its manifest and keeps policy in a ConfigMap file, a
person on a node passes flags: all three must be able to say everything.

Every bad value stops start-up with one ``ConfigError`` line that names the key, what was wrong and
how to fix it, because a misconfigured health agent that starts anyway is worse than one that
does not start.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping
from urllib.parse import urlsplit

import yaml

from healthagent.kube_syntax import label_selector_problem, qualified_name_problem

ENV_PREFIX = "HEALTHAGENT_"
KUBE_MODES = ("in-cluster", "kubeconfig", "dry-run", "off")
CONDITION_VOCABULARIES = ("healthagent", "eks")  # healthagent/effects/conditions.py
TRAINING_INTAKE_MODES = ("token", "open", "off")
TRAINING_PORT_OFFSET = 2  # the intake's port, unless training_listen says: listen's port + 2
TRAINING_PORT = 9412  # so beside the default listen port, 9410: the DaemonSet's hostPort
MIN_TRAINING_KEY_CHARS = 32  # 128 random bits written as hex
_NAMESPACE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label


# The largest value of each bounded number: past these a setting can only be a mistake, and a
# mistaken one is dangerous (a source interval of 1e308 s never collects again, so its faults go
# unseen; 10**20 expected GPUs make every node "missing" GPUs).
MAXIMA: dict[str, float] = {
    **dict.fromkeys(("nvml_interval_seconds", "efa_interval_seconds", "rdma_interval_seconds",
                     "dcgm_interval_seconds"), 3600.0),
    **dict.fromkeys(("dcgm_timeout_seconds", "source_timeout_seconds"), 600.0),
    "kmsg_poll_seconds": 60.0, "state_save_interval_seconds": 86400.0,
    "foreign_condition_quiet_seconds": 86400.0,
    "idle_seconds": 30.0,  # half the liveness probe's heartbeat timeout (60 s)
    "replace_noexecute_grace_seconds": 7 * 86400.0, "training_job_idle_seconds": 30 * 86400.0,
    "expected_gpus": 1024, "expected_efa_devices": 1024, "kmsg_max_records_per_cycle": 10_000_000,
    "training_max_jobs": 100_000,
}


class ConfigError(Exception):
    """A configuration problem; ``str()`` is the one line shown to the operator."""


def shown(value: Any, limit: int = 64) -> str:
    """A value or key as a one-line message shows it: quoted, control characters escaped, at most
    ``limit`` characters. Rendered with ``reprlib``, which looks at a bounded number of items and
    levels, so the cost is bounded too: a nested value in a file is never expanded whole only to
    be cut (every error about a policy or settings value goes through here)."""
    bounded = reprlib.Repr()
    bounded.maxlevel = 2
    bounded.maxdict = bounded.maxlist = bounded.maxtuple = bounded.maxset = bounded.maxfrozenset = 3
    bounded.maxstring = bounded.maxother = bounded.maxlong = limit
    try:
        text = bounded.repr(value)
    except ValueError:  # an integer past the interpreter's digit limit for str()
        text = f"<a number of about {value.bit_length() * 0.30103:.0f} digits>" if isinstance(value, int) else "<?>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _setting(default: Any, help: str, fix: str = "") -> Any:
    return field(default=default, metadata={"help": help, "fix": fix})


@dataclass(frozen=True)
class Settings:
    host_root: str = _setting("/", "where the host's /sys, /dev/kmsg and logs are read from")
    kernel_log: str | None = _setting(None, "read this kernel-log file instead of dev/kmsg")
    listen: str = _setting("0.0.0.0:9410", "HOST:PORT for /metrics, /healthz and /readyz (the agent's own port)",
                           "use HOST:PORT, e.g. 0.0.0.0:9410")
    node_name: str = _setting("", "this node's name (downward API NODE_NAME)",
                              "set NODE_NAME from the downward API (spec.nodeName)")
    kube: str = _setting("in-cluster", "Kubernetes access: in-cluster, kubeconfig, dry-run or off",
                         "use one of: " + ", ".join(KUBE_MODES))
    kubeconfig: str | None = _setting(None, "kubeconfig file when kube=kubeconfig")
    nvml: bool = _setting(True, "read GPUs through NVML")
    nvml_interval_seconds: float = _setting(10.0, "seconds between NVML collections")
    efa_interval_seconds: float = _setting(10.0, "seconds between EFA sysfs collections")
    rdma_interval_seconds: float = _setting(10.0, "seconds between InfiniBand/RoCE (mlx5 and other non-EFA RDMA) "
                                                  "port collections")
    kmsg_poll_seconds: float = _setting(0.1, "seconds between kernel-log reads when its input cannot wake the loop")
    kmsg_max_records_per_cycle: int = _setting(50_000, "kernel-log records handled per read before yielding")
    idle_seconds: float = _setting(
        10.0, "longest sleep of the loop while nothing is due and nothing woke it (it also heartbeats "
              "the liveness probe once a cycle)")
    dcgm_url: str | None = _setting(None, "dcgm-exporter /metrics URL; unset = off",
                                    "use http(s)://HOST[:PORT]/PATH, e.g. http://localhost:9400/metrics")
    dcgm_interval_seconds: float = _setting(30.0, "seconds between dcgm-exporter scrapes")
    dcgm_timeout_seconds: float = _setting(2.0, "dcgm-exporter scrape timeout")
    expected_gpus: int | None = _setting(None, "GPUs this node must have; fewer is GPU_MISSING")
    expected_efa_devices: int | None = _setting(None, "EFA devices this node must have (p5.48xlarge: 32)")
    efa_expected_from_instance_type: bool = _setting(
        False, "expect every EFA interface the instance type supports (fleets that attach them all)")
    policy_file: str | None = _setting(None, "YAML policy overrides (XID actions, thresholds, rules)")
    state_file: str = _setting("/var/lib/healthagent/state.json", "state that survives restarts",
                               "set a file path on a hostPath volume, e.g. /var/lib/healthagent/state.json")
    taint_key: str = _setting("healthagent.io/unhealthy", "taint key the agent owns",
                              "use a key under healthagent.io/")
    replace_noexecute_grace_seconds: float = _setting(
        120.0, "seconds between NoSchedule and NoExecute for replace_node and reboot_node (0 = at once)")
    reboot_node_noexecute: bool = _setting(
        True, "reboot_node also gets NoExecute after the grace, as replace_node does (false: NoSchedule only)")
    condition_vocabulary: str = _setting(
        "healthagent", "node conditions: healthagent (GpuHealthy/NetworkHealthy) or eks (AcceleratedHardwareReady/"
                       "NetworkingReady, which Karpenter node repair and EKS node auto repair act on; only on "
                       "clusters without the EKS node monitoring agent)",
        "use one of: " + ", ".join(CONDITION_VOCABULARIES))
    foreign_condition_quiet_seconds: float = _setting(
        660.0, "the longest another writer of one of the agent's conditions (the EKS node monitoring agent) "
               "may go without writing it before the agent takes the condition back; a writer seen writing "
               "more often is released after three of its longest gaps, at least 60 s")
    budget_max_fraction: float = _setting(0.10, "largest share of GPU nodes that may carry the taint",
                                          "use a fraction between 0 and 1, e.g. 0.1")
    budget_max_nodes: int | None = _setting(None, "largest number of GPU nodes that may carry the taint")
    budget_scope_label: str = _setting(
        "", "count the budget per value of this node label (e.g. karpenter.sh/nodepool, "
            "eks.amazonaws.com/nodegroup): each pool gets its own share; unset = one budget for the fleet",
        "use a label key, e.g. karpenter.sh/nodepool")
    budget_node_selector: str = _setting("nvidia.com/gpu.present=true",
                                         "label selector that counts the cluster's GPU nodes",
                                         "use the API's selector syntax, e.g. nvidia.com/gpu.present=true "
                                         "or node.kubernetes.io/instance-type in (p5.48xlarge)")
    budget_namespace: str = _setting("", "namespace of the budget's Lease objects (empty: the agent's own)",
                                     "use a namespace name (lower-case letters, digits and '-', at most "
                                     "63), e.g. healthagent, or leave it empty")
    hyperpod_labels: bool = _setting(False, "also set sagemaker.amazonaws.com/node-health-status")
    training_max_jobs: int = _setting(64, "distinct training jobs tracked at once")
    training_job_idle_seconds: float = _setting(3600.0, "forget a training job idle this long")
    log_level: str = _setting("INFO", "logging level", "use DEBUG, INFO, WARNING or ERROR")
    source_timeout_seconds: float = _setting(
        5.0, "longest wait for one NVML/EFA/dcgm collection before the source is reported hung "
             "(dcgm gets at least twice dcgm_timeout_seconds)")
    # repr=False: a secret must not reach a log line through a printed Settings.
    training_token: str = field(default="", repr=False, metadata={
        "help": "the cluster's training key: job tokens are derived from it, and it opens every job "
                "itself (empty = no key: with training_intake=token nothing is accepted); set "
                "HEALTHAGENT_TRAINING_TOKEN from the Secret healthagent-training",
        "fix": "use printable ASCII without spaces, e.g. the output of 'openssl rand -hex 32'"})
    training_intake: str = _setting(
        "token", "who may post training reports: token (a job token or the training key), open "
                 "(anyone who reaches the intake port; warned at start) or off (no intake)",
        "use one of: token, open, off")
    training_listen: str = _setting(
        "", "HOST:PORT of the training intake (POST /v1/training), a listener of its own; empty = "
            "the host of listen and listen's port + 2 (9412 beside the default 9410; port 0 when "
            "listen's port is 0)",
        "use HOST:PORT, e.g. 0.0.0.0:9412")
    state_save_interval_seconds: float = _setting(
        60.0, "longest time between state-file saves when only counter histories or the kernel-log "
              "cursor moved (a new XID, finding or operator clear is saved at once)")

    def listen_address(self) -> tuple[str, int]:
        return _host_port(self.listen)

    def training_listen_address(self) -> tuple[str, int]:
        """Where the intake listens: ``training_listen``, else listen's host two ports above
        listen's (0, a free port, when listen asks for one). It follows ``listen`` so that a
        second agent on one machine, moved with ``--listen``, moves its intake too."""
        if self.training_listen:
            return _host_port(self.training_listen)
        host, port = self.listen_address()
        return host, (port + TRAINING_PORT_OFFSET if port else 0)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


_FIELDS = {f.name: f for f in fields(Settings)}


def _type_name(f: dataclasses.Field) -> str:
    return str(f.type).replace(" | None", "")


def _convert(key: str, f: dataclasses.Field, value: Any, origin: str) -> Any:
    """Convert a raw value (YAML scalar or env/flag string) to the field's type."""
    kind = _type_name(f)
    optional = "None" in str(f.type)
    where = f"{origin} {key}"
    if value is None or (isinstance(value, str) and value.strip() == "" and optional):
        if optional:
            return None
        raise ConfigError(f"{where} is empty; {f.metadata['help']}")
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError
            return int(str(value).strip())
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            number = float(str(value).strip())
            if not math.isfinite(number):  # nan/inf pass every comparison check silently
                raise ConfigError(f"{where}={shown(value)} is not a finite number; "
                                  f"{f.metadata['fix'] or f.metadata['help']}")
            return number
        if isinstance(value, (dict, list)):
            raise ValueError
        return str(value)
    except ValueError:
        raise ConfigError(
            f"{where}={shown(value)} is not a valid {kind}; {f.metadata['fix'] or f.metadata['help']}"
        ) from None


def _validate(s: Settings) -> None:
    def bad(key: str, why: str) -> ConfigError:
        fix = _FIELDS[key].metadata["fix"]
        return ConfigError(f"{key}: {why}" + (f"; {fix}" if fix else ""))

    if s.kube not in KUBE_MODES:
        raise bad("kube", f"{shown(s.kube)} is not a mode")
    if s.kube == "kubeconfig" and not s.kubeconfig:
        raise ConfigError("kubeconfig: kube=kubeconfig needs a file; set --kubeconfig PATH")
    for key in ("listen", "training_listen"):
        value = getattr(s, key)
        host, _, port = value.rpartition(":")
        if (value or key == "listen") and (not host or not port.isdigit() or not 0 <= int(port) < 65536):
            raise bad(key, f"{shown(value)} is not HOST:PORT")
    if s.training_intake not in TRAINING_INTAKE_MODES:
        raise bad("training_intake", f"{shown(s.training_intake)} is not a mode")
    if s.training_intake != "off" and not s.training_listen and s.listen_address()[1] + TRAINING_PORT_OFFSET > 65535:
        raise bad("training_listen", f"listen's port {s.listen_address()[1]} leaves no port {TRAINING_PORT_OFFSET} "
                                     "above it for the intake; give the intake its own, e.g. --training-listen "
                                     "0.0.0.0:9412, or move --listen")
    if s.training_intake != "off" and s.listen_address()[1] and \
            s.training_listen_address() == s.listen_address():
        raise bad("training_listen", f"{shown(s.training_listen or s.listen)} is also listen's address: "
                                     "the intake needs a port of its own")
    if s.condition_vocabulary not in CONDITION_VOCABULARIES:
        raise bad("condition_vocabulary", f"{shown(s.condition_vocabulary)} is not a vocabulary")
    if not 0.0 <= s.budget_max_fraction <= 1.0:
        raise bad("budget_max_fraction", f"{s.budget_max_fraction} is outside 0..1")
    if not s.taint_key.startswith("healthagent.io/"):
        raise bad("taint_key", f"{shown(s.taint_key)} is not under healthagent.io/")
    problem = qualified_name_problem(s.taint_key)
    if problem:
        raise bad("taint_key", f"{shown(s.taint_key)} is not a valid Kubernetes key: {problem}")
    if s.budget_scope_label and label_selector_problem(f"!{s.budget_scope_label}"):
        raise bad("budget_scope_label", f"{shown(s.budget_scope_label)} is not a label key")
    if s.budget_scope_label.startswith(("healthagent.io/", "sagemaker.amazonaws.com/")):
        raise bad("budget_scope_label", f"{shown(s.budget_scope_label)} is a label each node's agent may write on "
                                        "its own node: a node could choose its pool")
    problem = label_selector_problem(s.budget_node_selector)
    if problem:
        raise bad("budget_node_selector", f"{shown(s.budget_node_selector)} is not a label selector: {problem}")
    if s.budget_namespace and not _NAMESPACE.fullmatch(s.budget_namespace):
        raise bad("budget_namespace", f"{shown(s.budget_namespace)} is not a namespace name")
    if not s.state_file.strip():
        raise bad("state_file", "is empty")
    if os.path.isdir(s.state_file):
        raise bad("state_file", f"{shown(s.state_file, 200)} is a directory, not a file")
    if s.dcgm_url is not None:
        problem = _http_url_problem(s.dcgm_url)
        if problem:
            raise bad("dcgm_url", f"{shown(s.dcgm_url, 200)} {problem}")
    if not re.fullmatch(r"[\x21-\x7e]*", s.training_token):
        raise bad("training_token", "contains spaces or characters an HTTP header cannot carry")
    if s.training_token and len(s.training_token) < MIN_TRAINING_KEY_CHARS:
        # every job token is derived from the key: a short one is found by trying them all
        raise bad("training_token", f"is {len(s.training_token)} characters; a key needs at least "
                                    f"{MIN_TRAINING_KEY_CHARS} (128 random bits as hex)")
    for key in ("nvml_interval_seconds", "efa_interval_seconds", "rdma_interval_seconds", "kmsg_poll_seconds",
                "idle_seconds", "dcgm_interval_seconds", "dcgm_timeout_seconds", "source_timeout_seconds",
                "state_save_interval_seconds", "foreign_condition_quiet_seconds"):
        if getattr(s, key) <= 0:
            raise ConfigError(f"{key}: must be greater than 0 seconds")
    if s.replace_noexecute_grace_seconds < 0:
        raise ConfigError("replace_noexecute_grace_seconds: must be 0 or more seconds")
    for key in ("expected_gpus", "expected_efa_devices", "budget_max_nodes"):
        value = getattr(s, key)
        if value is not None and value < 0:
            raise ConfigError(f"{key}: must be 0 or more")
    for key in ("kmsg_max_records_per_cycle", "training_max_jobs"):
        if getattr(s, key) < 1:
            raise ConfigError(f"{key}: must be at least 1")
    if s.training_job_idle_seconds <= 0:
        raise ConfigError("training_job_idle_seconds: must be greater than 0 seconds")
    for key, limit in MAXIMA.items():
        value = getattr(s, key)
        if value is not None and value > limit:
            raise ConfigError(f"{key}: {value:g} is out of range; use at most {limit:g}")
    if s.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise bad("log_level", f"{shown(s.log_level)} is not a level")
    if not os.path.isdir(s.host_root):
        raise ConfigError(f"host_root: {shown(s.host_root, 200)} is not a directory; pass --host-root DIR")


def _http_url_problem(url: str) -> str | None:
    """Why ``url`` is not http(s)://HOST[:PORT]/PATH, or None."""
    if any(ch.isspace() for ch in url):
        return "contains whitespace"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return "is not an http:// or https:// URL"
    if not parts.hostname:
        return "has no host"
    try:
        parts.port
    except ValueError:
        return "has an invalid port"
    return None


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping names one key twice; ``key`` and the two places (1-based) say which and where."""

    def __init__(self, key: Any, first: Any, mark: Any) -> None:
        super().__init__(None, None, f"key {shown(key)} appears twice", mark)
        self.key, self.first_line, self.line = key, first.line + 1, mark.line + 1
        self.first_column, self.column = first.column + 1, mark.column + 1

    def places(self) -> str:
        """``lines 2 and 4``, or ``line 1, columns 7 and 23`` for two on one line (a flow mapping)."""
        if self.first_line != self.line:
            return f"lines {self.first_line} and {self.line}"
        return f"line {self.line}, columns {self.first_column} and {self.column}"


class AnchorRefused(yaml.composer.ComposerError):
    """The document uses an anchor (``&name``) or an alias (``*name``); ``mark`` says where."""

    def __init__(self, kind: str, name: str, mark: Any) -> None:
        super().__init__(None, None, f"{kind} {shown(name)}", mark)
        self.kind, self.name, self.line = kind, name, mark.line + 1


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` for the files that configure the agent, refusing what would make one
    silently weaker or never answer:

    - a mapping naming a key twice, on two lines or on one (``{94: replace_node, 94: none}``):
      PyYAML keeps the last one silently, which would quietly take XID 94 off the node. Keys are
      compared as loaded, so ``94`` and ``0x5e`` are the same key; ``<<`` merges may still be
      overridden, as YAML intends;
    - anchors and aliases (``&a``/``*a``): a kilobyte of nested aliases stands for a billion
      values, which any walk over the document (a check, an error message) would expand. A
      settings or policy file has no need of them, so they are refused where the parser meets
      them, before anything is built or shown.
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise AnchorRefused("alias", f"*{event.anchor}", event.start_mark)
        if getattr(event, "anchor", None) is not None:
            raise AnchorRefused("anchor", f"&{event.anchor}", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base constructor says so
                continue
            if first is not key_node.start_mark:
                raise DuplicateKey(key, first, key_node.start_mark)
        return super().construct_mapping(node, deep)


MAX_YAML_BYTES = 1024 * 1024  # a settings or policy file is a few lines; this bounds a wrong path


def read_yaml(path: str, what: str, flag: str, error: type[Exception], *, unique_keys: bool = True,
              max_bytes: int = MAX_YAML_BYTES) -> Any:
    """Parse a YAML file or raise ``error`` with one line naming the file, the problem and the fix.

    Shared by the settings file and the policy file so both fail the same way: an unreadable path
    names the flag to fix, broken YAML names the line, a key given twice names the key and both
    places (``unique_keys``; which of two values was meant is not for the agent to guess; an
    anchor or alias is refused there too), a file nested past the parser's depth, over
    ``max_bytes`` or holding a scalar that cannot be built says so.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise error(f"{what}: {path!r} is larger than {max_bytes} bytes; fix {flag}")
        return yaml.load(raw.decode("utf-8"), Loader=UniqueKeyLoader if unique_keys else yaml.SafeLoader)
    except OSError as exc:
        raise error(f"{what}: cannot read {path!r} ({exc.strerror}); fix {flag}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{what}: {path!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except DuplicateKey as exc:
        raise error(f"{what}: {path!r} names key {shown(exc.key)} twice ({exc.places()}); keep one") from None
    except AnchorRefused as exc:
        raise error(f"{what}: {path!r} uses the YAML {exc.kind} {exc.name} at line {exc.line}; write the "
                    "value out where it is used (anchors and aliases are not read)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise error(f"{what}: {path!r} is not valid YAML{at}; fix the syntax") from None
    except RecursionError:
        raise error(f"{what}: {path!r} nests deeper than YAML can be read; fix the file") from None
    except ValueError as exc:  # a scalar YAML types but cannot build: 5,000 digits, a 13th month
        reason = str(exc).split(":")[0][:80]
        raise error(f"{what}: {path!r} holds a value that cannot be read ({reason}); fix the file") from None


def _load_yaml(path: str) -> dict[str, Any]:
    data = read_yaml(path, "config", "the path", ConfigError)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path!r} must be a mapping of setting: value")
    return data


def load_settings(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
    set_values: Mapping[str, Any] | None = None,
) -> Settings:
    """Build Settings from (lowest first) defaults, YAML, env, ``--set KEY=VALUE`` items, flags.
    Raises ConfigError, naming each value as it was given (``--set key=...``, ``--flag=...``)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG")
    if config_file:
        written: dict[str, Any] = {}  # setting -> its key as written (state-file and state_file are one)
        for raw_key, raw in _load_yaml(config_file).items():
            key = str(raw_key).replace("-", "_")
            if key not in _FIELDS:
                raise ConfigError(
                    f"config: unknown key {shown(raw_key)} in {config_file}; valid keys: "
                    + ", ".join(sorted(_FIELDS))
                )
            if key in written:
                raise ConfigError(f"config: {shown(written[key])} and {shown(raw_key)} in {config_file} both set {key}; "
                                  "keep one")
            written[key] = raw_key
            values[key] = _convert(key, _FIELDS[key], raw, f"{config_file}:")
    for key, f in _FIELDS.items():
        env_key = ENV_PREFIX + key.upper()
        if env_key in env:
            values[key] = _convert(env_key, f, env[env_key], "env")
    if "node_name" not in values and env.get("NODE_NAME"):
        values["node_name"] = env["NODE_NAME"]
    for key, raw in (set_values or {}).items():
        if key not in _FIELDS:
            raise ConfigError(f"--set {key}: not a setting; valid keys: " + ", ".join(sorted(_FIELDS)))
        values[key] = _convert(key, _FIELDS[key], raw, "--set")
    for key, raw in (flags or {}).items():
        if raw is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"flag --{key.replace('_', '-')} is not a setting")
        values[key] = _convert("--" + key.replace("_", "-"), _FIELDS[key], raw, "flag")
    settings = Settings(**values)
    _validate(settings)
    return settings
