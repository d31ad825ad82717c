"""Shared parts of the budget tests on the fake API server: a 20-node fleet (a limit of 2 at the
default 10%), peers' slots and taints written as their agents would, and what the fake recorded."""

from __future__ import annotations

import pytest

from healthagent.budget_counter import BudgetCounter
from healthagent.effects.api_time import rfc3339
from healthagent.effects.backend import ApiBackend
from healthagent.effects.budget import COUNT_LEASE, held_lease, new_lease, slot_name
from tests.effects.helpers import T0, TAINT_KEY, our_taints

NODE = "gpu-node-0"
NAMESPACE = "healthagent"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"


@pytest.fixture
def cluster(fake):
    fake.seed_nodes(20)  # 10% of 20 GPU nodes: a limit of 2
    count_gpu_nodes(fake)
    fake.reset_log()  # what the tests look at is the agents' requests
    return fake


def count_gpu_nodes(fake, scope_label: str = "", at: float = T0) -> None:
    """One round of the budget counter (the one writer of the counts) against ``fake``."""
    BudgetCounter(ApiBackend(fake.api_client(), ""), NAMESPACE, "nvidia.com/gpu.present=true",
                  scope_label).round(at)


def peer_holds(fake, index, name, tainted=True, at=T0 - 600, value="replace_node", effect="NoExecute"):
    """Peer ``name``'s agent holds slot ``index`` (taken at ``at``) and, ``tainted``, its taint
    (NoExecute: it took its disruptive step, as a holder does after its grace)."""
    lease = held_lease(new_lease(slot_name(index), NAMESPACE, "slot"), name, at, acquired=True)
    fake.put_lease(NAMESPACE, lease)
    if tainted:
        taint = {"key": TAINT_KEY, "value": value, "effect": effect, "timeAdded": rfc3339(at)}
        fake.update_node(name, lambda n: n["spec"].update(taints=[taint]))


def holders(fake):
    """Slot name -> holder, for every slot Lease (free ones: "")."""
    return {lease["metadata"]["name"]: (lease.get("spec") or {}).get("holderIdentity") or ""
            for lease in fake.leases(NAMESPACE) if lease["metadata"]["name"] != COUNT_LEASE}


def held_by(fake, node):
    return [name for name, holder in holders(fake).items() if holder == node]


def tainted(fake):
    return sorted(n["metadata"]["name"] for n in fake.nodes() if our_taints(n))


def effects(fake):
    """Node name -> the effect of the agent's taint, for every node that carries one."""
    return {n["metadata"]["name"]: our_taints(n)[0]["effect"] for n in fake.nodes() if our_taints(n)}


def node_lists(fake):
    """LISTs of nodes other than the watch's own-node list (fieldSelector)."""
    return [r.query for r in fake.requests("GET", "/api/v1/nodes")
            if r.path == "/api/v1/nodes" and "fieldSelector" not in r.query]


def before_write(effects, action):
    """Run ``action`` once, right after this agent's next look at the budget's Leases: a peer (or
    the API server) acting between this agent's look and its write."""
    store = effects.budget._store
    real_list = store.list
    done = []

    def look(*args, **kwargs):
        items = real_list(*args, **kwargs)
        if not done:
            done.append(True)
            action()
        return items

    store.list = look
