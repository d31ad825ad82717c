"""Scope: whether a finding concerns one GPU (``gpu``) or the whole node (``node``).

Why data: the unit a fault takes out of service is an operator's call as much as the action is.
The defaults live in ``scope.csv`` next to the catalogs: NVIDIA's GPU-local classes (RESTART_APP,
RESET_GPU, the monitor level) are ``gpu``; ``reboot_node`` and ``replace_node`` are ``node``
(so XID 63/64/94/95, which the default policy maps to replace_node, stay at node scope). A
policy file's ``scope:`` section overrides a code's or an action's scope, sets how many GPUs may
be quarantined at once before the node becomes the unit (``gpu_quarantine_max``), whether
monitor-level findings show as a ``None`` device taint, and whether device quarantines use
``NoExecute`` at all (``noexecute``).

``noexecute`` is on by default. A ``reset_gpu`` device goes to ``NoExecute`` after the same grace
as the node (``replace_noexecute_grace_seconds``), because a reset needs the GPU drained: with
``NoSchedule`` alone the pod whose claim holds the bad GPU keeps it, and a container that
restarts comes back onto the same device. The eviction is one disruption of the job, so it is
counted as the node's would be: a device ``NoExecute`` is written only while the node holds a
slot of the disruption budget (``dra/budget.py``), and waits at ``NoSchedule``, held by the
budget, otherwise. ``scope: {noexecute: false}`` keeps every device quarantine at ``NoSchedule``
(new claims stay off the GPU; the pods on it are left to the operator).

A code's default scope is its action's row; ``scope.csv`` names a code only where the code itself
decides (an NVSwitch serves every GPU; a missing GPU cannot be named), so a new code needs no row
here and its catalog row stays the one place that states it. A per-code column in
``findings.csv`` would be empty for every code but those two, and the scope of a code whose action
is decided per event (GPU_XID, RDMA_ADAPTER_EVENT) is its action's anyway.

Scope is a statement of policy, not a guarantee that a device can be quarantined: the effects
fall back to the node when DRA is not served or the GPU is not published (``healthagent/dra``).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from healthagent.model import Action, Finding
from healthagent.policy.findings import FINDINGS

GPU = "gpu"
NODE = "node"
SCOPES = (GPU, NODE)
DEVICE_EFFECTS = ("None", "NoSchedule", "NoExecute")
DEFAULT_QUARANTINE_MAX = 2
_CSV = Path(__file__).with_name("scope.csv")
SECTION_KEYS = ("actions", "codes", "gpu_quarantine_max", "monitor_taints", "noexecute", "dra")


@dataclass(frozen=True)
class ScopeRow:
    scope: str
    device_effect: str  # "" for node scope
    why: str


def _default_rows() -> tuple[Mapping[str, ScopeRow], Mapping[str, ScopeRow]]:
    actions: dict[str, ScopeRow] = {}
    codes: dict[str, ScopeRow] = {}
    with _CSV.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            target = actions if row["kind"] == "action" else codes
            target[row["name"]] = ScopeRow(row["scope"], row["device_effect"], row["why"])
    return MappingProxyType(actions), MappingProxyType(codes)


_DEFAULT_ACTIONS, _DEFAULT_CODES = _default_rows()


@dataclass(frozen=True)
class ScopePolicy:
    """The scope table (defaults merged with the policy file) and the quarantine settings."""

    actions: Mapping[str, ScopeRow] = field(default_factory=lambda: _DEFAULT_ACTIONS)
    codes: Mapping[str, ScopeRow] = field(default_factory=lambda: _DEFAULT_CODES)
    gpu_quarantine_max: int = DEFAULT_QUARANTINE_MAX
    monitor_taints: bool = False
    noexecute: bool = True
    dra: str = "auto"  # auto: use DRA where the cluster serves it; off: node behaviour only

    def row(self, code: str, action: Action) -> tuple[ScopeRow, str]:
        """The row deciding a finding's scope and where it came from (for ``explain``)."""
        if code in self.codes:
            source = "scope.csv" if _DEFAULT_CODES.get(code) is self.codes[code] else "policy file"
            return self.codes[code], f"code {code} ({source})"
        row = self.actions.get(action.value, ScopeRow(NODE, "", "no scope row: the node"))
        source = "scope.csv" if _DEFAULT_ACTIONS.get(action.value) is row else "policy file"
        return row, f"action {action.value} ({source})"

    def scope_of(self, finding: Finding) -> str:
        """``gpu`` only for a finding that names one GPU and whose row says ``gpu``."""
        if not (finding.pci_bus_id or finding.uuid) or finding.fabric_device:
            return NODE
        return self.row(finding.code, finding.action)[0].scope

    def device_effect(self, finding: Finding) -> str:
        """The taint effect a gpu-scope finding's device ends with ("" = no device taint)."""
        effect = self.row(finding.code, finding.action)[0].device_effect or "NoSchedule"
        if finding.action is Action.MONITOR or effect == "None":
            return "None" if self.monitor_taints else ""
        if effect == "NoExecute" and not self.noexecute:
            return "NoSchedule"
        return effect


