"""The node conditions the agent writes: two vocabularies, and noticing another writer.

Why two: ``GpuHealthy``/``NetworkHealthy`` (the default, ``healthagent``) say what node-problem-detector
would say, and nothing acts on them by itself. ``eks`` speaks the EKS node monitoring agent's
vocabulary, ``AcceleratedHardwareReady`` for GPU (and NVSwitch) findings and ``NetworkingReady`` for
network (EFA, InfiniBand, RoCE) findings, with the reasons that ecosystem uses (``NvidiaXID79Error``, ``NvidiaDoubleBitError``,
...). Karpenter's node repair (v1.14.1, feature gate ``NodeRepair``) replaces a node whose condition
of those types stays ``False`` past its wait (10 minutes for ``AcceleratedHardwareReady``, 30 for
``NetworkingReady`` in the AWS provider), reading only the condition's type and status, and EKS
managed node groups' node auto repair reboots or replaces it, so in ``eks`` mode a ``False`` is a
disruption: it is *gated* (``Vocabulary.gated``). It says ``False`` only for a node action
(``reboot_node``, ``replace_node``) that the agent is taking - its taint on the node, the job's
NoExecute grace over, and the node holding a slot of the disruption budget - and ``True`` with a
message otherwise (``RepairAfterGrace`` in the grace, ``RepairHeldByBudget`` while the budget holds
the node at NoSchedule).

Never two writers: the EKS node monitoring agent writes the same types. A condition of the active
types that the agent did not write is left alone (``foreign_conditions``): its reason is not one
the agent ever writes under the vocabulary (the monitoring agent's ``NvidiaGPUIsReady``,
``NetworkingIsReady``, ``IPAMDNotReady``, ...), or ``metadata.managedFields`` shows another field
manager writing its status or reason; ``effects/other_writers.py`` takes it back once that writer
has gone quiet. The agent's own writes carry the field manager ``healthagent`` (the API server
takes it from the User-Agent, which ``identify`` sets).

Pure functions and tables; no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from healthagent import __version__
from healthagent.model import Finding
from healthagent.policy.finding_catalog import catalog_rows

HEALTHAGENT = "healthagent"
EKS = "eks"
FIELD_MANAGER = "healthagent"
USER_AGENT = f"{FIELD_MANAGER}/{__version__}"
# The manager the API server recorded for writes of versions that did not name themselves (the
# ``kubernetes`` client's default User-Agent is ``OpenAPI-Generator/<version>/python``): their
# GpuHealthy/NetworkHealthy are the agent's own.
UNNAMED_CLIENT_MANAGER = "OpenAPI-Generator"

GPU_AREA = "gpu"
NETWORK_AREA = "network"  # the node's network fabric: EFA, InfiniBand, RoCE

# Reasons of the agent's own that carry no finding code: the same in both vocabularies.
ALL_CHECKS_PASSED = "AllChecksPassed"
REPLACE_PENDING_REASON = "ReplacePending"
REBOOT_PENDING_REASON = "RebootPending"
FINDINGS_WITHOUT_NODE_ACTION = "FindingsWithoutNodeAction"
REPAIR_HELD_BY_BUDGET = "RepairHeldByBudget"
REPAIR_AFTER_GRACE = "RepairAfterGrace"
NOT_OBSERVED_REASONS = {GPU_AREA: "GpuNotObserved", NETWORK_AREA: "NetworkNotObserved"}
OWN_REASONS = frozenset({ALL_CHECKS_PASSED, REPLACE_PENDING_REASON, REBOOT_PENDING_REASON,
                         FINDINGS_WITHOUT_NODE_ACTION, REPAIR_HELD_BY_BUDGET, REPAIR_AFTER_GRACE,
                         *NOT_OBSERVED_REASONS.values()})

NMA = "EKS node monitoring agent"
COINED = "coined by healthagent"
_REASON_FROM = {"nma": NMA, "coined": COINED}
# Finding code -> (reason in the eks vocabulary, where the name comes from): the finding catalog's
# eks_reason columns (healthagent/policy/findings.csv). The monitoring agent's names are from its
# reason table (aws/eks-node-monitoring-agent pkg/reasons, the EKS user guide's "Node health
# issues"); where it has no name for what the agent finds, the reason is coined in the same style,
# never containing "XID", so no reader that picks an action from an XID number in a reason (managed
# node groups' per-reason repair actions) mistakes one for an XID.
EKS_REASONS: dict[str, tuple[str, str]] = {
    row.code: (row.eks_reason, _REASON_FROM[row.eks_reason_from]) for row in catalog_rows()}
_NETWORK_CODES = frozenset(row.code for row in catalog_rows() if row.condition == "network")
XID_REASON = re.compile(r"NvidiaXID\d{0,5}Error")
CODE_REASON = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")  # a finding code: GPU_XID, EFA_RX_DROPS
_NAMED_XID = re.compile(r"\(XID (\d{1,5}),")


def area_of(code: str) -> str:
    """The area a finding code belongs to: the node's network fabric (EFA_*, and RDMA_* for
    InfiniBand/RoCE ports) -> network, everything else (GPU, NVSwitch) -> gpu. RDMA findings share the
    networking condition (``NetworkHealthy``, ``NetworkingReady``) rather than a type of their own: the
    engines that repair nodes act on ``NetworkingReady`` alone, and the admission policy admits the
    agent's two types only (docs/design.md, "InfiniBand and RoCE ports"). The catalog's condition
    column decides; a code it does not know (a taint's reason adopted from the node) by its prefix."""
    if code in _NETWORK_CODES or code.startswith(("EFA_", "RDMA_")):
        return NETWORK_AREA
    return GPU_AREA


def deciding_xid(finding: Finding) -> int | None:
    """The XID that decided a GPU_XID finding's action: the only one, else the one the summary
    names ("... (XID 94, NAME)", as the classifier writes it), else the highest."""
    if not finding.xids:
        return None
    if len(finding.xids) == 1:
        return finding.xids[0]
    named = _NAMED_XID.search(finding.summary or "")
    if named and int(named.group(1)) in finding.xids:
        return int(named.group(1))
    return max(finding.xids)


def eks_reason(finding: Finding) -> str:
    """A finding's reason in the eks vocabulary (a code this table does not know: the code)."""
    if finding.code == "GPU_XID":
        xid = deciding_xid(finding)
        return f"NvidiaXID{xid}Error" if xid is not None else "NvidiaXIDError"
    known = EKS_REASONS.get(finding.code)
    if known:
        return known[0]
    return finding.code


@dataclass(frozen=True)
class Vocabulary:
    """The condition types and reasons of one vocabulary."""

    name: str
    gpu_type: str
    network_type: str
    gated: bool  # False only for a node action the agent is taking (an engine repairs on False)
    own_managers: tuple[str, ...]

    @property
    def types(self) -> tuple[str, str]:
        return (self.gpu_type, self.network_type)

    def type_of(self, area: str) -> str:
        return self.network_type if area == NETWORK_AREA else self.gpu_type

    def reason_for(self, finding: Finding) -> str:
        return eks_reason(finding) if self.name == EKS else finding.code

    def writes_reason(self, reason: str) -> bool:
        """Could the agent have written ``reason`` under this vocabulary?"""
        if reason in OWN_REASONS or CODE_REASON.fullmatch(reason):
            return True
        return self.name == EKS and (bool(XID_REASON.fullmatch(reason)) or
                                     reason in {r for r, _ in EKS_REASONS.values()})


VOCABULARIES: dict[str, Vocabulary] = {
    HEALTHAGENT: Vocabulary(HEALTHAGENT, "GpuHealthy", "NetworkHealthy", gated=False,
                            own_managers=(FIELD_MANAGER, UNNAMED_CLIENT_MANAGER)),
    EKS: Vocabulary(EKS, "AcceleratedHardwareReady", "NetworkingReady", gated=True,
                    own_managers=(FIELD_MANAGER,)),
}
DEFAULT = VOCABULARIES[HEALTHAGENT]


def vocabulary(name: str) -> Vocabulary:
    """The vocabulary of a ``condition_vocabulary`` setting (validated by the config)."""
    return VOCABULARIES.get(name, DEFAULT)


def identify(api_client: Any) -> None:
    """Make the agent's requests name it: the API server records the User-Agent's first word
    (``healthagent``) as the field manager of what the agent writes, which is how another agent
    tells the agent's conditions from its own, and the agent tells theirs from its own."""
    try:
        api_client.user_agent = USER_AGENT
    except AttributeError:  # a client without the property (a test double): nothing to name
        pass


# -- another writer --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForeignCondition:
    """A condition of the agent's types that someone else writes: leave it alone."""

    type: str
    reason: str
    managers: tuple[str, ...]  # other field managers of its status or reason (managedFields)
    why: str


def condition_managers(node: Mapping, ctype: str) -> tuple[str, ...]:
    """The field managers that wrote the status, reason or message of condition ``ctype``
    (``metadata.managedFields``; empty where the server keeps none, as in dry-run)."""
    found: list[str] = []
    for entry in (node.get("metadata") or {}).get("managedFields") or []:
        if not isinstance(entry, dict):
            continue
        conditions = (((entry.get("fieldsV1") or {}).get("f:status") or {}).get("f:conditions") or {})
        if not isinstance(conditions, dict):
            continue
        for key, fields in conditions.items():
            if _keyed_type(key) == ctype and isinstance(fields, dict) and \
                    {"f:status", "f:reason", "f:message"} & set(fields):
                manager = str(entry.get("manager") or "")
                if manager and manager not in found:
                    found.append(manager)
    return tuple(found)


def label_managers(node: Mapping, key: str) -> tuple[str, ...] | None:
    """The field managers that own label ``key`` (``metadata.managedFields``), or None where the
    server keeps no managedFields at all (dry-run, a server that strips them): then who wrote the
    label cannot be told from the node."""
    entries = (node.get("metadata") or {}).get("managedFields")
    if not isinstance(entries, list) or not entries:
        return None
    found: list[str] = []
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        labels = (((entry.get("fieldsV1") or {}).get("f:metadata") or {}).get("f:labels") or {})
        if isinstance(labels, dict) and f"f:{key}" in labels:
            manager = str(entry.get("manager") or "")
            if manager and manager not in found:
                found.append(manager)
    return tuple(found)


def _keyed_type(key: str) -> str | None:
    """The type in a managedFields list key ``k:{"type":"Ready"}``; None for anything else."""
    if not key.startswith("k:"):
        return None
    try:
        value = json.loads(key[2:])
    except ValueError:
        return None
    return value.get("type") if isinstance(value, dict) else None


def foreign_conditions(node: Mapping, vocab: Vocabulary) -> list[ForeignCondition]:
    """The conditions of ``vocab``'s types on ``node`` that another writer owns."""
    found = []
    for cond in (node.get("status") or {}).get("conditions") or []:
        if not isinstance(cond, dict) or cond.get("type") not in vocab.types:
            continue
        ctype, reason = str(cond["type"]), str(cond.get("reason") or "")
        others = tuple(m for m in condition_managers(node, ctype) if m not in vocab.own_managers)
        if not vocab.writes_reason(reason):
            why = f"its reason {reason!r} is not one the agent writes"
        elif others:
            why = f"field manager {', '.join(others)} writes it"
        else:
            continue
        found.append(ForeignCondition(ctype, reason, others, why))
    return found

