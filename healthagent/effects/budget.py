"""Cluster-wide circuit breaker for the disruptive steps: the rule, and the slots that make it exact.

A bug in the agent or a bad driver roll-out can make every node look broken at once; taking them
all out would drain the cluster. So at most ``limit`` GPU nodes take the agent's disruptive step
at once, with ``limit = max(1, floor(budget_max_fraction * gpu_nodes))``, capped by
``budget_max_nodes`` when set (0 = never). At the default 10%, a cluster of 20 GPU nodes allows 2:
the 3rd is held. The disruptive steps are NoExecute after the grace (the job's pods are evicted),
HyperPod's ``UnschedulablePending*`` value and, in the ``eks`` vocabulary, a condition's ``False``
(each makes something reboot or replace the node). NoSchedule is not one: every node with a
node action gets it at once, so new pods stay off a faulty GPU while running pods are untouched.
A held node keeps NoSchedule and reports (metric, Event, log line; label and conditions say what
is wrong). Removing a taint, a label or a condition never asks: the budget never blocks healing.

The budget is a fixed set of ``coordination.k8s.io`` Lease objects in the agent's namespace, one
per unit of the limit: ``healthagent-budget-slot-0`` .. ``-<limit - 1>``. A node may take its
disruptive step only while it holds a slot (``spec.holderIdentity`` = its node name). It asks for
one when it is first tainted, so the slot is reserved while the job gets its grace. It takes a
free one with a write the API server applies only to the version it read (a create, which fails
when the Lease exists, or an update carrying the ``resourceVersion`` read), so two agents racing
for one slot cannot both win: the loser gets a 409 and looks again. More holders than slots
cannot exist, so the number of nodes past NoSchedule never passes the limit, however many agents
decide in the same millisecond. No node list is needed: a decision reads the few Leases of the
budget.

A slot comes back when its holder's node loses the taint (healed, cleared) or no longer has a
disruptive step ahead, or is deleted. A holder that cannot give it back (its agent is gone with
its node), a forged holder and a second slot in one node's name are taken back by the agents it
holds back, under the rule in ``effects/budget_reclaim.py``: judged by the holder's Node and by
how long the judging agent has seen the slot unchanged on its own clock, never by the times the
holder wrote (a slot is taken a moment BEFORE the node's taint lands, so a young slot without
the taint is a decision in flight, not a leak). Right after its first node write with a new slot
lands, the holder rewrites its slot (``renewTime``), and a reclaim that read the slot before that
write fails with a 409; a holder whose rewrite fails because its slot was reclaimed goes back to
NoSchedule, and right before its disruptive step a holder reads its slot once more. So even a
reclaim racing a slow holder never leaves two disruptive nodes on one slot.

The fraction needs the number of GPU nodes, and no decision counts them: counting on each
decision cost a node list (or a page of one as long as the limit divided by the fraction) per
agent, O(fleet) bytes exactly when a mass failure makes thousands of agents decide. One more
Lease per budget, ``healthagent-budget-count``, holds the count (annotation
``healthagent.io/gpu-nodes``, ``renewTime`` = when counted), and it is written only by the budget
counter (``healthagent/budget_counter.py``), a one-replica Deployment with its own service
account: the admission policy ``healthagent-budget-count`` refuses a count write by anyone else,
so no node's token can raise the limit, and ``healthagent-own-budget-slot`` refuses the agents
any count. An agent reads the count in the same list as the slots: a decision costs the budget's
few Leases whatever the fleet's size. Until a count exists the limit is the smallest one (1, or
``budget_max_nodes`` when that is 0); while the counter is down, the last count stands.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from healthagent.effects.events import micro_time
from healthagent.effects.api_time import parse_rfc3339

BUDGET_LABEL = "healthagent.io/budget"  # "slot" or "count": the Leases a decision lists
GPU_NODES_ANNOTATION = "healthagent.io/gpu-nodes"
SELECTOR_ANNOTATION = "healthagent.io/node-selector"
SCOPE_LABEL = "healthagent.io/budget-scope"  # a scoped budget's id, on its Leases
SCOPE_ANNOTATION = "healthagent.io/budget-scope-value"  # the label=value it counts, for people
LEASE_LABELS = {"app.kubernetes.io/name": "healthagent", "app.kubernetes.io/part-of": "healthagent"}

SLOT_GRACE_SECONDS = 45.0  # a slot this young without its holder's taint is a decision in flight
COUNT_MAX_AGE_SECONDS = 600.0  # the counter re-writes an unchanged count this often (liveness for people)
RECHECK_JITTER = 0.5  # the next look comes after interval * [1 - j, 1 + j] seconds
MAX_RECHECK_STRETCH = 4  # a node held again and again looks every base * 1, 2, 4, 4, ... seconds
CLOCK_SKEW_SECONDS = 60.0  # a Lease time this far in the future is not believed
MAX_GPU_NODES = 100_000  # past this a count is implausible (the largest clusters run a few 10,000 nodes)
MAX_SLOT_DIGITS = 4
_COUNT_DIGITS = re.compile(r"[0-9]{1,6}")
_SLOT_DIGITS = re.compile(r"0|[1-9][0-9]{0,%d}" % (MAX_SLOT_DIGITS - 1))


def budget_limit(total: int, fraction: float, max_nodes: int | None) -> int:
    """How many GPU nodes may hold a slot (take the disruptive step) at once.

    ``max(1, floor(fraction * total))`` so a small cluster can still take one bad node out; capped
    by ``max_nodes`` when set (0 = never past NoSchedule). The epsilon keeps 0.29 * 100 at 29 instead of
    binary floating point's 28.999...
    """
    limit = max(1, math.floor(fraction * total + 1e-9))
    if max_nodes is not None:
        limit = min(limit, max_nodes)
    return limit


def recheck_interval(base: float, holds: int) -> float:
    """A held node's interval before jitter, after ``holds`` refusals in a row: ``base``,
    doubling up to ``MAX_RECHECK_STRETCH`` times it. A look is a list of the budget's few Leases,
    so its cost does not grow with the cluster; the stretch keeps a mass failure's thousands of
    held nodes from asking every 30 s for hours, while any freed slot is still taken within
    seconds, because so many look."""
    return base * min(2 ** max(0, holds - 1), MAX_RECHECK_STRETCH)


def recheck_delay(base: float, rng: random.Random) -> float:
    """Seconds to the next look: ``base`` +-50%, uniformly, so its mean stays ``base``. Agents
    held in the same moment spread their next looks over a whole interval, and stay spread."""
    return rng.uniform(base * (1 - RECHECK_JITTER), base * (1 + RECHECK_JITTER))


@dataclass(frozen=True)
class Scope:
    """Which budget a node counts in: the fleet's (no ``label``: the setting
    ``budget_scope_label`` unset), or that of the GPU nodes sharing its ``value`` of ``label``
    (a Karpenter NodePool, a managed node group: each engine refuses to repair more than 20% of
    one pool, so the budget's share holds per pool). ``value`` "" is the nodes without the label.
    A scoped budget has Leases of its own, named by a hash of label and value (a label value is
    not always a valid name), labelled with it and annotated with the value for people."""

    label: str = ""
    value: str = ""

    @property
    def id(self) -> str:
        if not self.label:
            return ""
        return "p" + hashlib.sha256(f"{self.label}={self.value}".encode()).hexdigest()[:12]

    @property
    def prefix(self) -> str:
        return f"healthagent-budget-{self.id}-" if self.id else "healthagent-budget-"

    @property
    def count_name(self) -> str:
        return f"{self.prefix}count"

    @property
    def lease_selector(self) -> str:
        return f"{BUDGET_LABEL},{SCOPE_LABEL}={self.id}" if self.id else BUDGET_LABEL

    def of(self, node: Mapping) -> "Scope":
        """The budget ``node`` counts in: its value of this scope's label, as the node has it."""
        if not self.label:
            return self
        labels = (node.get("metadata") or {}).get("labels") or {}
        return Scope(self.label, str(labels.get(self.label) or ""))

    def node_selector(self, base: str) -> str:
        """The GPU nodes this budget counts: ``base`` (``budget_node_selector``) and the scope."""
        if not self.label:
            return base
        part = f"{self.label}={self.value}" if self.value else f"!{self.label}"
        return f"{base},{part}" if base else part


FLEET = Scope()
COUNT_LEASE = FLEET.count_name  # healthagent-budget-count: the fleet's shared count


def slot_name(index: int, scope: Scope = FLEET) -> str:
    return f"{scope.prefix}slot-{index}"


def slot_index(name: str, scope: Scope = FLEET) -> int | None:
    """The index in a slot Lease's name; None for any other name (ASCII digits only, no leading
    zero, at most ``MAX_SLOT_DIGITS``: ``str.isdigit`` also accepts "²", which ``int`` refuses)."""
    prefix = f"{scope.prefix}slot-"
    digits = name[len(prefix):] if name.startswith(prefix) else ""
    return int(digits) if _SLOT_DIGITS.fullmatch(digits) else None


def parse_gpu_nodes(text: object) -> int | None:
    """The count Lease's number of GPU nodes, or None when it is not one a count can be: ASCII
    digits only, at most ``MAX_GPU_NODES``. Only the counter may write it, and the admission policy
    checks the number; still, a value that does not parse or is implausible (a Lease written
    before the policy, or by hand) is no count (the smallest limit), never an exception and never
    a limit larger than a real fleet's."""
    if not isinstance(text, str) or not _COUNT_DIGITS.fullmatch(text):
        return None
    nodes = int(text)
    return nodes if nodes <= MAX_GPU_NODES else None


@dataclass(frozen=True)
class Slot:
    """One slot Lease as read: who holds it, since when (its last write), at which version.

    ``since`` is the holder's wall time, for people: no duration that leads to an action is
    measured from it (a reclaim judges the slot's age from when this agent first saw its
    version, on its own decision clock: ``effects/budget_reclaim.py``)."""

    index: int
    holder: str  # "" = free
    since: float | None  # renewTime, else acquireTime
    version: str
    lease: Mapping[str, Any]

    @property
    def name(self) -> str:
        return str((self.lease.get("metadata") or {}).get("name") or slot_name(self.index))


@dataclass(frozen=True)
class GpuCount:
    """A budget's count of GPU nodes (its count Lease, written by the counter), as read.

    ``counted_at`` is the counter's wall time (``renewTime``), for people: an agent never
    measures a duration from it, and the count's age plays no part in any decision."""

    nodes: int | None  # None: never counted, or by another selector
    counted_at: float | None
    version: str
    lease: Mapping[str, Any]


@dataclass(frozen=True)
class BudgetView:
    """The budget's Leases as one list returned them, and the limit they give."""

    slots: tuple[Slot, ...]
    count: GpuCount | None
    limit: int

    @property
    def held(self) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.holder)

    def held_by(self, node_name: str) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.holder == node_name)

    @property
    def holders(self) -> frozenset[str]:
        """The nodes holding a slot: a node counts once, however many slots name it."""
        return frozenset(s.holder for s in self.held)

    @property
    def allows(self) -> bool:
        """Is there room for one more holder, and a free slot under the limit to hold? (Holders of
        slots past a limit that shrank count; a second slot in one node's name does not.)"""
        return len(self.holders) < self.limit and bool(self.free_indexes())

    def free_indexes(self) -> list[int]:
        """Slot indexes under the limit with no holder (a Lease not created yet is free too)."""
        taken = {s.index for s in self.held}
        return [i for i in range(self.limit) if i not in taken]

    def slot(self, index: int) -> Slot | None:
        return next((s for s in self.slots if s.index == index), None)

    def describe(self) -> str:
        nodes = self.count.nodes if self.count is not None and self.count.nodes is not None else "uncounted"
        return f"slots_held={len(self.held)} limit={self.limit} gpu_nodes={nodes}"