def _row(section: str, name: str, value: Any, base: ScopeRow | None, error: Callable[[str], Exception]) -> ScopeRow:
    if value not in SCOPES:
        raise error(f"scope.{section}.{name}: {value!r} is not a scope; use gpu or node")
    effect = base.device_effect if base is not None and base.device_effect else "NoSchedule"
    return ScopeRow(value, effect if value == GPU else "", "set by the policy file")


def parse_scope(raw: Any, error: Callable[[str], Exception]) -> ScopePolicy:
    """The ``scope:`` section of a policy file; raises ``error`` with one line naming the key."""
    if raw is None:
        return ScopePolicy()
    if not isinstance(raw, dict):
        raise error("scope: must be a mapping with keys " + ", ".join(SECTION_KEYS))
    for key in raw:
        if key not in SECTION_KEYS:
            raise error(f"scope: unknown key {key!r}; valid keys: " + ", ".join(SECTION_KEYS))
    actions = dict(_DEFAULT_ACTIONS)
    for name, value in _mapping(raw, "actions", error).items():
        try:
            action = Action.parse(str(name))
        except ValueError as exc:
            raise error(f"scope.actions.{name}: {exc}") from None
        actions[action.value] = _row("actions", action.value, value, _DEFAULT_ACTIONS.get(action.value), error)
    codes = dict(_DEFAULT_CODES)
    for name, value in _mapping(raw, "codes", error).items():
        if str(name) not in FINDINGS:
            raise error(f"scope.codes.{name}: not a finding code; see docs/findings.md for the codes")
        codes[str(name)] = _row("codes", str(name), value, None, error)
    maximum = raw.get("gpu_quarantine_max", DEFAULT_QUARANTINE_MAX)
    if isinstance(maximum, bool) or not isinstance(maximum, int) or not 0 <= maximum <= 64:
        raise error(f"scope.gpu_quarantine_max: {maximum!r} is not a whole number of GPUs from 0 to 64")
    flags = {}
    for key, default in (("monitor_taints", False), ("noexecute", True)):
        value = raw.get(key, default)
        if not isinstance(value, bool):
            raise error(f"scope.{key}: {value!r} is not true or false")
        flags[key] = value
    dra = raw.get("dra", "auto")
    if dra is False:  # YAML reads a bare `off` as false
        dra = "off"
    if dra not in ("auto", "off"):
        raise error(f"scope.dra: {dra!r} is not auto or off")
    return ScopePolicy(MappingProxyType(actions), MappingProxyType(codes), maximum, dra=dra, **flags)


def _mapping(raw: dict, key: str, error: Callable[[str], Exception]) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise error(f"scope.{key}: must be a mapping of name: gpu|node, e.g. {{reset_gpu: node}}")
    return value


def explain_scope(code: str, action: Action | None, policy: ScopePolicy) -> str:
    """One line for ``explain``: the scope, the row that decided it and why."""
    if action is None:
        return "Scope: per event (the action the catalog gives decides it; see the scope of each action)"
    row, source = policy.row(code, action)
    if row.scope == GPU:
        limit = policy.gpu_quarantine_max
        return (f"Scope: gpu, from {source}: {row.why}; with DRA the device is quarantined, not the node "
                f"(more than {limit} GPUs at once make it a node finding)")
    return f"Scope: node, from {source}: {row.why}"
