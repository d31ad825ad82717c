"""The budget's calls to the API server: its Leases, one holder's node, the GPU node count.

The budget (``effects/budget.py``) lives in ``coordination.k8s.io/v1`` Leases in the agent's own
namespace, labelled ``healthagent.io/budget``. The calls here are all it needs, and their cost does
not grow with the cluster except for the count, which the fleet shares:

  list      the budget's Leases (slots and the count: a dozen small objects at a limit of 10),
            from the API server's watch cache (``resourceVersion=0``); after a lost race, a
            consistent list, because the cache may not show the winner yet
  create    a slot taken for the first time (fails with AlreadyExists when another agent made it)
  update    take, re-write or give back a slot, with the ``resourceVersion`` read: 409 when it
            changed meanwhile
  get       one Lease after a 409; one holder's node before reclaiming its slot
  watch     the budget's Leases, only while this node is held (``effects/budget_watch.py``): a
            slot freed wakes it at once; from the watch cache (``resourceVersion=0``)
  count     ``LIST nodes`` as a server-side Table without the objects (``includeObject=None``):
            a row of a few hundred bytes a node, not the ~10 kB Node; one agent of the fleet,
            at most every ten minutes
  at least  one page of that Table, as many rows as a limit needs (``limit=``): an agent's own
            check of the shared count before it takes a slot past the smallest limit

Errors are classified as for the node (``effects/backend.py``): ``Conflict``, ``AlreadyExists``,
``ApiUnavailable``, ``ApiRejected``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from healthagent.effects.backend import WATCH_READ_SLACK_SECONDS, ApiBackend, ApiRejected, ApiUnavailable, WatchStream
from healthagent.effects.budget import BUDGET_LABEL

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_NAMESPACE = "healthagent"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


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

    def count_nodes(self, label_selector: str) -> int:
        """How many nodes match ``label_selector``: the rows of a server-side Table, served from
        the watch cache, without the objects."""
        rows, _ = self._node_table(label_selector, [("resourceVersion", "0")])
        return rows

    def nodes_at_least(self, label_selector: str, wanted: int) -> tuple[int, bool]:
        """Are there at least ``wanted`` nodes matching ``label_selector``? One page of at most
        ``wanted`` rows, so the answer costs what the question needs, not the fleet: (rows,
        ``True`` when that is every matching node, the exact count). A paged list is a
        consistent read (the watch cache would ignore ``limit`` at ``resourceVersion=0``)."""
        return self._node_table(label_selector, [("limit", str(max(1, wanted)))])

    def _node_table(self, label_selector: str, params: list[tuple[str, str]]) -> tuple[int, bool]:
        """(rows, complete) of a server-side Table of the matching nodes without their objects.
        The typed client has no ``includeObject``, so the request is built with the client's own
        serializer."""
        api = self.core.api_client

        def list_node_table(_preload_content: bool = False, _request_timeout: Any = None) -> Any:
            # deferred: the kubernetes client (about 0.3 s to load) loads only when the agent talks to a cluster
            from kubernetes.client.exceptions import ApiException

            method, url, headers, _, _ = api.param_serialize(
                method="GET", resource_path="/api/v1/nodes",
                query_params=[("labelSelector", label_selector), *params, ("includeObject", "None")],
                header_params={"Accept": TABLE}, auth_settings=["BearerToken"])
            response = api.call_api(method, url, header_params=headers, _request_timeout=_request_timeout)
            if not 200 <= response.status <= 299:
                response.read()
                raise ApiException.from_response(http_resp=response, body=None, data=None)
            return response.response

        reply = self._backend._call(list_node_table)
        rows = reply.get("rows") if isinstance(reply, dict) and reply.get("kind") == "Table" else None
        if not isinstance(rows, list):
            raise ApiUnavailable("the node table reply has no rows")
        meta = reply.get("metadata")
        more = isinstance(meta, dict) and bool(meta.get("continue"))
        return len(rows), not more
