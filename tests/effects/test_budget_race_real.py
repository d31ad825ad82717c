"""The disruption budget under a real race, on a real kube-apiserver + etcd.

Many agents (``NodeEffects`` on threads, one API client each) fault in the same instant with one
budget, in a namespace of their own. Every faulty node gets NoSchedule at once (the budget never
holds it back); exactly ``LIMIT`` of them hold the slots, and once the grace is over only those
go on to NoExecute, while the others stay held at NoSchedule. A watch on the nodes, which sees
every change in the API server's order, never sees more than ``LIMIT`` nodes with NoExecute at
once. Then some NoExecute nodes are cleared, the held agents look again all at once, and exactly
as many take the freed slots and go to NoExecute. Also here: a stale slot (its holder's Node
deleted) is reclaimed, a live one is not, and the counter counts the GPU nodes as a paged Table. Skips without
the envtest binaries (the ``control_plane`` fixture).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

from healthagent.effects.budget import (COUNT_LEASE, GPU_NODES_ANNOTATION, SLOT_GRACE_SECONDS, held_lease, new_lease,
                                        slot_name)
from healthagent.effects.node_desired import CLEAR_ANNOTATION
from tests.effects.helpers import T0, TAINT_KEY, XID95, cleared_by, settings_for, start_effects, wait_for
from tests.support.clusters import RealCluster, ensure_namespace

pytestmark = pytest.mark.integration

AGENTS = 24
LIMIT = 5
CLEARED = 2
GRACE = 120.0


class TaintWatch:
    """A watch on the run's nodes from before the race: after each event in the server's order,
    the effect of the agent's taint on each node; ``max_tainted`` and ``max_noexecute`` are the
    most nodes with the taint, and with it as NoExecute, at any moment."""

    def __init__(self, cluster: RealCluster) -> None:
        from kubernetes import client

        self._cluster = cluster
        self._core = client.CoreV1Api(cluster.api_client())
        self._selector = cluster.budget_selector
        listed = self._core.list_node(label_selector=self._selector)
        self._version = listed.metadata.resource_version
        self.effects = {n.metadata.name: _effect(n.spec.taints) for n in listed.items if _effect(n.spec.taints)}
        self.max_tainted = len(self.effects)
        self.max_noexecute = len(self.noexecute)
        self.markers: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="taint-watch", daemon=True)

    @property
    def noexecute(self) -> set[str]:
        return {name for name, effect in self.effects.items() if effect == "NoExecute"}

    def __enter__(self) -> "TaintWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self.caught_up("stop")  # one more event: the stream looks at the stop flag
        self._thread.join(60)

    def _run(self) -> None:
        from kubernetes import watch

        stream = watch.Watch()
        for event in stream.stream(self._core.list_node, label_selector=self._selector,
                                   resource_version=self._version, timeout_seconds=300):
            node = event["object"]
            name = node.metadata.name
            effect = "" if event["type"] == "DELETED" else _effect(node.spec.taints)
            if effect:
                self.effects[name] = effect
            else:
                self.effects.pop(name, None)
            self.max_tainted = max(self.max_tainted, len(self.effects))
            self.max_noexecute = max(self.max_noexecute, len(self.noexecute))
            marker = (node.metadata.labels or {}).get("test.healthagent.io/marker")
            if marker:
                self.markers.add(marker)
            if self._stop.is_set():
                stream.stop()

    def caught_up(self, marker: str) -> None:
        """Wait until the watch has seen every change so far: a label written now arrives after
        all of them (a watch delivers in resourceVersion order)."""
        first = self._cluster.name(0)
        self._cluster.update_node(first, lambda n: n["metadata"]["labels"].update(
            {"test.healthagent.io/marker": marker}))
        wait_for(lambda: marker in self.markers, 60, f"the taint watch to see marker {marker}")


def _effect(taints: Any) -> str:
    """The effect of the agent's taint ("" without one; NoExecute wins over NoSchedule)."""
    effects = {t.effect for t in taints or [] if t.key == TAINT_KEY}
    return "NoExecute" if "NoExecute" in effects else next(iter(effects), "")


@pytest.fixture
def fleet(control_plane, unique_name, tmp_path) -> Iterator[tuple[RealCluster, str, list]]:
    """``AGENTS`` GPU nodes, each with its agent's NodeEffects (started), one budget of ``LIMIT``
    in a namespace of their own."""
    from kubernetes import client

    cluster = RealCluster(control_plane, unique_name("race") + "-")
    namespace = unique_name("budget")
    ensure_namespace(client.CoreV1Api(cluster.api_client()), namespace)
    try:
        names = cluster.seed(AGENTS)
        count_nodes(cluster, namespace, cluster.budget_selector)
        agents = [start_effects(settings_for(tmp_path / name, name, budget_node_selector=cluster.budget_selector,
                                             budget_namespace=namespace, budget_max_fraction=0.5,
                                             budget_max_nodes=LIMIT, replace_noexecute_grace_seconds=GRACE),
                                cluster, request_timeout=(10.0, 60.0))
                  for name in names]
        for effects in agents:
            effects.startup(T0 - 1, "boot-1")
        yield cluster, namespace, agents
    finally:
        cluster.close()


