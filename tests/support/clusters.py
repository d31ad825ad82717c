"""One test-facing view of a cluster over the fake API server and the real one.

The effects scenarios (tests/effects/test_scenarios.py) run one test body against both:
``FakeCluster`` wraps ``KubeFake`` (where the faults a real server cannot be made to show live),
``RealCluster`` a real kube-apiserver + etcd (``tests/support/envtest.py``). Both offer what a
scenario does to a cluster as another actor would (an operator, the kubelet, a controller) and
what it reads back, as plain JSON dicts.

The real server is one per test session and Nodes are cluster-wide, so a ``RealCluster`` names
its nodes with a prefix of its own and labels them so the budget counts only them; it deletes
them at the end. On the real server, admission adds ``node.kubernetes.io/not-ready:NoSchedule``
to every Node created without a Ready condition (no kubelet runs); ``FakeCluster`` adds the same
taint itself, so both start from the same node.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Any, Callable

from healthagent.effects.budget_leases import DEFAULT_NAMESPACE
from tests.support.kubefake import KubeFake

NOT_READY = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
GPU_LABEL = ("nvidia.com/gpu.present", "true")
RUN_LABEL = "test.healthagent.io/run"
COUNTER_ACCOUNT = "healthagent-budget-counter"  # the name the policy healthagent-budget-count admits
COUNTER_ROLE = "healthagent-test-budget-counter"
READY = {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "no kubelet in tests",
         "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}


class Cluster:
    """What a scenario needs of a cluster; ``kind`` is "fake" or "real"."""

    kind = ""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def name(self, index: int = 0) -> str:
        return f"{self.prefix}gpu-node-{index}"

    @property
    def budget_selector(self) -> str:
        return f"{RUN_LABEL}={self.run_id}"

    @property
    def run_id(self) -> str:
        return (self.prefix.rstrip("-") or "fake")[:63]

    @property
    def budget_namespace(self) -> str:
        """Where the agents under test keep the budget's Leases."""
        return DEFAULT_NAMESPACE

    def count_gpu_nodes(self, scope_label: str = "", at: float = 1_700_000_000.0, namespace: str = "",
                        selector: str = "") -> dict:
        """One round of the budget counter, the one writer of the budget's GPU node counts, with
        the credentials the counter runs with (``counter_client``); its counts by scope."""
        from healthagent.budget_counter import BudgetCounter
        from healthagent.effects.backend import ApiBackend

        namespace = namespace or self.budget_namespace
        return BudgetCounter(ApiBackend(self.counter_client(namespace), ""), namespace,
                             selector or self.budget_selector, scope_label).round(at)

    def counter_client(self, namespace: str):
        """An API client for the budget counter writing counts in ``namespace``."""
        return self.api_client()

    def seed(self, count: int) -> list[str]:
        """``count`` GPU nodes, each with the not-ready taint and a foreign condition."""
        names = [self.name(i) for i in range(count)]
        for name in names:
            self.create_node(name)
        return names

    def create_node(self, name: str) -> dict:
        raise NotImplementedError

    # the rest: api_client, node, update_node, delete_node, events, restart_apiserver,
    # set by the subclasses


class FakeCluster(Cluster):
    kind = "fake"

    def __init__(self, fake: KubeFake) -> None:
        super().__init__("")
        self.fake = fake

    def api_client(self):
        return self.fake.api_client()

    def create_node(self, name: str) -> dict:
        return self.fake.add_node(name, labels={GPU_LABEL[0]: GPU_LABEL[1], RUN_LABEL: self.run_id},
                                  taints=[dict(NOT_READY)], conditions=[dict(READY)])

    def node(self, name: str) -> dict:
        return self.fake.node(name)

    def update_node(self, name: str, mutate: Callable[[dict], None]) -> dict:
        return self.fake.update_node(name, mutate)

    def delete_node(self, name: str) -> None:
        self.fake.delete_node(name)

    def events(self) -> list[dict]:
        return self.fake.events()

    def restart_apiserver(self) -> None:
        """Down, its watch history gone (a new watch cache), up again on the same port."""
        self.fake.go_down()
        self.fake.compact()
        self.fake.come_up()

    def close(self) -> None:
        pass


