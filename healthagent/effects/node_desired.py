"""What the agent wants its node to look like, and the smallest patches that get it there.

Pure functions, no I/O: the verdict (minus what an operator cleared), the node as last read, the
clock value passed in and what the effects record says was applied decide a ``DesiredNode``;
``node_patches`` turns the difference into a strategic-merge patch for the node (labels,
annotations, taints) and one for ``/status`` (conditions). Everything the agent does not own is
left exactly as it was: foreign taints keep their place in the list, foreign labels, annotations
and conditions are never in a patch.

Owned by the agent: taints with ``settings.taint_key``; the label ``healthagent.io/health``; the
annotation ``healthagent.io/clear-handled``; the conditions ``GpuHealthy`` and ``EfaHealthy``; and,
only with ``hyperpod_labels`` on, the HyperPod labels while they hold a value the agent wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterable, Mapping

from healthagent.model import Action, Finding, SourceHealth

HEALTH_LABEL = "healthagent.io/health"
CLEAR_ANNOTATION = "healthagent.io/clear"  # written by operators, only read by the agent
CLEAR_HANDLED_ANNOTATION = "healthagent.io/clear-handled"  # the last clear the agent acted on

HYPERPOD_HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
HYPERPOD_FAULT_TYPES_LABEL = "sagemaker.amazonaws.com/fault-types"
HYPERPOD_FAULT_REASONS_LABEL = "sagemaker.amazonaws.com/fault-reasons"
HYPERPOD_PENDING_REPLACEMENT = "UnschedulablePendingReplacement"
HYPERPOD_PENDING_REBOOT = "UnschedulablePendingReboot"
HYPERPOD_SCHEDULABLE = "Schedulable"
HYPERPOD_PENDING = {Action.REPLACE_NODE: HYPERPOD_PENDING_REPLACEMENT,
                    Action.REBOOT_NODE: HYPERPOD_PENDING_REBOOT}

GPU_CONDITION = "GpuHealthy"
EFA_CONDITION = "EfaHealthy"
OWNED_CONDITIONS = (GPU_CONDITION, EFA_CONDITION)
ALL_CHECKS_PASSED = "AllChecksPassed"
REPLACE_PENDING_REASON = "ReplacePending"
# Verdict.unobserved subsystems that have a condition: (condition, its reason while the subsystem
# cannot be seen, what it is in words, the sources that see it). Status Unknown: "no finding"
# about hardware nobody could see is not "healthy".
NOT_OBSERVED = {"gpu": (GPU_CONDITION, "GpuNotObserved", "GPUs", ("nvml", "dcgm")),
                "efa": (EFA_CONDITION, "EfaNotObserved", "EFA devices", ("efa",))}

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


def condition_of(code: str) -> str:
    """Which condition a finding code belongs to: EFA_* -> EfaHealthy, everything else GpuHealthy."""
    return EFA_CONDITION if code.startswith("EFA_") else GPU_CONDITION


def observed_by(code: str) -> tuple[str, ...]:
    """The ``Verdict.unobserved`` subsystems that must see the node again before a finding of
    ``code`` can be believed gone: EFA findings need the EFA source, NVSwitch SXids the kernel
    log, every other (GPU) finding the GPU sources (NVML reports XIDs too). An unknown code (a
    taint adopted from the node without a record) needs them all."""
    if not code:
        return ("gpu", "efa", "kernel_log")
    if code.startswith("EFA_"):
        return ("efa",)
    if code.startswith("NVSWITCH_"):
        return ("kernel_log",)
    return ("gpu",)


def fault_type_of(code: str) -> str:
    """A short fault category for HyperPod's fault-types label (the agent's own vocabulary)."""
    if code.startswith("EFA_"):
        return "EFA"
    if code.startswith("NVSWITCH_"):
        return "NVSwitch"
    return "GPU"


# -- time ------------------------------------------------------------------------------------------


def rfc3339(ts: float) -> str:
    """Kubernetes ``Time``: RFC 3339 in UTC at second precision."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: object) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


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
    adds_taint: bool  # no agent taint on the node yet and one is wanted (the budget's question)
    budget_blocked: bool = False
    disruptive_ready: bool = False  # the grace has passed: HyperPod may act


