"""The operator's policy: XID action overrides, thresholds, per-code rules and disabled rules, from
one YAML file.

A policy file looks like this (every key optional; see ``docs/findings.md#policy-file`` and
``tests/fixtures/policy/policy-example.yaml``)::

    xid:                 # XID number -> action; overrides the bundled catalog row
      94: restart_app
    sxid:                # NVSwitch SXid number -> action (default monitor)
      12028: reboot_node
    mlx5:                # ConnectX (mlx5) kernel-log event -> action; overrides mlx5_events.csv
      module_bad_cable: reboot_node
    disabled_rules: [GPU_POWER_THROTTLE]
    rdma_ports:          # InfiniBand/RoCE ports that must be up, and their rate (rdma_ports_file.py)
      "mlx5_[0-7]/1": {up: true, rate_gbps: 400}
    findings:            # when a finding may open (debounce.py; parsed in debounce_file.py)
      GPU_NVLINK_ERRORS: {count: 3, window: 10m, after_boot_grace: 15m}
    thresholds:
      incident_quiet_seconds: 180
      efa_rx_drops_per_minute: 500

It is validated completely at start-up: an unknown key, an action that does not exist, a negative
or non-numeric threshold each stop the agent with one ``PolicyError`` line that names the key and
the fix. A health agent that silently ignores a typo in its policy would take nodes out (or keep
bad ones in) against the operator's intent. The same goes for a rule given twice (``94:`` twice, or
``94`` and ``"94"``): which one was meant is not for the agent to guess, so that is an error
naming both, and so is a number outside what it can mean (an XID of 24 digits, a threshold of
1e308).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from healthagent.config import read_yaml
from healthagent.model import Action
from healthagent.policy.debounce import ALIASES, Rule
from healthagent.policy.debounce_file import Rules, built_in_rules, parse_rules
from healthagent.policy.findings import DOCS, FINDING_CODES
from healthagent.policy.mlx5_catalog import event_ids
from healthagent.policy.policy_error import PolicyError
from healthagent.policy.policy_error import shown_key as _shown
from healthagent.policy.policy_error import written_value as _written
from healthagent.policy.rdma_ports_file import PortExpectation, expectation_for, parse_rdma_ports
from healthagent.policy.scope import ScopePolicy, parse_scope
from healthagent.policy.threshold_catalog import THRESHOLDS


# Every tunable number, its default and the source of that default: thresholds.csv
# (``threshold_catalog.py``).

_NUMBER = re.compile(r"[0-9]{1,64}")  # ASCII digits only: str.isdigit() also takes "٩٤" and "²"
# The file's sections and what each says (docs/reference/settings.md is generated from this table).
SECTIONS: dict[str, str] = {
    "xid": "XID number -> action; overrides the bundled catalog row (xid_catalog.csv)",
    "sxid": "NVSwitch SXid number -> action (default monitor)",
    "disabled_rules": "a list of the finding codes whose rules do not run",
    "thresholds": "tunable numbers by name (the thresholds table)",
    "findings": "when each finding may open: count, window, after_boot_grace per code (debounce.py)",
    "mlx5": "ConnectX (mlx5) kernel-log event -> action; overrides mlx5_events.csv",
    "rdma_ports": "InfiniBand/RoCE ports that must be up, and their rate (rdma_ports_file.py)",
    "scope": "gpu or node per code or action, gpu_quarantine_max, and the device taints' effects (scope.py)",
}
TOP_LEVEL_KEYS = tuple(SECTIONS)
# The driver's XID and SXid fields: the kernel-log parser reads at most nine digits (a longer
# number is a malformed line), so a rule for a larger one could never match anything.
MAX_XID = 999_999_999
# The largest value of each kind of threshold: far past any real use, small enough that windows,
# counts and the arithmetic on them stay meaningful (to turn a rule off, use disabled_rules).
MAX_BY_KIND = {"seconds": 30 * 24 * 3600.0, "count": 1_000_000.0, "number": 1e9, "factor": 1000.0}


@dataclass(frozen=True)
class Policy:
    """Thresholds, windows, XID/SXid/mlx5 action overrides and disabled rules; immutable once loaded."""

    thresholds: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({k: t.default for k, t in THRESHOLDS.items()}))
    xid_actions: Mapping[int, Action] = field(default_factory=lambda: MappingProxyType({}))
    sxid_actions: Mapping[int, Action] = field(default_factory=lambda: MappingProxyType({}))
    mlx5_actions: Mapping[str, Action] = field(default_factory=lambda: MappingProxyType({}))
    disabled_rules: frozenset[str] = frozenset()
    rules: Rules = field(default_factory=built_in_rules)  # when each finding may open
    rdma_ports: tuple[PortExpectation, ...] = ()  # what the operator says the fabric ports must be
    scope: ScopePolicy = field(default_factory=ScopePolicy)  # gpu or node per code/action (policy/scope.py)
    source: str = ""  # the file it came from; "" = built-in defaults

    def __getattr__(self, name: str) -> float:
        """``policy.incident_quiet_seconds`` reads a threshold (the names are fixed above)."""
        thresholds = self.__dict__.get("thresholds")
        if thresholds is not None and name in thresholds:
            return thresholds[name]
        raise AttributeError(name)

    def enabled(self, code: str) -> bool:
        return code not in self.disabled_rules

    def port_expectation(self, name: str, netdev: str = "") -> PortExpectation | None:
        """The ``rdma_ports:`` entry that decides for this InfiniBand/RoCE port, if any."""
        return expectation_for(self.rdma_ports, name, netdev)

    def rule(self, code: str) -> Rule:
        """The effective rule of a finding code: the built-in table with the file's entries."""
        return self.rules.rule(code)


