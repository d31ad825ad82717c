"""The budget's calls to the API server: its Leases and one holder's node.

The budget (``effects/budget.py``) lives in ``coordination.k8s.io/v1`` Leases in the agent's own
namespace, labelled ``healthagent.io/budget``. The calls here are all an agent needs, and their cost
does not grow with the cluster (the GPU node count is the budget counter's, ``budget_counter.py``):

  list      the budget's Leases (slots and the count: a dozen small objects at a limit of 10),
            from the API server's watch cache (``resourceVersion=0``); after a lost race, a
            consistent list, because the cache may not show the winner yet
  create    a slot taken for the first time (fails with AlreadyExists when another agent made it)
  update    take, re-write or give back a slot, with the ``resourceVersion`` read: 409 when it
            changed meanwhile
  get       one Lease after a 409; one holder's node before reclaiming its slot
  watch     the budget's Leases, only while this node is held (``effects/budget_watch.py``): a
            slot freed wakes it at once; from the watch cache (``resourceVersion=0``)

Errors are classified as for the node (``effects/backend.py``): ``Conflict``, ``AlreadyExists``,
``ApiUnavailable``, ``ApiRejected``.
"""

from __future__ import annotations

from pathlib import Path

from healthagent.effects.backend import WATCH_READ_SLACK_SECONDS, ApiBackend, ApiRejected, ApiUnavailable, WatchStream
from healthagent.effects.budget import BUDGET_LABEL

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_NAMESPACE = "healthagent"


def agent_namespace(configured: str, account_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """Where the budget's Leases live: ``budget_namespace`` when set, else the namespace of the
    pod's service account (so a renamed namespace needs no setting), else ``healthagent``."""
    if configured:
        return configured
    try:
        text = account_file.read_text(encoding="utf-8").strip()
    except OSError:
        return DEFAULT_NAMESPACE
    return text or DEFAULT_NAMESPACE


class LeaseStore:
    """The budget's Leases in ``namespace``, through ``backend``'s client and error handling."""

    def __init__(self, backend: ApiBackend, namespace: str) -> None:
        # deferred: the kubernetes client (about 0.3 s to load) loads only when the agent talks to a cluster
        from kubernetes import client

        self._backend = backend
        self.namespace = namespace
        self.core = backend.core
        self.leases = client.CoordinationV1Api(backend.core.api_client)

    def list(self, consistent: bool = False, selector: str = BUDGET_LABEL) -> list[dict]:
        """The budget's Leases (``selector``: a scoped budget's): from the watch cache, or
        (``consistent``) as the API server has them."""
        versions = {} if consistent else {"resource_version": "0"}
        reply = self._backend._call(self.leases.list_namespaced_lease, self.namespace,
                                    label_selector=selector, **versions)
        items = reply.get("items") if isinstance(reply, dict) else None
        if not isinstance(items, list):
            raise ApiUnavailable("lease list reply has no items")
        return [i for i in items if isinstance(i, dict)]

    def watch(self, selector: str, timeout_seconds: int) -> WatchStream:
        """Open a watch on the budget's Leases (``selector``) from the watch cache's current state:
        each Lease first as ADDED, then every change, until the server ends it after
        ``timeout_seconds``."""
        backend = self._backend
        response = backend._send(self.leases.list_namespaced_lease, self.namespace, label_selector=selector,
                                 watch=True, resource_version="0", timeout_seconds=timeout_seconds,
                                 _request_timeout=(backend.timeout[0], timeout_seconds + WATCH_READ_SLACK_SECONDS))
        return WatchStream(response)

    def read(self, name: str) -> dict:
        return self._backend._call(self.leases.read_namespaced_lease, name, self.namespace)

    def create(self, body: dict) -> dict:
        return self._backend._call(self.leases.create_namespaced_lease, self.namespace, body)

    def replace(self, body: dict) -> dict:
        """PUT ``body``; its ``metadata.resourceVersion`` is the precondition (409 when stale)."""
        return self._backend._call(self.leases.replace_namespaced_lease, body["metadata"]["name"],
                                   self.namespace, body)

    def node(self, name: str) -> dict | None:
        """Another node, to judge its slot; None when it does not exist."""
        try:
            return self._backend._call(self.core.read_node, name)
        except ApiRejected as exc:
            if exc.status == 404:
                return None
            raise