class RealCluster(Cluster):
    kind = "real"

    def __init__(self, plane: Any, prefix: str) -> None:
        super().__init__(prefix)
        self.plane = plane
        self._admin = plane.api_client()
        from kubernetes import client

        self._core = client.CoreV1Api(self._admin)
        self._events = client.EventsV1Api(self._admin)
        self._created: set[str] = set()
        self._bindings: set[str] = set()
        ensure_namespace(self._core, self.budget_namespace)  # where the agent keeps its budget's Leases

    @property
    def budget_namespace(self) -> str:
        """A namespace of its own: the server is shared by the session, and the budget's count
        Lease and slots left by another test would change this one's budget."""
        return self.run_id

    def api_client(self):
        return self.plane.api_client()

    def counter_client(self, namespace: str):
        """The counter's own identity, as deployed: service account ``healthagent-budget-counter``
        in ``namespace``, allowed to list nodes and write Leases. The admission policy
        healthagent-budget-count (cluster-wide once any test applies it) lets no one else write a
        count, the admin included, so counting as the admin would pass or fail by test order."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        rbac = client.RbacAuthorizationV1Api(self._admin)
        made = [(self._core.create_namespaced_service_account, (namespace, {
                    "metadata": {"name": COUNTER_ACCOUNT, "namespace": namespace}})),
                (rbac.create_cluster_role, ({"metadata": {"name": COUNTER_ROLE}, "rules": [
                    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]},
                    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                     "verbs": ["list", "create", "update"]}]},)),
                (rbac.create_cluster_role_binding, ({
                    "metadata": {"name": f"{COUNTER_ROLE}-{namespace}"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": COUNTER_ROLE},
                    "subjects": [{"kind": "ServiceAccount", "name": COUNTER_ACCOUNT, "namespace": namespace}]},))]
        for create, args in made:
            try:
                create(*args)
            except ApiException as exc:
                if exc.status != 409:
                    raise
        self._bindings.add(f"{COUNTER_ROLE}-{namespace}")
        token = self._core.create_namespaced_service_account_token(
            COUNTER_ACCOUNT, namespace, {"spec": {"expirationSeconds": 3600}}).status.token
        return self.plane.api_client(token)

    def create_node(self, name: str) -> dict:
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {GPU_LABEL[0]: GPU_LABEL[1], RUN_LABEL: self.run_id,
                                                      "kubernetes.io/hostname": name}}}
        self._core.create_node(body)
        self._created.add(name)
        self._core.patch_node_status(name, {"status": {"conditions": [dict(READY)]}},
                                     _content_type="application/strategic-merge-patch+json")
        return self.node(name)

    def node(self, name: str) -> dict:
        return self._raw(self._core.read_node, name)

    def update_node(self, name: str, mutate: Callable[[dict], None]) -> dict:
        """Read, change, PUT with the version read (and PUT ``/status`` when the status changed),
        retrying on 409: another actor's read-modify-write."""
        from kubernetes.client.exceptions import ApiException

        for _ in range(50):
            old = self.node(name)
            new = copy.deepcopy(old)
            mutate(new)
            try:
                result = old
                if {k: v for k, v in new.items() if k != "status"} != {k: v for k, v in old.items() if k != "status"}:
                    result = self._raw(self._core.replace_node, name, new)
                if new.get("status") != old.get("status"):
                    result["status"] = new.get("status")
                    result = self._raw(self._core.replace_node_status, name, result)
                return result
            except ApiException as exc:
                if exc.status != 409:
                    raise
        raise AssertionError(f"could not update node {name}: conflicts every time")

    def delete_node(self, name: str) -> None:
        self._core.delete_node(name)

    def events(self) -> list[dict]:
        reply = self._raw(self._events.list_namespaced_event, "default")
        return [e for e in reply["items"] if (e.get("regarding") or {}).get("name", "").startswith(self.prefix)]

    def restart_apiserver(self) -> None:
        from tests.support.envtest import wait_until_serving

        self.plane.restart_apiserver()
        wait_until_serving(self.plane)

    def close(self) -> None:
        for name in self._created:
            try:
                self._core.delete_node(name)
            except Exception:  # noqa: BLE001 - already gone, or the server is going away
                pass
        self._free_budget_slots()
        self._delete_counter_bindings()

    def _delete_counter_bindings(self) -> None:
        """The counter's ClusterRoleBindings are cluster-wide: one per namespace it counted into."""
        from kubernetes import client

        for binding in self._bindings:
            try:
                client.RbacAuthorizationV1Api(self._admin).delete_cluster_role_binding(binding)
            except Exception:  # noqa: BLE001 - already gone, or the server is going away
                pass

    def _free_budget_slots(self) -> None:
        """Delete the budget slots its nodes still hold in the shared namespace: every test's
        clock starts at the same instant, so to the next test's agent they would look a moment
        old, which the budget never reclaims (``effects/budget.py``)."""
        from kubernetes import client

        leases = client.CoordinationV1Api(self._admin)
        try:
            held = leases.list_namespaced_lease(self.budget_namespace, label_selector="healthagent.io/budget=slot")
            for lease in held.items:
                if (lease.spec.holder_identity or "") in self._created:
                    leases.delete_namespaced_lease(lease.metadata.name, self.budget_namespace)
        except Exception:  # noqa: BLE001 - the server is going away; nothing to keep apart then
            pass

    @staticmethod
    def _raw(fn: Callable, *args: Any) -> dict:
        return json.loads(fn(*args, _preload_content=False).data)


def ensure_namespace(core: Any, name: str) -> None:
    """Create namespace ``name`` unless it exists (with no controller-manager it is never
    deleted, so a session shares it)."""
    from kubernetes.client.exceptions import ApiException

    try:
        core.create_namespace({"metadata": {"name": name}})
    except ApiException as exc:
        if exc.status != 409:
            raise


class LabelChurn:
    """Another controller writing the node's labels ``rate`` times a second (strategic-merge
    PATCH, each a new value), on its own thread and its own client, until ``stop()``. Bounded by
    ``max_seconds`` so it stops by itself."""

    def __init__(self, cluster: Cluster, name: str, rate: float = 100.0, max_seconds: float = 120.0) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(cluster.api_client())
        self._name = name
        self._interval = 1.0 / rate
        self._max_seconds = max_seconds
        self._stop = threading.Event()
        self.writes = 0
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="label-churn", daemon=True)

    def __enter__(self) -> "LabelChurn":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        start = time.monotonic()
        next_at = start
        while not self._stop.is_set() and time.monotonic() - start < self._max_seconds:
            try:
                self._core.patch_node(self._name, {"metadata": {"labels": {"churn.example.com/seq": str(self.writes)}}},
                                      _content_type="application/strategic-merge-patch+json")
                self.writes += 1
            except Exception as exc:  # noqa: BLE001 - recorded; the test reads them
                self.errors.append(repr(exc))
            next_at += self._interval
            delay = next_at - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