def _actions(section: str, raw: Any, what: str) -> Mapping[int, Action]:
    """``xid:``/``sxid:`` number -> action."""
    def number(key: Any) -> int:
        if isinstance(key, bool) or not _NUMBER.fullmatch(str(key).strip()):
            raise PolicyError(f"{section}.{_shown(key)}: {_written(key)} is not an {what} number; use an "
                              "integer such as 94")
        value = int(str(key).strip())
        if not 1 <= value <= MAX_XID:
            raise PolicyError(f"{section}.{_shown(key)}: {what} {_shown(key)} is out of range; {what} numbers "
                              f"are 1 to {MAX_XID}")
        return value

    return _action_map(section, raw, f"{what} number", "{94: restart_app}", number, what)


def _mlx5_actions(raw: Any) -> Mapping[str, Action]:
    """``mlx5:`` event id -> action, the ids those of ``mlx5_events.csv`` (any case, once each)."""
    known = event_ids()

    def event(key: Any) -> str:
        value = str(key).strip().lower()
        if isinstance(key, bool) or value not in known:
            raise PolicyError(f"mlx5.{_shown(key)}: {_written(key)} is not a ConnectX event of "
                              f"healthagent/policy/mlx5_events.csv; use one of: " + ", ".join(known))
        return value

    return _action_map("mlx5", raw, "ConnectX event", "{module_bad_cable: reboot_node}", event, "event")


def _action_map(section: str, raw: Any, keys: str, example: str, read_key: Callable[[Any], Any],
                noun: str) -> Mapping[Any, Action]:
    """A section of ``key: action`` rows, each key read by ``read_key`` and named once."""
    if raw is None:
        return MappingProxyType({})
    if not isinstance(raw, dict):
        raise PolicyError(f"{section}: must be a mapping of {keys}: action, e.g. {example}")
    out: dict[Any, Action] = {}
    written: dict[Any, Any] = {}  # key as read -> the key as written, to name both of a pair
    for key, value in raw.items():
        name = read_key(key)
        if name in written:
            raise PolicyError(f"{section}.{name}: {_written(written[name])} and {_written(key)} both name "
                              f"{noun} {name}; keep one")
        written[name] = key
        if not isinstance(value, str):
            raise PolicyError(f"{section}.{name}: {_written(value)} is not an action; use one of: "
                              + ", ".join(a.value for a in Action))
        try:
            out[name] = Action.parse(value)
        except ValueError as exc:
            raise PolicyError(f"{section}.{name}: {exc}") from None
    return MappingProxyType(out)


