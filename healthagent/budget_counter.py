"""The budget counter: the one writer of the disruption budget's GPU node counts.

The budget's limit is a share of the GPU nodes (``effects/budget.py``). Counting them is O(fleet):
a Table row of a few hundred bytes per node. Done by every agent on every decision it made a mass
failure cost the API server gigabytes exactly when the fleet was in trouble; and a count that any
node may write is a count any node's token may inflate. So one small Deployment counts, with a
service account no node holds (``healthagent-budget-counter``), and the admission policy
``healthagent-budget-count`` refuses a count write by anyone else. The agents only read the count
(in the list of the budget's Leases they make anyway) and never count.

It reads the agents' settings from the agents' own environment variables
(``HEALTHAGENT_BUDGET_NODE_SELECTOR``, ``HEALTHAGENT_BUDGET_SCOPE_LABEL``,
``HEALTHAGENT_BUDGET_NAMESPACE``), so one value set for both keeps them counting the same nodes.

One round, every ``--interval`` seconds: a paged server-side Table of the selected nodes (no
objects; with ``--scope-label``, each row's metadata, to group the nodes by the label's value),
then one write per count that changed, or that is older than half ``COUNT_MAX_AGE_SECONDS`` (so a
person sees the counter is alive). A round that fails is logged and the next one tries again; the
agents keep the last count meanwhile, so the counter being down never blocks a taint, it only
leaves the limit where it was.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Iterable, Iterator, Mapping

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from healthagent.effects.api_time import parse_rfc3339
from healthagent.effects.backend import AlreadyExists, ApiBackend, ApiError, ApiUnavailable, Conflict
from healthagent.effects.budget import (
    BUDGET_LABEL,
    COUNT_MAX_AGE_SECONDS,
    GPU_NODES_ANNOTATION,
    SELECTOR_ANNOTATION,
    Scope,
    counted,
    new_lease,
)
from healthagent.effects.budget_leases import LeaseStore, agent_namespace

log = logging.getLogger(__name__)

COUNTER_ACCOUNT = "healthagent-budget-counter"
DEFAULT_SELECTOR = "nvidia.com/gpu.present=true"
DEFAULT_INTERVAL_SECONDS = 60.0
PAGE_ROWS = 500  # rows per page of the node Table: a bounded reply however large the fleet
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


def counts_by_scope(node_labels: Iterable[Mapping[str, str]], scope_label: str) -> dict[Scope, int]:
    """How many selected nodes each budget counts: the fleet's (no ``scope_label``), or one per
    value of ``scope_label`` ("" for the nodes without it). Pure."""
    counts: dict[Scope, int] = {}
    if not scope_label:
        counts[Scope()] = sum(1 for _ in node_labels)
        return counts
    for labels in node_labels:
        scope = Scope(scope_label, str(labels.get(scope_label) or ""))
        counts[scope] = counts.get(scope, 0) + 1
    return counts


def count_writes(leases: Iterable[Mapping], counts: Mapping[Scope, int], selector: str, namespace: str,
                 now: float) -> list[dict]:
    """The count Leases to write (pure): each scope whose count, selector or age is not as it
    should be (a Lease without a ``resourceVersion`` is a create), and 0 for an existing count
    whose scope has no node left (its Lease stays, so agents there read the truth). Each count
    records the selector it counted (``Scope.node_selector``): an agent whose settings differ
    reads it as no count."""
    existing = {str((lease.get("metadata") or {}).get("name") or ""): lease for lease in leases}
    wanted: dict[str, tuple[Mapping, int, str]] = {}
    for scope, nodes in counts.items():
        base = existing.get(scope.count_name) or new_lease(scope.count_name, namespace, "count", scope)
        wanted[scope.count_name] = (base, nodes, scope.node_selector(selector))
    for name, lease in existing.items():
        annotations = (lease.get("metadata") or {}).get("annotations") or {}
        if name not in wanted and name.startswith("healthagent-budget-") and name.endswith("count"):
            wanted[name] = (lease, 0, str(annotations.get(SELECTOR_ANNOTATION) or selector))
    writes = []
    for name in sorted(wanted):
        base, nodes, counted_selector = wanted[name]
        annotations = (base.get("metadata") or {}).get("annotations") or {}
        renewed = parse_rfc3339((base.get("spec") or {}).get("renewTime"))
        fresh = renewed is not None and 0 <= now - renewed < COUNT_MAX_AGE_SECONDS / 2
        if annotations.get(GPU_NODES_ANNOTATION) == str(nodes) and \
                annotations.get(SELECTOR_ANNOTATION) == counted_selector and fresh:
            continue
        body = counted(base, nodes, counted_selector, now)
        body["spec"]["holderIdentity"] = COUNTER_ACCOUNT
        writes.append(body)
    return writes


class BudgetCounter:
    """Counts the selected GPU nodes and records the counts, through ``backend``'s client."""

    def __init__(self, backend: ApiBackend, namespace: str, selector: str, scope_label: str = "") -> None:
        self._backend = backend
        self.store = LeaseStore(backend, namespace)
        self.selector = selector
        self.scope_label = scope_label

    def node_labels(self) -> Iterator[Mapping[str, str]]:
        """The labels of every selected node (empty mappings without ``scope_label``: only the
        rows count), one page of ``PAGE_ROWS`` at a time."""
        include = "Metadata" if self.scope_label else "None"
        token = ""
        while True:
            params = [("labelSelector", self.selector), ("limit", str(PAGE_ROWS)), ("includeObject", include)]
            if token:
                params.append(("continue", token))
            reply = self._backend._call(self._table_call(params))
            rows = reply.get("rows") if isinstance(reply, dict) and reply.get("kind") == "Table" else None
            if not isinstance(rows, list):
                raise ApiUnavailable("the node table reply has no rows")
            for row in rows:
                meta = (row.get("object") or {}).get("metadata") if isinstance(row, dict) else None
                labels = meta.get("labels") if isinstance(meta, dict) else None
                yield labels if isinstance(labels, dict) else {}
            meta = reply.get("metadata")
            token = str(meta.get("continue") or "") if isinstance(meta, dict) else ""
            if not token:
                return

    def _table_call(self, params: list[tuple[str, str]]) -> Any:
        """A GET of the node Table: the typed client has no ``includeObject``, so the request is
        built with the client's own serializer."""
        api = self.store.core.api_client

        def list_node_table(_preload_content: bool = False, _request_timeout: Any = None) -> Any:
            method, url, headers, _, _ = api.param_serialize(
                method="GET", resource_path="/api/v1/nodes", query_params=params,
                header_params={"Accept": TABLE}, auth_settings=["BearerToken"])
            response = api.call_api(method, url, header_params=headers, _request_timeout=_request_timeout)
            if not 200 <= response.status <= 299:
                response.read()
                raise ApiException.from_response(http_resp=response, body=None, data=None)
            return response.response

        return list_node_table

    def round(self, now: float) -> dict[Scope, int]:
        """One count and its writes; a write that loses a race (another counter replica, a
        hand edit) is left to the next round."""
        counts = counts_by_scope(self.node_labels(), self.scope_label)
        leases = self.store.list(True, f"{BUDGET_LABEL}=count")
        for body in count_writes(leases, counts, self.selector, self.store.namespace, now):
            try:
                self.store.create(body) if "resourceVersion" not in body["metadata"] else self.store.replace(body)
            except (Conflict, AlreadyExists):
                continue
            log.info("budget-counter count=%s gpu_nodes=%s selector=%s", body["metadata"]["name"],
                     body["metadata"]["annotations"][GPU_NODES_ANNOTATION], self.selector)
        return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="healthagent-budget-counter", description=__doc__.split("\n")[0])
    env = os.environ.get
    parser.add_argument("--namespace", default=env("HEALTHAGENT_BUDGET_NAMESPACE", ""),
                        help="the budget's namespace (default: the pod's own)")
    parser.add_argument("--node-selector", default=env("HEALTHAGENT_BUDGET_NODE_SELECTOR", DEFAULT_SELECTOR),
                        help="the GPU nodes counted: the agents' budget_node_selector")
    parser.add_argument("--scope-label", default=env("HEALTHAGENT_BUDGET_SCOPE_LABEL", ""),
                        help="the agents' budget_scope_label (one count per value)")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_SECONDS, help="seconds between counts")
    parser.add_argument("--kubeconfig", default="", help="outside a cluster: the kubeconfig to use")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.interval < 1:
        print("interval: must be at least 1 second; fix --interval", file=sys.stderr)
        return 3
    configuration = client.Configuration()
    if args.kubeconfig:
        config.load_kube_config(config_file=args.kubeconfig, client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    counter = BudgetCounter(ApiBackend(client.ApiClient(configuration), ""), agent_namespace(args.namespace),
                            args.node_selector, args.scope_label)
    while True:
        try:
            counter.round(time.time())
        except ApiError as exc:
            log.warning("budget-counter round failed (%s); the agents keep the last count", exc)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
