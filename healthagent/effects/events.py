"""``events.k8s.io/v1`` Events on the node: what to say, and saying each thing exactly once.

Every Event has a key (``finding/<Finding.key>`` when a finding is first reported,
``finding/<Finding.key>/<action>`` when it escalates to a more severe action, ``cleared/<time>``,
``budget/<finding key>`` while the budget holds the node at NoSchedule, ``condition-left-alone/<type>``):
one Event per (finding, action).
The ledger keeps the keys already delivered (bounded, oldest forgotten first) and an outbox of
Events decided but not yet delivered (the API server may be down), both in the state file, so a
restart neither repeats nor loses one. The Event's object name is derived from the node and the
key, so even a SIGKILL between the POST and the state write cannot duplicate it: the second POST
gets 409 AlreadyExists and the ledger records the key as delivered.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from healthagent.model import Action, Finding

log = logging.getLogger(__name__)

REPORTING_CONTROLLER = "healthagent.io/agent"
EVENTS_NAMESPACE = "default"  # where the kubelet puts Events about (cluster-scoped) Nodes
NOTE_MAX_BYTES = 1024  # the API server rejects longer notes
MAX_EMITTED = 1024
MAX_OUTBOX = 128

WARNING = "Warning"
NORMAL = "Normal"


@dataclass(frozen=True)
class EventSpec:
    key: str
    type: str  # Normal | Warning
    reason: str  # the finding code, or Cleared / TaintBlockedByBudget / ConditionOwnedElsewhere
    action: str  # what the agent did: Detected, Escalated, Cleared, TaintHeldBack, LeftAlone
    note: str
    at: float

    @classmethod
    def from_dict(cls, data: Any) -> "EventSpec | None":
        try:
            return cls(key=str(data["key"]), type=str(data["type"]), reason=str(data["reason"]),
                       action=str(data["action"]), note=str(data["note"]), at=float(data["at"]))
        except (KeyError, TypeError, ValueError):
            return None


def finding_event(finding: Finding, now: float) -> EventSpec:
    """The Event that first reports a finding."""
    return EventSpec(key=f"finding/{finding.key}", type=WARNING, reason=finding.code,
                     action="Detected", note=_finding_note(finding, ""), at=now)


def escalation_event(finding: Finding, previous: Action, now: float) -> EventSpec:
    """The Event for a finding whose action became more severe than the one already reported
    (XID 79 then XID 94 on the same GPU: one incident, reboot_node then replace_node). Its key
    names the new action, so each (finding, action) is reported exactly once."""
    return EventSpec(key=f"finding/{finding.key}/{finding.action.value}", type=WARNING,
                     reason=finding.code, action="Escalated",
                     note=_finding_note(finding, f"escalated from {previous.value} to "
                                                 f"{finding.action.value}: "), at=now)


def foreign_condition_event(ctype: str, why: str, now: float) -> EventSpec:
    """The Event that says another writer writes a condition of the agent's vocabulary (the EKS
    node monitoring agent, typically) and the agent leaves it alone while it does."""
    return EventSpec(key=f"condition-left-alone/{ctype}/{int(now)}", type=WARNING, reason="ConditionOwnedElsewhere",
                     action="LeftAlone",
                     note=clip_note(f"The node's {ctype} condition has another writer ({why}). While it writes "
                                    f"{ctype}, the agent does not, so the two never overwrite each other; the agent "
                                    "still taints (NoExecute after the grace), labels and reports Events, but no "
                                    "engine is asked to repair the node through this condition. To have a failed "
                                    "node replaced anyway, use HyperPod's labels (the hyperpod overlay), or remove "
                                    "the other writer: once it has stopped writing, the agent takes the condition "
                                    "back by itself (foreign_condition_quiet_seconds)."), at=now)


def condition_taken_back_event(ctype: str, quiet: float, now: float) -> EventSpec:
    """The Event that says the other writer of a condition has gone quiet and the agent writes the
    condition again."""
    return EventSpec(key=f"condition-taken-back/{ctype}/{int(now)}", type=NORMAL, reason="ConditionTakenBack",
                     action="TakenBack",
                     note=clip_note(f"The other writer of the node's {ctype} condition has not written it for "
                                    f"{quiet:.0f} s: the agent writes {ctype} again. If that writer comes back, "
                                    "the agent steps back again."), at=now)


def hyperpod_kept_event(value: str, action: Action, code: str, finding_key: str, now: float) -> EventSpec:
    """The Event that says, once per finding and value, that HyperPod's node-health-status holds a
    request of another writer (HyperPod's own health agent, an operator) that the agent keeps
    rather than overwrite with its own."""
    return EventSpec(
        key=f"hyperpod-kept/{value}/{finding_key or '-'}", type=NORMAL, reason="HyperPodRequestKept",
        action="LeftAlone",
        note=clip_note(f"The node needs {action.value} ({code or 'no finding'}), and its "
                       f"sagemaker.amazonaws.com/node-health-status already says {value}, set by another writer. "
                       "The agent keeps that value and its fault labels (it never overwrites another "
                       "writer's request); its taint stays on the node."), at=now)


def budget_held_event(finding_key: str, action: Action, code: str, budget: str, now: float) -> EventSpec:
    """The Event that says, once per held episode, that the node has its NoSchedule taint and waits
    for a slot of the disruption budget before its disruptive step. ``budget``: the budget as the
    agent saw it, with its settings."""
    return EventSpec(
        key=f"budget/{finding_key or f'{now:.3f}'}", type=WARNING, reason="TaintBlockedByBudget",
        action="TaintHeldBack",
        note=clip_note(f"The node needs {action.value} ({code or 'no finding'}). It has the agent's NoSchedule "
                       "taint (no new pods; running pods stay) and waits for a slot of the disruption budget "
                       f"before the disruptive step (NoExecute after the grace, HyperPod's pending value, a "
                       f"False eks condition): {budget}. The agent keeps asking and takes the step once a "
                       "slot frees up. Labels and conditions still report the fault."), at=now)


def _finding_note(finding: Finding, lead: str) -> str:
    note = f"[{finding.action.value}] {lead}{finding.summary}. Evidence: {finding.evidence}"
    if finding.next_steps:
        note += f" Next: {finding.next_steps}"
    return clip_note(note)


def clip_note(text: str) -> str:
    data = text.encode("utf-8")
    if len(data) <= NOTE_MAX_BYTES:
        return text
    return data[: NOTE_MAX_BYTES - 3].decode("utf-8", errors="ignore") + "..."


def event_name(node_name: str, key: str) -> str:
    """A deterministic object name: the same Event always has the same name (no duplicates)."""
    digest = hashlib.sha256(f"{node_name}\n{key}".encode("utf-8")).hexdigest()[:16]
    prefix = (node_name or "node")[: 253 - 1 - len(digest) - len(".healthagent")]
    return f"{prefix}.healthagent.{digest}".lower()


def micro_time(ts: float) -> str:
    """``MicroTime`` as the API server parses it (RFC 3339, exactly six fraction digits).

    The microsecond is never 0: version 37 of the ``kubernetes`` client re-serialises an Event's
    ``eventTime`` with ``datetime.isoformat()``, which drops a zero fraction, and the API server's
    RFC3339Micro parser then rejects the Event.
    """
    when = datetime.fromtimestamp(ts, timezone.utc)
    if when.microsecond == 0:
        when = when.replace(microsecond=1)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_body(spec: EventSpec, node_name: str, node_uid: str = "") -> dict:
    regarding = {"apiVersion": "v1", "kind": "Node", "name": node_name}
    if node_uid:
        regarding["uid"] = node_uid
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": event_name(node_name, spec.key), "namespace": EVENTS_NAMESPACE},
        "eventTime": micro_time(spec.at),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": node_name[:128],
        "action": spec.action,
        "reason": spec.reason[:128],
        "type": spec.type,
        "note": clip_note(spec.note),
        "regarding": regarding,
    }


@dataclass(frozen=True)
class EventLedger:
    """Delivered keys and the outbox, restored from and saved to the effects record: a value
    (``want`` and ``delivered`` return a new ledger), part of the effects' state
    (``effects/driver_state.py``). Built from the saved form: ``emitted`` a mapping key -> time,
    ``outbox`` a list of ``EventSpec`` dicts; what does not parse is dropped."""

    emitted: Mapping[str, float] = field(default_factory=dict)
    outbox: tuple[EventSpec, ...] = ()
    dropped: int = 0  # Events dropped because the outbox was full (cumulative in this run)
    max_emitted: int = MAX_EMITTED
    max_outbox: int = MAX_OUTBOX

    def __post_init__(self) -> None:
        emitted: dict[str, float] = {}
        if isinstance(self.emitted, Mapping):
            for key, at in self.emitted.items():
                try:
                    emitted[str(key)] = float(at)
                except (TypeError, ValueError):
                    continue
        outbox = []
        for item in self.outbox if isinstance(self.outbox, (list, tuple)) else ():
            spec = item if isinstance(item, EventSpec) else EventSpec.from_dict(item)
            if spec is not None:
                outbox.append(spec)
        object.__setattr__(self, "emitted", MappingProxyType(emitted))
        object.__setattr__(self, "outbox", tuple(outbox))
        self._trim()

    def want(self, specs: Iterable[EventSpec]) -> "EventLedger":
        """Queue Events not yet delivered nor queued."""
        queued = {s.key for s in self.outbox}
        outbox = list(self.outbox)
        for spec in specs:
            if spec.key in self.emitted or spec.key in queued:
                continue
            outbox.append(spec)
            queued.add(spec.key)
        return self if len(outbox) == len(self.outbox) else replace(self, outbox=tuple(outbox))

    def delivered(self, spec: EventSpec, now: float) -> "EventLedger":
        return replace(self, outbox=tuple(s for s in self.outbox if s.key != spec.key),
                       emitted={**self.emitted, spec.key: now})

    def _trim(self) -> None:
        """Within the bounds (``__post_init__`` only: the value is built trimmed)."""
        if len(self.emitted) > self.max_emitted:
            oldest = sorted(self.emitted.items(), key=lambda kv: kv[1])
            forgotten = {key for key, _ in oldest[: len(self.emitted) - self.max_emitted]}
            object.__setattr__(self, "emitted", MappingProxyType(
                {k: v for k, v in self.emitted.items() if k not in forgotten}))
        if len(self.outbox) > self.max_outbox:
            lost = len(self.outbox) - self.max_outbox
            log.warning("effects events_dropped=%d outbox_max=%d reason=outbox_full", lost, self.max_outbox)
            object.__setattr__(self, "dropped", self.dropped + lost)
            object.__setattr__(self, "outbox", self.outbox[lost:])

    def to_state(self) -> dict:
        return {"emitted": dict(self.emitted), "outbox": [asdict(s) for s in self.outbox]}