def _threshold(key: str, raw: Any) -> float:
    spec = THRESHOLDS.get(key)
    if spec is None:
        raise PolicyError(f"thresholds.{_shown(key)}: unknown threshold; valid: " + ", ".join(sorted(THRESHOLDS)))
    example = f"e.g. {spec.default:g}"
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise PolicyError(f"thresholds.{key}: {_written(raw)} is not a number; use a number, {example}")
    try:
        value = float(raw)
    except (ValueError, OverflowError):  # OverflowError: an integer past what a float holds
        raise PolicyError(f"thresholds.{key}: {_written(raw)} is not a number; use a number, {example}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise PolicyError(f"thresholds.{key}: {_written(raw)} is not a finite number; use a number, {example}")
    if value < 0:
        raise PolicyError(f"thresholds.{key}: {value:g} is negative; use 0 or more, {example}")
    if spec.kind == "count" and (value < 1 or value != int(value)):
        raise PolicyError(f"thresholds.{key}: {value:g} must be a whole number of at least 1, {example}")
    if spec.kind == "factor" and value < 1:
        raise PolicyError(f"thresholds.{key}: {value:g} must be at least 1, {example}")
    if spec.above_zero and value == 0:
        raise PolicyError(f"thresholds.{key}: must be greater than 0 seconds, {example}")
    limit = spec.maximum if spec.maximum is not None else MAX_BY_KIND[spec.kind]
    if value > limit:
        off = "; to turn the rule off use disabled_rules" if spec.kind == "number" else ""
        unit = f" ({limit / 86400:g} days)" if spec.kind == "seconds" else ""
        raise PolicyError(f"thresholds.{key}: {value:g} is out of range; use at most {limit:.0f}{unit}{off}, "
                          f"{example}")
    return value


def _disabled(raw: Any) -> frozenset[str]:
    if raw is None:
        return frozenset()
    if isinstance(raw, str) or not isinstance(raw, list):
        raise PolicyError("disabled_rules: must be a list of finding codes, e.g. [GPU_POWER_THROTTLE]")
    out = set()
    for item in raw:
        code = item.strip().upper() if isinstance(item, str) else None  # never render a list whole
        if code not in FINDING_CODES:
            raise PolicyError(f"disabled_rules: unknown rule {_written(item)}; use a finding code from {DOCS}: "
                              + ", ".join(FINDING_CODES))
        out.add(code)
    return frozenset(out)


def parse_policy(data: Any, source: str = "", readings: Mapping[str, float] | None = None) -> Policy:
    """Validate an already-parsed policy document (a mapping). Raises PolicyError. ``readings``:
    seconds between the readings of each kind (``debounce_file.reading_intervals``), which a
    rule's window must be able to hold; None: that check is left out (nothing is read)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"policy: {source or 'the document'} must be a mapping with keys "
                          + ", ".join(TOP_LEVEL_KEYS))
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise PolicyError(f"policy: unknown key {_written(key)}; valid keys: " + ", ".join(TOP_LEVEL_KEYS))
    raw_thresholds = data.get("thresholds") or {}
    if not isinstance(raw_thresholds, dict):
        raise PolicyError("thresholds: must be a mapping of name: number, e.g. {incident_quiet_seconds: 180}")
    thresholds = {k: t.default for k, t in THRESHOLDS.items()}
    for key, raw in raw_thresholds.items():
        thresholds[str(key)] = _threshold(str(key), raw)
    aliases = {str(k): thresholds[str(k)] for k in raw_thresholds if str(k) in ALIASES}
    return Policy(
        thresholds=MappingProxyType(thresholds),
        xid_actions=_actions("xid", data.get("xid"), "XID"),
        sxid_actions=_actions("sxid", data.get("sxid"), "SXid"),
        mlx5_actions=_mlx5_actions(data.get("mlx5")),
        disabled_rules=_disabled(data.get("disabled_rules")),
        rules=parse_rules(data.get("findings"), aliases, readings),
        rdma_ports=parse_rdma_ports(data.get("rdma_ports"), PolicyError),
        scope=parse_scope(data.get("scope"), PolicyError),
        source=source,
    )


def load_policy(path: str | None, readings: Mapping[str, float] | None = None) -> Policy:
    """The built-in policy, or the operator's file merged over it. Raises PolicyError."""
    if not path:
        return Policy()
    return parse_policy(read_yaml(path, "policy", "--policy-file", PolicyError), source=path, readings=readings)