def owned_taints(node: Mapping, taint_key: str) -> list[dict]:
    return [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") == taint_key]


def labels_of(node: Mapping) -> dict:
    return dict((node.get("metadata") or {}).get("labels") or {})


def annotations_of(node: Mapping) -> dict:
    return dict((node.get("metadata") or {}).get("annotations") or {})


def owned_view(node: Mapping | None, taint_key: str, hyperpod: bool) -> tuple:
    """What of the node the agent owns or acts on: the object's uid, its taints, its labels, the
    clear annotations and its conditions. A watch event that changes none of these (the kubelet's
    status report, another controller's label) updates the cache without waking the effects."""
    if node is None:
        return ()
    labels, annotations = labels_of(node), annotations_of(node)
    label_keys = (HEALTH_LABEL,) + ((HYPERPOD_HEALTH_LABEL, HYPERPOD_FAULT_TYPES_LABEL,
                                     HYPERPOD_FAULT_REASONS_LABEL) if hyperpod else ())
    conditions = [c for c in (node.get("status") or {}).get("conditions") or []
                  if isinstance(c, dict) and c.get("type") in OWNED_CONDITIONS]
    return (
        (node.get("metadata") or {}).get("uid"),
        tuple((t.get("value"), t.get("effect"), t.get("timeAdded")) for t in owned_taints(node, taint_key)),
        tuple(labels.get(k) for k in label_keys),
        annotations.get(CLEAR_ANNOTATION), annotations.get(CLEAR_HANDLED_ANNOTATION),
        tuple((c.get("type"), c.get("status"), c.get("reason"), c.get("message")) for c in conditions),
    )


def grace_start(node: Mapping, taint_key: str, value: str, recorded_since: float | None) -> float | None:
    """When the taint for ``value`` was first applied: the record, else the taint's ``timeAdded``
    on the node (the agent sets it), so a lost state file does not restart the grace."""
    if recorded_since is not None:
        return recorded_since
    added = [parse_rfc3339(t.get("timeAdded")) for t in owned_taints(node, taint_key) if t.get("value") == value]
    added = [a for a in added if a is not None]
    return min(added) if added else None


def plan_taint(
    *,
    action: Action,
    node: Mapping,
    taint_key: str,
    grace_seconds: float,
    since: float | None,
    now: float,
    budget_allows: Callable[[], bool],
) -> TaintPlan:
    """Decide the agent's taint for ``action`` (the effective verdict, sticky replace included).

    reboot_node -> NoSchedule; replace_node -> NoSchedule, then NoExecute once ``grace_seconds``
    have passed since the taint was applied (``since``; 0 = at once); a NoExecute already on the
    node stays. Adding a taint to a node without one asks the budget; changing or removing one
    never does (the budget never blocks healing).
    """
    if action not in TAINT_ACTIONS:
        return TaintPlan(taint=None, adds_taint=False)
    current = owned_taints(node, taint_key)
    adds = not current
    if adds and not budget_allows():
        return TaintPlan(taint=None, adds_taint=True, budget_blocked=True)
    same_value = [t for t in current if t.get("value") == action.value]
    started = since if same_value else None  # a new or changed taint starts its grace now
    has_no_execute = any(t.get("effect") == NO_EXECUTE for t in same_value)
    ready = has_no_execute or grace_seconds <= 0 or (
        started is not None and now - started >= grace_seconds)
    effect = NO_EXECUTE if action is Action.REPLACE_NODE and ready else NO_SCHEDULE
    return TaintPlan(taint=TaintSpec(action.value, effect), adds_taint=adds, disruptive_ready=ready)


def plan_conditions(findings: Iterable[Finding], sticky_without_finding: bool,
                    sticky_code: str = "",
                    not_observed: Mapping[str, tuple[str, str]] | None = None) -> tuple[ConditionSpec, ...]:
    """``GpuHealthy``/``EfaHealthy`` from the open findings (most severe first in the verdict).

    A replace taint that stands with no open finding (state lost, or the classifier forgot) keeps
    ``GpuHealthy`` (or the recorded finding's condition) False: a condition must never say healthy
    while the node carries the replace taint. A condition without findings whose area could not be
    observed (``not_observed``: condition type -> (reason, message)) is ``Unknown``, not ``True``.
    """
    by_condition: dict[str, list[Finding]] = {GPU_CONDITION: [], EFA_CONDITION: []}
    for finding in findings:
        by_condition[condition_of(finding.code)].append(finding)
    specs = []
    for ctype, group in by_condition.items():
        if group:
            group.sort(key=lambda f: (-f.action.severity, f.code, f.subject))
            message = "; ".join(f"{f.code} {f.subject}: {f.summary} ({f.evidence})" for f in group)
            specs.append(ConditionSpec(ctype, "False", group[0].code, _clip(message)))
        elif sticky_without_finding and ctype == condition_of(sticky_code or "GPU"):
            specs.append(ConditionSpec(
                ctype, "False", REPLACE_PENDING_REASON,
                "the node carries the agent's replace_node taint from an earlier fault; an operator "
                f"clears it with: kubectl annotate node NODE {CLEAR_ANNOTATION}=<new value> --overwrite"))
        elif ctype in (not_observed or {}):
            reason, message = (not_observed or {})[ctype]
            specs.append(ConditionSpec(ctype, "Unknown", reason, _clip(message)))
        else:
            area = "EFA" if ctype == EFA_CONDITION else "GPU"
            specs.append(ConditionSpec(ctype, "True", ALL_CHECKS_PASSED, f"no open {area} findings"))
    return tuple(specs)


def not_observed_conditions(node: Mapping, unobserved: Iterable[str],
                            health: Iterable[SourceHealth]) -> dict[str, tuple[str, str]]:
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
        ctype, reason, what, sources = NOT_OBSERVED[part]
        have = existing.get(ctype) or {}
        if (have.get("status"), have.get("reason")) == ("Unknown", reason) and isinstance(have.get("message"), str):
            planned[ctype] = (reason, have["message"])
            continue
        why = "; ".join(f"{h.source}: {h.detail}" for h in health if h.source in sources and not h.up and h.detail)
        planned[ctype] = (reason, f"the agent cannot observe the {what} ({why or 'no source answered'}); "
                                  "their health is unknown, not healthy")
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
    """Owned labels: the health label always (it says what is wrong even when the budget holds the
    taint back); HyperPod's labels only with ``hyperpod`` on.

    HyperPod reboots or replaces a node whose node-health-status says UnschedulablePending*, so
    that value is disruptive: it is set only together with the agent's taint (never past the
    budget) and only once the grace has passed (the job checkpoints first). When the agent's taint
    is gone the label is given back as ``Schedulable`` (HyperPod's healthy value, which jobs select
    on) - but only while it still holds the value the agent wrote; otherwise it is not touched.
    """
    labels: dict[str, str | None] = {HEALTH_LABEL: health_value(shown, unobserved)}
    if not hyperpod:
        return labels
    current = labels_of(node)
    our_value = HYPERPOD_PENDING.get(_action_of(current.get(HEALTH_LABEL)))
    ours_now = our_value is not None and current.get(HYPERPOD_HEALTH_LABEL) == our_value
    if taint.taint is not None and taint.disruptive_ready:
        labels[HYPERPOD_HEALTH_LABEL] = HYPERPOD_PENDING[Action(taint.taint.value)]
        labels[HYPERPOD_FAULT_TYPES_LABEL] = fault_type_of(leading_code or "GPU")
        labels[HYPERPOD_FAULT_REASONS_LABEL] = _label_value(leading_code or REPLACE_PENDING_REASON)
    elif taint.taint is None and ours_now:
        labels[HYPERPOD_HEALTH_LABEL] = HYPERPOD_SCHEDULABLE
        labels[HYPERPOD_FAULT_TYPES_LABEL] = None
        labels[HYPERPOD_FAULT_REASONS_LABEL] = None
    return labels


def _action_of(health: str | None) -> Action | None:
    return {REBOOT_REQUIRED: Action.REBOOT_NODE, REPLACE_REQUIRED: Action.REPLACE_NODE}.get(health or "")


def _label_value(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:63].strip("-_.")
    return cleaned or "unknown"


# -- patches ---------------------------------------------------------------------------------------


def node_patch(node: Mapping, desired: DesiredNode, taint_key: str, now: float) -> dict | None:
    """A strategic-merge patch for the node object (labels, annotations, taints), or None.

    ``spec.taints`` is an atomic list in the Node schema, so when the agent's taint changes the
    patch carries the whole list: every foreign taint as read, in place, plus the agent's one.
    The backend sends it with preconditions on what it replaces (``effects/backend.py``); a
    write that finds the node changed there is planned again from a fresh read.
    """
    meta: dict = {}
    labels = labels_of(node)
    label_changes = {k: v for k, v in desired.labels.items() if labels.get(k) != v}
    if label_changes:
        meta["labels"] = label_changes
    annotations = annotations_of(node)
    annotation_changes = {k: v for k, v in desired.annotations.items() if annotations.get(k) != v}
    if annotation_changes:
        meta["annotations"] = annotation_changes
    patch: dict = {}
    taints = _taints_after(node, desired.taint, taint_key, now)
    if taints is not None:
        patch["spec"] = {"taints": taints}
    if not meta and not patch:
        return None
    if meta:
        patch["metadata"] = meta
    return patch


def _taints_after(node: Mapping, want: TaintSpec | None, taint_key: str, now: float) -> list | None:
    """The full taint list after the change, or None when the agent's taints are already right."""
    current = list((node.get("spec") or {}).get("taints") or [])
    ours = [t for t in current if t.get("key") == taint_key]
    if want is None:
        if not ours:
            return None
        return [t for t in current if t.get("key") != taint_key]
    if len(ours) == 1 and ours[0].get("value") == want.value and ours[0].get("effect") == want.effect:
        return None
    entry = {"key": taint_key, "value": want.value, "effect": want.effect, "timeAdded": rfc3339(now)}
    result, placed = [], False
    for taint in current:
        if taint.get("key") != taint_key:
            result.append(taint)
        elif not placed:
            result.append(entry)
            placed = True
    if not placed:
        result.append(entry)
    return result


def status_patch(node: Mapping, desired: DesiredNode, now: float) -> dict | None:
    """A strategic-merge patch for ``/status``: only the agent's conditions that differ.

    Conditions merge by ``type`` on the server, so other writers' conditions (the kubelet's
    Ready, node-problem-detector's) are never in the patch. ``lastTransitionTime`` moves only when
    the status flips; ``lastHeartbeatTime`` is the time the agent last wrote the condition (the
    agent does not heartbeat: a steady state costs no writes). No ``resourceVersion``: the
    kubelet's heartbeats and foreign label writes would make every condition write conflict,
    and a merge by type cannot lose another writer's condition.
    """
    existing = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or []}
    changed = []
    for spec in desired.conditions:
        have = existing.get(spec.type)
        if have and (have.get("status"), have.get("reason"), have.get("message")) == (
                spec.status, spec.reason, spec.message):
            continue
        transition = rfc3339(now)
        if have and have.get("status") == spec.status and have.get("lastTransitionTime"):
            transition = have["lastTransitionTime"]
        changed.append({"type": spec.type, "status": spec.status, "reason": spec.reason,
                        "message": spec.message, "lastHeartbeatTime": rfc3339(now),
                        "lastTransitionTime": transition})
    if not changed:
        return None
    return {"status": {"conditions": changed}}
