"""Which findings the node carries and which one device carries: a pure split of the verdict.

Why a split rather than a second verdict: the node's effects (taint, conditions, budget) stay
exactly as they are and simply see the findings that are theirs. A ``gpu``-scope finding
(``policy/scope.py``) whose GPU its DRA driver publishes leaves the node verdict and becomes a
device quarantine; everything else stays on the node, unchanged. Where DRA is not served
(``devices`` is None) the node verdict is the verdict itself, so node behaviour is the same as
without this layer. When more GPUs than ``gpu_quarantine_max`` would be quarantined at once, the
node is the unit: those findings stay on the node as ``reboot_node`` (a reboot resets every GPU)
and no device is quarantined.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from healthagent.dra.slices import DeviceMap, DeviceRef
from healthagent.model import Action, Finding, Verdict
from healthagent.policy.scope import GPU, ScopePolicy

EFFECT_ORDER = ("None", "NoSchedule", "NoExecute")
NOT_SERVED = "dra_not_served"
NOT_PUBLISHED = "gpu_not_published"
TOO_MANY = "too_many_gpus"


@dataclass(frozen=True)
class Quarantine:
    """One device to taint: the findings on it and the effect they call for (at the end of the grace)."""

    ref: DeviceRef
    effect: str  # None | NoSchedule | NoExecute
    findings: tuple[Finding, ...]

    @property
    def why(self) -> str:
        first = self.findings[0]
        return f"{first.code} ({first.action.value}): {first.summary}"


@dataclass(frozen=True)
class Split:
    node_verdict: Verdict
    quarantines: tuple[Quarantine, ...] = ()
    fallbacks: tuple[str, ...] = ()  # why gpu-scope findings stayed on the node, sorted, no repeats


def split_verdict(verdict: Verdict, scope: ScopePolicy, devices: DeviceMap | None) -> Split:
    """The node's verdict and the device quarantines (see the module's docstring)."""
    candidates = [(f, scope.device_effect(f)) for f in verdict.findings if scope.scope_of(f) == GPU]
    candidates = [(f, e) for f, e in candidates if e]
    if not candidates:
        return Split(verdict)
    if devices is None or scope.dra == "off":
        return Split(verdict, fallbacks=(NOT_SERVED,))
    mapped: dict[DeviceRef, list[tuple[Finding, str]]] = {}
    fallbacks: set[str] = set()
    for finding, effect in candidates:
        ref = devices.find(finding.uuid, finding.pci_bus_id)
        if ref is None:
            fallbacks.add(NOT_PUBLISHED)
        else:
            mapped.setdefault(ref, []).append((finding, effect))
    disruptive = [ref for ref, items in mapped.items() if any(e != "None" for _, e in items)]
    if len(disruptive) > scope.gpu_quarantine_max:
        moved = {f.key for ref in disruptive for f, _ in mapped[ref]}
        words = (f" ({len(disruptive)} GPUs need a reset at once, more than gpu_quarantine_max="
                 f"{scope.gpu_quarantine_max}: the node is the unit)")
        findings = [replace(f, action=Action.REBOOT_NODE, summary=f.summary + words) if f.key in moved else f
                    for f in verdict.findings]
        return Split(_with(verdict, findings), fallbacks=tuple(sorted(fallbacks | {TOO_MANY})))
    taken = {f.key for items in mapped.values() for f, e in items if e != "None"}
    quarantines = tuple(
        Quarantine(ref, max((e for _, e in items), key=EFFECT_ORDER.index), tuple(f for f, _ in items))
        for ref, items in sorted(mapped.items(), key=lambda kv: kv[0].device))
    node = [f for f in verdict.findings if f.key not in taken]
    return Split(_with(verdict, node), quarantines, tuple(sorted(fallbacks)))


def _with(verdict: Verdict, findings: list[Finding]) -> Verdict:
    return Verdict.of(findings, verdict.timestamp, verdict.unobserved, verdict.observation, verdict.clear_token)