def read_view(items: Iterable[Mapping], selector: str, fraction: float, max_nodes: int | None,
              scope: Scope = FLEET) -> BudgetView:
    """The view from a list of the budget's Leases. A count taken with another node selector (a
    configuration change half rolled out) is no count for this agent."""
    slots, count = [], None
    for lease in items:
        meta = lease.get("metadata") or {}
        spec = lease.get("spec") or {}
        name = str(meta.get("name") or "")
        version = str(meta.get("resourceVersion") or "")
        renewed, acquired = parse_rfc3339(spec.get("renewTime")), parse_rfc3339(spec.get("acquireTime"))
        index = slot_index(name, scope)
        if index is not None:
            slots.append(Slot(index, str(spec.get("holderIdentity") or ""),
                              renewed if renewed is not None else acquired, version, lease))
        elif name == scope.count_name:
            count = _read_count(lease, selector, renewed, version)
    slots.sort(key=lambda s: s.index)
    # no count yet: the limit of an empty cluster, the smallest there is
    limit = budget_limit(count.nodes if count is not None and count.nodes else 0, fraction, max_nodes)
    return BudgetView(tuple(slots), count, limit)


def _read_count(lease: Mapping, selector: str, renewed: float | None, version: str) -> GpuCount:
    annotations = (lease.get("metadata") or {}).get("annotations") or {}
    nodes = parse_gpu_nodes(annotations.get(GPU_NODES_ANNOTATION)) \
        if annotations.get(SELECTOR_ANNOTATION) == selector else None
    return GpuCount(nodes, renewed if nodes is not None else None, version, lease)


