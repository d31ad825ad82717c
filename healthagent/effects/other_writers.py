"""Another writer of a condition of the agent's vocabulary: step back while it writes, take the
condition back once it has gone quiet.

Why: the EKS node monitoring agent writes ``AcceleratedHardwareReady`` and ``NetworkingReady``,
the conditions of the ``eks`` vocabulary. Two writers of one condition overwrite each other, so
while it writes, the agent leaves the condition alone (``effects/conditions.py`` says how a
condition is recognised as another writer's). But that agent leaves its conditions, reasons and
``managedFields`` entry on the node when it is removed, so "another writer owns it" must end when
the writer stops writing, or no one would ever speak for the node again.

"Writing" is read from the node: each other field manager's ``managedFields`` time for the
condition (the API server stamps it whenever that manager changes the object), or, where the
server keeps no managedFields, the condition's own status, reason, message and heartbeat. The
agent notes on its decision clock (``clock.py``) when that evidence last changed. Once it has
not changed for the quiet time, the agent takes the condition back; if it changes again, the
agent steps back again. The quiet time adapts to the writer: three times the longest gap seen
between two of its writes, at least ``MIN_QUIET_SECONDS``, at most ``max_quiet`` (the setting
``foreign_condition_quiet_seconds``, 660 s by default: the monitoring agent v1.7.0 re-writes every
condition each 5 minutes, so two missed heartbeats and a minute). Until two writes have been seen
(after the agent's own start, say) it is ``max_quiet``.

Pure functions over frozen values; what this run learnt is not saved (a restart watches afresh).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from healthagent.effects.conditions import ForeignCondition, Vocabulary, foreign_conditions

MIN_QUIET_SECONDS = 60.0
QUIET_GAPS = 3  # the quiet time is this many of the longest gap between the writer's writes


@dataclass(frozen=True)
class OtherWriter:
    """What the agent has seen of another writer of one condition type."""

    type: str
    reason: str  # the condition's reason when last seen (for the log and the Event)
    why: str  # how it was recognised as another writer's
    evidence: tuple  # what its last write left (managedFields times, or the condition itself)
    since: float  # decision clock: when that evidence was first seen
    longest_gap: float = 0.0  # the longest time between two of its writes seen (0: one write seen)
    released: bool = False  # quiet long enough: the agent writes the condition again

    def quiet_seconds(self, max_quiet: float) -> float:
        if self.longest_gap <= 0:
            return max_quiet
        return min(max_quiet, max(min(MIN_QUIET_SECONDS, max_quiet), QUIET_GAPS * self.longest_gap))


@dataclass(frozen=True)
class Change:
    """What changed for one condition type in this look: ``noticed`` (another writer is writing
    it: step back) or ``released`` (it has been quiet: take the condition back)."""

    kind: str
    writer: OtherWriter
    quiet_seconds: float = 0.0


def evidence_of(node: Mapping, other: ForeignCondition) -> tuple:
    """What the other writer's last write left on the node for condition ``other.type``."""
    meta = node.get("metadata") or {}
    entries = meta.get("managedFields")
    if isinstance(entries, list) and entries and other.managers:
        stamps = sorted({(str(e.get("manager") or ""), str(e.get("time") or ""), str(e.get("subresource") or ""))
                         for e in entries if isinstance(e, dict) and e.get("manager") in other.managers})
        return ("managedFields", tuple(stamps))
    for cond in (node.get("status") or {}).get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == other.type:
            return ("condition",) + tuple(str(cond.get(k) or "") for k in
                                          ("status", "reason", "message", "lastHeartbeatTime"))
    return ("condition",)


def track(writers: tuple[OtherWriter, ...], node: Mapping, vocab: Vocabulary, now: float,
          max_quiet: float) -> tuple[tuple[OtherWriter, ...], tuple[Change, ...]]:
    """The other writers after looking at ``node`` at ``now`` (decision clock), and what changed."""
    known = {w.type: w for w in writers}
    kept: list[OtherWriter] = []
    changes: list[Change] = []
    for other in foreign_conditions(node, vocab):
        evidence = evidence_of(node, other)
        seen = known.get(other.type)
        if seen is None:
            writer = OtherWriter(other.type, other.reason, other.why, evidence, now)
            changes.append(Change("noticed", writer))
        elif evidence != seen.evidence:  # it wrote again
            writer = replace(seen, reason=other.reason, why=other.why, evidence=evidence, since=now,
                             longest_gap=max(seen.longest_gap, now - seen.since), released=False)
            if seen.released:
                changes.append(Change("noticed", writer))
        else:
            writer = seen
            quiet = seen.quiet_seconds(max_quiet)
            if not seen.released and now - seen.since >= quiet:
                writer = replace(seen, released=True)
                changes.append(Change("released", writer, quiet))
        kept.append(writer)
    return tuple(kept), tuple(changes)


def left_alone(writers: tuple[OtherWriter, ...]) -> frozenset[str]:
    """The condition types the plan must not write: another writer's, not (yet) released."""
    return frozenset(w.type for w in writers if not w.released)
