"""What the agent wants its node to look like, and the smallest patches that get it there.

Pure functions, no I/O: the verdict (minus what an operator cleared), the node as last read, the
clock value passed in and what the effects record says was applied decide a ``DesiredNode``;
``effects/node_patch.py`` turns the difference into a strategic-merge patch for the node
(labels, annotations, taints) and one for ``/status`` (conditions). Everything the agent does not own is
left exactly as it was: foreign taints keep their place in the list, foreign labels, annotations
and conditions are never in a patch.

Owned by the agent: taints with ``settings.taint_key``; the label ``healthagent.io/health``; the
annotations ``healthagent.io/clear-handled`` and ``healthagent.io/taint-boot-id``; the two
conditions of its vocabulary (``GpuHealthy``/``NetworkHealthy``, or in ``eks`` mode
``AcceleratedHardwareReady``/``NetworkingReady``: ``effects/conditions.py``) unless another writer
owns one; and, only with ``hyperpod_labels`` on, the HyperPod labels while they hold a value the
agent wrote.

A ``reboot_node`` taint comes off only after a reboot: ``healthagent.io/taint-boot-id`` records the
node's boot id (``status.nodeInfo.bootID``, as the kubelet reports it) while a finding that needs
the taint is open, and the taint stays until the node reports another boot id (and no finding
needs it, and the part it came from is observed). A lost state file or a classifier that forgot
cannot clear it; a ``replace_node`` taint never clears itself at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from healthagent.effects.conditions import (
    ALL_CHECKS_PASSED,
    DEFAULT,
    NETWORK_AREA,
    FINDINGS_WITHOUT_NODE_ACTION,
    GPU_AREA,
    NOT_OBSERVED_REASONS,
    REBOOT_PENDING_REASON,
    REPAIR_AFTER_GRACE,
    REPAIR_HELD_BY_BUDGET,
    REPLACE_PENDING_REASON,
    Vocabulary,
    area_of,
)
from healthagent.effects.hyperpod import (
    HYPERPOD_FAULT_REASONS_LABEL,
    HYPERPOD_FAULT_TYPES_LABEL,
    HYPERPOD_HEALTH_LABEL,
    hyperpod_labels,
)
from healthagent.model import Action, Finding, SourceHealth

HEALTH_LABEL = "healthagent.io/health"
CLEAR_ANNOTATION = "healthagent.io/clear"  # written by operators, only read by the agent
CLEAR_HANDLED_ANNOTATION = "healthagent.io/clear-handled"  # the last clear the agent acted on
TAINT_BOOT_ANNOTATION = "healthagent.io/taint-boot-id"  # the boot a fault needing the taint was open in


GPU_CONDITION = DEFAULT.gpu_type  # the default vocabulary's types
NETWORK_CONDITION = DEFAULT.network_type
OWNED_CONDITIONS = DEFAULT.types
# Verdict.unobserved subsystems that have a condition: (its reason while the subsystem cannot be
# seen, what it is in words, the sources that see it, the area whose condition it is). Status
# Unknown: "no finding" about hardware nobody could see is not "healthy". InfiniBand/RoCE ports
# share the networking condition with EFA.
NOT_OBSERVED = {GPU_AREA: (NOT_OBSERVED_REASONS[GPU_AREA], "GPUs", ("nvml", "dcgm"), GPU_AREA),
                "efa": (NOT_OBSERVED_REASONS[NETWORK_AREA], "EFA devices", ("efa",), NETWORK_AREA),
                "rdma": (NOT_OBSERVED_REASONS[NETWORK_AREA], "InfiniBand/RoCE ports", ("rdma",), NETWORK_AREA)}

NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"
TAINT_ACTIONS = (Action.REBOOT_NODE, Action.REPLACE_NODE)

HEALTHY = "healthy"
UNKNOWN = "unknown"
DEGRADED = "degraded"
REBOOT_REQUIRED = "reboot-required"
REPLACE_REQUIRED = "replace-required"

CONDITION_MESSAGE_MAX = 1024


def health_value(action: Action, unobserved: bool = False) -> str:
    """The ``healthagent.io/health`` label value for an action: ``unknown`` instead of
    ``healthy`` while part of the node could not be observed (nothing worse is known)."""
    if action is Action.REPLACE_NODE:
        return REPLACE_REQUIRED
    if action is Action.REBOOT_NODE:
        return REBOOT_REQUIRED
    if action is Action.NONE:
        return UNKNOWN if unobserved else HEALTHY
    return DEGRADED


def condition_of(code: str, vocab: Vocabulary = DEFAULT) -> str:
    """Which condition a finding code belongs to: EFA_* and RDMA_* -> NetworkHealthy (NetworkingReady), everything
    else GpuHealthy (AcceleratedHardwareReady)."""
    return vocab.type_of(area_of(code))


KERNEL_LOG_ONLY_CODES = frozenset({"RDMA_ADAPTER_EVENT"})


def observed_by(code: str) -> tuple[str, ...]:
    """The ``Verdict.unobserved`` subsystems that must see the node again before a finding of
    ``code`` can be believed gone: EFA findings need the EFA source, InfiniBand/RoCE port findings
    the RDMA source, NVSwitch SXids and ConnectX adapter events the kernel log (the only place
    either is written), every other (GPU) finding the GPU sources (NVML reports XIDs too). An
    unknown code (a taint adopted from the node without a record) needs them all."""
    if not code:
        return ("gpu", "efa", "rdma", "kernel_log")
    if code.startswith("EFA_"):
        return ("efa",)
    if code in KERNEL_LOG_ONLY_CODES:
        return ("kernel_log",)
    if code.startswith("RDMA_"):
        return ("rdma",)
    if code.startswith("NVSWITCH_"):
        return ("kernel_log",)
    return ("gpu",)


# -- the desired state -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TaintSpec:
    value: str  # the action: reboot_node | replace_node
    effect: str  # NoSchedule | NoExecute


@dataclass(frozen=True)
class ConditionSpec:
    type: str
    status: str  # "True" = healthy
    reason: str
    message: str


@dataclass(frozen=True)
class DesiredNode:
    """What the agent wants. ``labels``/``annotations`` name only keys the agent owns right now
    (value None = remove); keys not named are not touched."""

    taint: TaintSpec | None
    labels: Mapping[str, str | None] = field(default_factory=dict)
    annotations: Mapping[str, str | None] = field(default_factory=dict)
    conditions: tuple[ConditionSpec, ...] = ()


@dataclass(frozen=True)
class TaintPlan:
    """The taint decision and why (for the budget and the record)."""

    taint: TaintSpec | None
    adds_taint: bool  # no agent taint on the node yet and one is wanted
    budget_blocked: bool = False  # held: NoSchedule only, the disruptive step waits for a budget slot
    disruptive_ready: bool = False  # grace over and a slot held (or NoExecute already on): HyperPod may act


def owned_taints(node: Mapping, taint_key: str) -> list[dict]:
    return [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") == taint_key]


def labels_of(node: Mapping) -> dict:
    return dict((node.get("metadata") or {}).get("labels") or {})


def annotations_of(node: Mapping) -> dict:
    return dict((node.get("metadata") or {}).get("annotations") or {})


def owned_view(node: Mapping | None, taint_key: str, hyperpod: bool, vocab: Vocabulary = DEFAULT) -> tuple:
    """What of the node the agent owns or acts on: the object's uid, its taints, its labels, the
    clear and boot annotations, its conditions and the node's boot id. A watch event that changes
    none of these (the kubelet's heartbeat, another controller's label) updates the cache without
    waking the effects."""
    if node is None:
        return ()
    labels, annotations = labels_of(node), annotations_of(node)
    label_keys = (HEALTH_LABEL,) + ((HYPERPOD_HEALTH_LABEL, HYPERPOD_FAULT_TYPES_LABEL,
                                     HYPERPOD_FAULT_REASONS_LABEL) if hyperpod else ())
    conditions = [c for c in (node.get("status") or {}).get("conditions") or []
                  if isinstance(c, dict) and c.get("type") in vocab.types]
    return (
        (node.get("metadata") or {}).get("uid"),
        tuple((t.get("value"), t.get("effect"), t.get("timeAdded")) for t in owned_taints(node, taint_key)),
        tuple(labels.get(k) for k in label_keys),
        annotations.get(CLEAR_ANNOTATION), annotations.get(CLEAR_HANDLED_ANNOTATION),
        annotations.get(TAINT_BOOT_ANNOTATION), node_boot_id(node),
        tuple((c.get("type"), c.get("status"), c.get("reason"), c.get("message")) for c in conditions),
    )


# -- the boot a reboot_node taint waits out --------------------------------------------------------


def node_boot_id(node: Mapping) -> str:
    """The boot id the kubelet reports (``status.nodeInfo.bootID``); "" when it reports none."""
    info = (node.get("status") or {}).get("nodeInfo")
    value = info.get("bootID") if isinstance(info, dict) else None
    return value if isinstance(value, str) else ""


def reboot_outstanding(node: Mapping) -> bool:
    """Has the node not rebooted since a fault that needed the agent's taint was last open?

    True while ``healthagent.io/taint-boot-id`` names the boot the node still reports (or the
    node reports no boot id at all: a reboot cannot be proven). False without the annotation: a
    taint from a version that did not record the boot clears as it always did, with its finding.
    """
    tainted_in = annotations_of(node).get(TAINT_BOOT_ANNOTATION)
    if not tainted_in:
        return False
    now = node_boot_id(node)
    return not now or now == tainted_in


def boot_annotation(node: Mapping, taint: "TaintPlan", findings: Iterable[Finding]) -> dict[str, str | None]:
    """``healthagent.io/taint-boot-id`` as wanted: the node's boot id while a finding that needs
    the taint is open (moved to the new boot if such a fault is open again after a reboot), kept
    while the taint is held without one, removed with the taint."""
    if taint.taint is None:
        return {TAINT_BOOT_ANNOTATION: None}
    boot = node_boot_id(node)
    if boot and any(f.action in TAINT_ACTIONS for f in findings):
        return {TAINT_BOOT_ANNOTATION: boot}
    return {}


def grace_start(node: Mapping, taint_key: str, recorded_since: float | None, now: float) -> float | None:
    """When the grace of the agent's taint started, on the decision clock (``clock.py``, which
    never jumps): the record, else ``now`` when the agent's taint is on the node (first sight),
    else None (no taint: a new one starts its grace when it goes on).

    Every duration that leads to a node action runs on the decision clock only. ``timeAdded`` on
    the node is wall time (another clock, stepped by NTP or by hand), so it is shown to people and
    never measured against: a wall clock stepped forward would end the grace at once. Without a
    record (the state file was lost) the grace therefore starts again, in full, at first sight:
    a lost state file can delay NoExecute by one grace, never bring it forward."""
    if recorded_since is not None:
        return recorded_since
    return now if owned_taints(node, taint_key) else None


def plan_taint(
    *,
    action: Action,
    node: Mapping,
    taint_key: str,
    grace_seconds: float,
    since: float | None,
    now: float,
    held: bool,
    reboot_noexecute: bool = True,
    rollback: bool = False,
    first: bool = False,
) -> TaintPlan:
    """Decide the agent's taint for ``action`` (the effective verdict, sticky replace included).

    replace_node and reboot_node -> NoSchedule at once, always: new pods stay off a faulty node and
    running pods are untouched, so the disruption budget is never asked for it. Then NoExecute
    once ``grace_seconds`` have passed since the taint was applied (``since``; 0 = at once), but
    only while the node holds a budget slot: ``held`` (no slot) keeps the node at NoSchedule,
    ``budget_blocked``, until it gets one. ``reboot_noexecute=False`` keeps reboot_node at
    NoSchedule. A NoExecute of the agent's already on the node stays, whatever its value: an
    escalation (reboot_node, then replace_node) never takes the eviction back, and its grace goes
    on from the first taint (``since``), not from the new value. The exception is ``rollback``:
    this node's slot was reclaimed before its write landed, so a NoExecute it just wrote goes back
    to NoSchedule. ``first``: the budget is not asked yet, so the NoSchedule goes on now, neither
    held nor ready (the slot is asked right after it lands: new pods stay off the node whatever
    the budget's traffic). Removing the taint never asks: the budget never blocks healing. A GPU that fell
    off the bus kills its rank: a pod left on the node only restarts onto it, so a reboot, too,
    must take the job's pods off after the grace.
    """
    if action not in TAINT_ACTIONS:
        return TaintPlan(taint=None, adds_taint=False)
    current = owned_taints(node, taint_key)
    adds = not current
    if any(t.get("effect") == NO_EXECUTE for t in current) and not rollback:
        return TaintPlan(taint=TaintSpec(action.value, NO_EXECUTE), adds_taint=False, disruptive_ready=True)
    if held or rollback:
        return TaintPlan(taint=TaintSpec(action.value, NO_SCHEDULE), adds_taint=adds, budget_blocked=True)
    if first:
        return TaintPlan(taint=TaintSpec(action.value, NO_SCHEDULE), adds_taint=adds)
    started = since if current else None  # a new taint starts its grace now; an escalation goes on
    ready = grace_seconds <= 0 or (started is not None and now - started >= grace_seconds)
    evicts = action is Action.REPLACE_NODE or reboot_noexecute
    effect = NO_EXECUTE if evicts and ready else NO_SCHEDULE
    return TaintPlan(taint=TaintSpec(action.value, effect), adds_taint=adds, disruptive_ready=ready)


def carries_no_execute(node: Mapping, taint_key: str) -> bool:
    """Does the node carry the agent's taint with NoExecute (its pods already taken off)?"""
    return any(t.get("effect") == NO_EXECUTE for t in owned_taints(node, taint_key))


@dataclass(frozen=True)
class Pending:
    """A taint the agent keeps with no open finding behind it: a ``replace_node`` taint (sticky
    until an operator clears it) or a ``reboot_node`` taint whose node has not rebooted yet."""

    code: str  # the finding code recorded when the taint went on ("" = unknown: GPU)
    action: Action

    @property
    def reason(self) -> str:
        return REPLACE_PENDING_REASON if self.action is Action.REPLACE_NODE else REBOOT_PENDING_REASON

    @property
    def message(self) -> str:
        how = (f"an operator clears it with: kubectl annotate node NODE {CLEAR_ANNOTATION}=<new value> "
               "--overwrite")
        if self.action is Action.REPLACE_NODE:
            return f"the node carries the agent's replace_node taint from an earlier fault; {how}"
        return ("the node carries the agent's reboot_node taint from a fault and has not rebooted since "
                f"(its boot id is the one recorded in {TAINT_BOOT_ANNOTATION}); the taint clears after a "
                f"reboot when the checks pass, or {how}")


def repair_state(taint: TaintPlan | None) -> str:
    """How far the node action has come, for a gated vocabulary: ``ready`` (the taint is on, the
    grace is over and the node holds a budget slot: an engine may repair), ``grace`` (the taint is
    on, the job is still being given its grace) or ``held`` (NoSchedule only: the budget has no
    slot for the node, or it lost one in a race)."""
    if taint is None:
        return "ready"
    if taint.taint is None or taint.budget_blocked:
        return "held"
    return "ready" if taint.disruptive_ready else "grace"


def plan_conditions(findings: Iterable[Finding], pending: Pending | None = None,
                    not_observed: Mapping[str, tuple[str, str]] | None = None,
                    vocab: Vocabulary = DEFAULT, taint: TaintPlan | None = None,
                    leave: Iterable[str] = ()) -> tuple[ConditionSpec, ...]:
    """The vocabulary's two conditions from the open findings (most severe first in the verdict).

    ``GpuHealthy``/``NetworkHealthy`` are ``False`` for any open finding of their area, with the code as
    reason. A taint that stands with no open finding (``pending``) keeps its area's condition
    ``False`` (``ReplacePending``/``RebootPending``): a condition must never say healthy while the
    node carries the agent's taint. A condition without findings whose area could not be
    observed (``not_observed``: condition type -> (reason, message)) is ``Unknown``, not ``True``.

    In a gated vocabulary (``eks``) ``False`` makes an engine replace the node, so it is ``False``
    only for a node action the agent is taking, once ``taint`` is on, its grace is over and the node
    holds a budget slot (see ``repair_state``), with the ecosystem's reason; before that, while the
    budget holds the node, or for findings below a node action it is ``True`` with the findings in
    the message. Types in ``leave``
    belong to another writer and are not planned at all.
    """
    by_area: dict[str, list[Finding]] = {GPU_AREA: [], NETWORK_AREA: []}
    for finding in findings:
        by_area[area_of(finding.code)].append(finding)
    skip = set(leave)
    specs = []
    for area, group in by_area.items():
        ctype = vocab.type_of(area)
        if ctype in skip:
            continue
        group.sort(key=lambda f: (-f.action.severity, f.code, f.subject))
        listed = "; ".join(f"{f.code} {f.subject}: {f.summary} ({f.evidence})" for f in group)
        pending_here = pending if pending is not None and area_of(pending.code or "GPU") == area else None
        acting = [f for f in group if f.action in TAINT_ACTIONS]
        if vocab.gated and acting:
            specs.append(_repair_condition(ctype, vocab.reason_for(acting[0]), acting[0].action, listed,
                                           repair_state(taint)))
        elif vocab.gated and pending_here:
            specs.append(_repair_condition(ctype, pending_here.reason, pending_here.action, pending_here.message,
                                           repair_state(taint)))
        elif group and not vocab.gated:
            specs.append(ConditionSpec(ctype, "False", group[0].code, _clip(listed)))
        elif group:
            specs.append(ConditionSpec(ctype, "True", FINDINGS_WITHOUT_NODE_ACTION, _clip(
                f"open findings that need no node action: {listed}")))
        elif pending_here:
            specs.append(ConditionSpec(ctype, "False", pending_here.reason, pending_here.message))
        elif ctype in (not_observed or {}):
            reason, message = (not_observed or {})[ctype]
            specs.append(ConditionSpec(ctype, "Unknown", reason, _clip(message)))
        else:
            words = "network" if area == NETWORK_AREA else "GPU"
            specs.append(ConditionSpec(ctype, "True", ALL_CHECKS_PASSED, f"no open {words} findings"))
    return tuple(specs)


def _repair_condition(ctype: str, reason: str, need: Action, message: str, state: str) -> ConditionSpec:
    """A gated condition for an area whose findings (or pending taint) need a node action."""
    if state == "ready":
        return ConditionSpec(ctype, "False", reason, _clip(message))
    if state == "held":
        return ConditionSpec(ctype, "True", REPAIR_HELD_BY_BUDGET, _clip(
            f"the node needs {need.value} ({reason}); the agent's NoSchedule taint keeps new pods off, and "
            f"no repair is asked for until the disruption budget has a slot for this node: {message}"))
    return ConditionSpec(ctype, "True", REPAIR_AFTER_GRACE, _clip(
        f"the node needs {need.value} ({reason}); the agent's taint is on and this condition turns False "
        f"when the job's NoExecute grace is over: {message}"))


def not_observed_conditions(node: Mapping, unobserved: Iterable[str],
                            health: Iterable[SourceHealth], vocab: Vocabulary = DEFAULT) -> dict[str, tuple[str, str]]:
    """Condition type -> (reason, message) for every unobserved subsystem that has a condition.

    The message says why, from the down sources' own detail (``health``), else in general words.
    While the condition already says Unknown for the same reason, its message on the node is
    kept: a source's detail may change every cycle ("collect hung for 12 s", "... 17 s"), and
    re-writing the condition for each would break the zero-writes steady state."""
    health = tuple(health)
    existing = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or []
                if isinstance(c, dict)}
    planned: dict[str, tuple[str, str]] = {}
    for part in unobserved:
        if part not in NOT_OBSERVED:
            continue
        reason, what, sources, area = NOT_OBSERVED[part]
        ctype = vocab.type_of(area)
        have = existing.get(ctype) or {}
        if (have.get("status"), have.get("reason")) == ("Unknown", reason) and isinstance(have.get("message"), str):
            planned[ctype] = (reason, have["message"])
            continue
        why = "; ".join(f"{h.source}: {h.detail}" for h in health if h.source in sources and not h.up and h.detail)
        message = (f"the agent cannot observe the {what} ({why or 'no source answered'}); "
                   "their health is unknown, not healthy")
        if ctype in planned:  # EFA devices and InfiniBand ports both unseen: one condition says both
            message = f"{planned[ctype][1]}; {message}"
        planned[ctype] = (reason, message)
    return planned


def _clip(text: str, limit: int = CONDITION_MESSAGE_MAX) -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", errors="ignore") + "..."


def plan_labels(
    *,
    node: Mapping,
    shown: Action,
    taint: TaintPlan,
    leading_code: str,
    hyperpod: bool,
    unobserved: bool = False,
) -> dict[str, str | None]:
    """Owned labels: the health label always (it says what is wrong even while the budget holds the
    node); HyperPod's labels (``effects/hyperpod.py``) only with ``hyperpod`` on."""
    labels: dict[str, str | None] = {HEALTH_LABEL: health_value(shown, unobserved)}
    if hyperpod:
        effect = taint.taint
        labels.update(hyperpod_labels(
            node, agent_action(node), Action(effect.value) if effect is not None else None,
            disruptive_ready=taint.disruptive_ready, held=taint.budget_blocked, leading_code=leading_code))
    return labels


def agent_action(node: Mapping) -> Action | None:
    """The node action the agent's own health label on ``node`` names, if any."""
    return _action_of(labels_of(node).get(HEALTH_LABEL))


def _action_of(health: str | None) -> Action | None:
    return {REBOOT_REQUIRED: Action.REBOOT_NODE, REPLACE_REQUIRED: Action.REPLACE_NODE}.get(health or "")
