"""What the node tells the agent about operators and other writers: a recreated object, a taint
adopted or removed by hand, a clear, a condition of the agent's types that someone else writes.
Read from each node the effects see (watch, read, write reply) into the record.

Only the node can say these things; the record keeps what the node cannot (that the agent's taint
was confirmed applied, so a taint that later vanishes was removed by hand and not never written).
An operator's clear (the ``healthagent.io/clear`` annotation with a new token, or the agent's
taint removed by hand while the agent still wants it) forgets every open finding, removes the
taint and labels, and is reported as one ``Cleared`` Event; the token is what the loop hands to
the classifier so it forgets them too.

Another writer of one of the agent's condition types (the EKS node monitoring agent writes
``AcceleratedHardwareReady`` and ``NetworkingReady`` too) is noticed from the node itself
(``conditions.foreign_conditions``: a reason the agent never writes, or another field manager in
``managedFields``), said once (a log line and a Warning Event), and left alone from then on: the
plans never write that type again while this agent runs (``foreign``). Two writers of one
condition would flip it back and forth, and an engine that repairs on it would act on noise.
"""

from __future__ import annotations

import logging

from healthagent.effects.conditions import DEFAULT, Vocabulary, foreign_conditions
from healthagent.effects.events import NORMAL, EventLedger, EventSpec, foreign_condition_event
from healthagent.effects.node_desired import (
    CLEAR_HANDLED_ANNOTATION,
    NO_EXECUTE,
    TAINT_ACTIONS,
    annotations_of,
    grace_start,
    owned_taints,
    reboot_outstanding,
)
from healthagent.effects.plan import ClearRequest, blind_to, effective_findings
from healthagent.effects.record import AppliedTaint, EffectsRecord
from healthagent.model import Action, Verdict

log = logging.getLogger(__name__)


class NodeFacts:
    """Notices operators' actions on the node and records them (``observe``, ``cleared``)."""

    def __init__(self, record: EffectsRecord, ledger: EventLedger, node_name: str, taint_key: str,
                 vocab: Vocabulary = DEFAULT) -> None:
        self.record = record
        self.ledger = ledger
        self.node_name = node_name
        self.taint_key = taint_key
        self.vocab = vocab
        self.foreign: frozenset[str] = frozenset()  # condition types another writer owns: left alone

    def observe(self, node: dict, now: float, verdict: Verdict | None, wall: float | None = None) -> None:
        """Adopt what the node records; notice a recreated Node, a taint removed by hand and
        another writer of the agent's condition types. ``now``: the decision clock (an adopted
        taint's grace); ``wall``: the wall time Events carry (None: ``now``)."""
        wall = now if wall is None else wall
        self._notice_other_writers(node, wall)
        record = self.record
        uid = str((node.get("metadata") or {}).get("uid") or "")
        if uid and record.node_uid and uid != record.node_uid and record.taint is not None:
            log.warning("effects node=%s object recreated (uid %s -> %s); the applied taint is "
                        "forgotten and decided again", self.node_name, record.node_uid, uid)
            record.taint = None
        if uid:
            record.node_uid = uid
        handled = annotations_of(node).get(CLEAR_HANDLED_ANNOTATION, "")
        if handled and not record.clear_token:
            record.clear_token = handled
        ours = owned_taints(node, self.taint_key)
        if ours:
            self._adopt(node, ours, now, wall)
        elif record.taint is not None and verdict is not None:
            # gone while the agent still wanted it (a replace taint, a taint action, or a reboot
            # taint held while unobserved): someone removed it by hand
            wanted = Action.most_severe([f.action for f in effective_findings(verdict, record.cleared)])
            awaited = record.taint.value == Action.REBOOT_NODE.value and reboot_outstanding(node)
            if record.taint.value == Action.REPLACE_NODE.value or wanted in TAINT_ACTIONS \
                    or blind_to(verdict, record.taint.code) or awaited:
                self.cleared(ClearRequest(f"taint-removed-{int(wall)}", "taint-removed"), wall, verdict)
            else:
                record.taint = None  # our own removal whose reply was lost

    def _notice_other_writers(self, node: dict, wall: float) -> None:
        """Mark the agent's condition types that another writer owns (once each; never unmarked
        while this agent runs) and say so once."""
        for other in foreign_conditions(node, self.vocab):
            if other.type in self.foreign:
                continue
            self.foreign = self.foreign | {other.type}
            log.warning("effects node=%s condition=%s left_alone=1 reason=%s: %s; the agent does not write "
                        "it (one writer per condition)", self.node_name, other.type, other.reason or "-",
                        other.why)
            self.ledger.want([foreign_condition_event(other.type, other.why, wall)])

    def _adopt(self, node: dict, ours: list[dict], now: float, wall: float) -> None:
        main = max(ours, key=lambda t: (t.get("value") == Action.REPLACE_NODE.value, t.get("effect") == NO_EXECUTE))
        value, effect = str(main.get("value") or ""), str(main.get("effect") or "")
        recorded = self.record.taint
        if recorded is None or recorded.value != value:
            since = grace_start(node, self.taint_key, value, None, now, wall)
            self.record.taint = AppliedTaint(value, effect, now if since is None else since)
            log.info("effects node=%s adopted taint from the node value=%s effect=%s", self.node_name, value, effect)
        elif recorded.effect != effect:
            recorded.effect = effect

    def cleared(self, clear: ClearRequest, wall: float, verdict: Verdict | None) -> None:
        """An operator cleared the node: forget the open findings, the taint; say so once (the
        Event at wall time ``wall``)."""
        keys = [f.key for f in verdict.findings] if verdict else []
        self.record.cleared = list(dict.fromkeys(self.record.cleared + keys))
        self.record.clear_token = clear.token
        self.record.taint = None
        how = ("the healthagent.io/clear annotation" if clear.via == "annotation"
               else "removing the agent's taint by hand")
        log.warning("effects node=%s operator_clear=%s via=%s findings_cleared=%d", self.node_name,
                    clear.token, clear.via, len(keys))
        self.ledger.want([EventSpec(
            key=f"cleared/{clear.token}", type=NORMAL, reason="Cleared", action="Cleared",
            note=f"An operator cleared the node ({how}, token {clear.token}); the agent removed its "
                 f"taint and labels and forgot {len(keys)} open finding(s).", at=wall)])