def slot_holders(cluster: RealCluster, namespace: str) -> dict[str, str]:
    reply = cluster.plane.admin_session().get(
        f"{cluster.plane.url}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases", timeout=10).json()
    return {i["metadata"]["name"]: (i.get("spec") or {}).get("holderIdentity") or "" for i in reply["items"]
            if i["metadata"]["name"].startswith("healthagent-budget-slot-")}


def holders(cluster: RealCluster, namespace: str) -> set[str]:
    return {holder for holder in slot_holders(cluster, namespace).values() if holder}


def effects_now(cluster: RealCluster) -> dict[str, str]:
    """Node name -> the effect of the agent's taint, for every run node that carries one."""
    found = {}
    for i in range(AGENTS):
        name = cluster.name(i)
        effect = next((t["effect"] for t in cluster.node(name)["spec"].get("taints") or [] if t["key"] == TAINT_KEY),
                      "")
        if effect:
            found[name] = effect
    return found


def all_at_once(agents: list, step) -> list:
    """``step(effects)`` on every agent's own thread, released together by a barrier."""
    barrier = threading.Barrier(len(agents))

    def run(effects):
        barrier.wait()
        return step(effects)

    with ThreadPoolExecutor(len(agents)) as pool:
        return list(pool.map(run, agents))


def test_many_agents_faulting_at_once_never_exceed_one_budget(fleet):
    cluster, namespace, agents = fleet
    count = cluster.plane.admin_session().get(
        f"{cluster.plane.url}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{COUNT_LEASE}",
        timeout=10).json()
    assert count["metadata"]["annotations"][GPU_NODES_ANNOTATION] == str(AGENTS)  # the counter's, shared
    with TaintWatch(cluster) as watch:
        statuses = all_at_once(agents, lambda effects: effects.reconcile(XID95, T0, "boot-1"))
        watch.caught_up("race")
        # every faulty node is off the scheduler at once; exactly LIMIT hold the slots
        assert set(effects_now(cluster).values()) == {"NoSchedule"} and len(effects_now(cluster)) == AGENTS
        first = holders(cluster, namespace)
        assert len(first) == LIMIT and watch.max_noexecute == 0
        assert sum(s.budget_blocked for s in statuses) == AGENTS - LIMIT
        assert {e.node_name for e, s in zip(agents, statuses) if not s.budget_blocked} == first
        assert all(s.pending_writes == 0 for s in statuses)

        # the grace is over: the holders go to NoExecute, the held ones look again and stay
        statuses = all_at_once(agents, lambda effects: effects.reconcile(XID95, T0 + GRACE, "boot-1"))
        watch.caught_up("grace")
        now = effects_now(cluster)
        assert {name for name, effect in now.items() if effect == "NoExecute"} == first == holders(cluster, namespace)
        assert len(now) == AGENTS and watch.max_noexecute == LIMIT and watch.max_tainted == AGENTS
        assert sum(s.budget_blocked for s in statuses) == AGENTS - LIMIT

        # some NoExecute nodes are cleared: their slots go back
        cleared = sorted(first)[:CLEARED]
        by_name = {effects.node_name: effects for effects in agents}
        for name in cleared:
            cluster.update_node(name, lambda n: n["metadata"].setdefault("annotations", {}).update(
                {CLEAR_ANNOTATION: "race"}))
            by_name[name].reconcile(XID95, T0 + GRACE + 61, "boot-1")  # the resync reads the node (no watch here)
            by_name[name].reconcile(cleared_by("race"), T0 + GRACE + 61, "boot-1")  # policy's verdict for it
        assert set(effects_now(cluster)) == set(by_name) - set(cleared)
        # every held agent looks again at once: exactly the freed slots are taken, and those go out
        waiting = [effects for effects in agents if effects.node_name not in first]
        again = all_at_once(waiting, lambda effects: effects.reconcile(
            XID95, max(effects.budget_recheck_at, T0 + GRACE + 61), "boot-1"))
        watch.caught_up("refill")
        now = effects_now(cluster)
        out = {name for name, effect in now.items() if effect == "NoExecute"}
        assert len(out) == LIMIT and watch.max_noexecute == LIMIT
        assert out == holders(cluster, namespace)  # NoExecute only with a slot
        assert sum(not s.budget_blocked for s in again) == CLEARED
        assert set(now) == set(by_name) - set(cleared)  # all the others carry NoSchedule
        assert len(slot_holders(cluster, namespace)) == LIMIT  # no slot past the limit was ever made
    errors = [effects.errors for effects in agents if effects.errors]
    assert errors == []