# -- the Lease bodies the agent writes -------------------------------------------------------------


def new_lease(name: str, namespace: str, kind: str, scope: Scope = FLEET) -> dict:
    meta: dict = {"name": name, "namespace": namespace, "labels": {**LEASE_LABELS, BUDGET_LABEL: kind}}
    if scope.id:
        meta["labels"][SCOPE_LABEL] = scope.id
        meta["annotations"] = {SCOPE_ANNOTATION: f"{scope.label}={scope.value}"}
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": {}}


def held_lease(lease: Mapping, holder: str, now: float, *, acquired: bool) -> dict:
    """``lease`` (as read, its ``resourceVersion`` kept: the write's precondition) naming
    ``holder``; ``acquired``: a new holder (acquireTime too), else the holder's rewrite."""
    body = _copy(lease)
    spec = body["spec"]
    stamp = micro_time(now)
    spec["holderIdentity"] = holder
    spec["renewTime"] = stamp
    if acquired or not spec.get("acquireTime"):
        spec["acquireTime"] = stamp
    return body


def released_lease(lease: Mapping) -> dict:
    """``lease`` with no holder (its version kept)."""
    body = _copy(lease)
    body["spec"] = {}
    return body


def counted(lease: Mapping, nodes: int, selector: str, now: float) -> dict:
    body = _copy(lease)
    annotations = body["metadata"].setdefault("annotations", {})
    annotations[GPU_NODES_ANNOTATION] = str(nodes)
    annotations[SELECTOR_ANNOTATION] = selector
    body["spec"]["renewTime"] = micro_time(now)
    body["spec"]["leaseDurationSeconds"] = int(COUNT_MAX_AGE_SECONDS)
    return body


def _copy(lease: Mapping) -> dict:
    meta = dict(lease.get("metadata") or {})
    meta.pop("managedFields", None)
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": dict(lease.get("spec") or {})}
    if isinstance(meta.get("annotations"), dict):
        meta["annotations"] = dict(meta["annotations"])
    return body