def test_a_stale_slot_is_reclaimed_and_a_live_one_is_not(control_plane, unique_name, tmp_path):
    from kubernetes import client

    cluster = RealCluster(control_plane, unique_name("stale") + "-")
    namespace = unique_name("budget")
    admin = client.CoordinationV1Api(cluster.api_client())
    ensure_namespace(client.CoreV1Api(cluster.api_client()), namespace)
    try:
        names = cluster.seed(4)
        live, gone, me = names[1], names[2], names[0]
        cluster.update_node(live, lambda n: n["spec"].update(taints=[
            {"key": TAINT_KEY, "value": "replace_node", "effect": "NoSchedule"}]))
        for index, holder in ((0, live), (1, gone)):
            admin.create_namespaced_lease(namespace, held_lease(new_lease(slot_name(index), namespace, "slot"),
                                                                holder, T0 - 600, acquired=True))
        cluster.delete_node(gone)
        count_nodes(cluster, namespace, cluster.budget_selector)
        effects = start_effects(settings_for(tmp_path, me, budget_node_selector=cluster.budget_selector,
                                             budget_namespace=namespace, budget_max_fraction=1.0,
                                             budget_max_nodes=2), cluster)  # a limit of 2 on 3 nodes
        # the agent's first look: a slot is judged once this agent has seen it unchanged for the grace
        effects.startup(T0 - SLOT_GRACE_SECONDS - 1, "boot-1")
        # each look judges one held slot; a live holder is remembered, so two looks judge both
        status = effects.reconcile(XID95, T0, "boot-1")
        if status.budget_blocked:  # it judged the live holder first
            status = effects.reconcile(XID95, effects.budget_recheck_at, "boot-1")
        assert not status.budget_blocked
        assert slot_holders(cluster, namespace) == {slot_name(0): live, slot_name(1): me}
    finally:
        cluster.close()


def count_nodes(cluster: RealCluster, namespace: str, selector: str, scope_label: str = "") -> dict:
    """One round of the budget counter, as its own service account, into ``namespace``."""
    return cluster.count_gpu_nodes(scope_label, at=T0, namespace=namespace, selector=selector)


def test_the_counter_counts_the_selected_nodes_page_by_page(control_plane, unique_name, monkeypatch):
    """7 nodes in pages of 3 (the continue token of a real server), per pool with a scope label;
    a selector that matches none counts 0."""
    from kubernetes import client

    import healthagent.budget_counter as counter
    from healthagent.effects.budget import Scope

    monkeypatch.setattr(counter, "PAGE_ROWS", 3)
    cluster = RealCluster(control_plane, unique_name("count") + "-")
    namespace = unique_name("budget")
    ensure_namespace(client.CoreV1Api(cluster.api_client()), namespace)
    try:
        names = cluster.seed(7)
        assert count_nodes(cluster, namespace, cluster.budget_selector) == {Scope(): 7}
        for name in names[:2]:
            cluster.update_node(name, lambda n: n["metadata"]["labels"].update({"pool": "a"}))
        pools = count_nodes(cluster, namespace, cluster.budget_selector, "pool")
        assert pools == {Scope("pool", "a"): 2, Scope("pool", ""): 5}
        assert count_nodes(cluster, namespace, f"{cluster.budget_selector},nvidia.com/gpu.present=false") == {
            Scope(): 0}
    finally:
        cluster.close()


def test_a_budget_namespace_that_does_not_exist_holds_the_node_and_says_which(control_plane, unique_name, tmp_path,
                                                                               caplog):
    """A Lease create in a namespace the cluster lacks is a 404: the node is held at NoSchedule,
    and the log line names the namespace and the setting that fixes it."""
    cluster = RealCluster(control_plane, unique_name("nons") + "-")
    try:
        names = cluster.seed(3)
        effects = start_effects(settings_for(tmp_path, names[0], budget_node_selector=cluster.budget_selector,
                                             budget_namespace="no-such-namespace",
                                             replace_noexecute_grace_seconds=0.0), cluster)
        effects.startup(T0 - 1, "boot-1")
        with caplog.at_level("WARNING"):
            status = effects.reconcile(XID95, T0, "boot-1")
        assert status.budget_blocked and status.taint_effect == "NoSchedule"
        assert effects.errors.get("rejected_404", 0) >= 1
        assert "is there a namespace 'no-such-namespace'? set budget_namespace" in caplog.text
    finally:
        cluster.close()
