"""Nodes: seeding and changing them as other actors would, and serving ``/api/v1/nodes`` (lists
from the live state or the watch cache, the main resource and its status subresource)."""

from __future__ import annotations

import copy
import uuid
from typing import Callable

from tests.support.kubefake.errors import ApiError, _invalid, _not_found
from tests.support.kubefake.patches import NODE_MERGE_KEYS, apply_patch
from tests.support.kubefake.selectors import NODE_FIELDS, parse_field_selector, parse_label_selector
from tests.support.kubefake.validation import _validate_node, now_rfc3339


class NodesMixin:
    """``KubeFake``'s nodes."""

    def add_node(self, name: str, labels: dict | None = None, taints: list | None = None,
                 conditions: list | None = None, annotations: dict | None = None) -> dict:
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": now_rfc3339(),
                         "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                         "annotations": dict(annotations or {})},
            "spec": {"taints": list(taints)} if taints else {},
            "status": {"conditions": list(conditions or [
                {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "kubelet is posting ready status",
                 "lastHeartbeatTime": now_rfc3339(), "lastTransitionTime": now_rfc3339()}])},
        }
        with self._lock:
            node["metadata"]["resourceVersion"] = self._bump()
            self._nodes[name] = node
            self._notify("nodes", "ADDED", node, None)
            return copy.deepcopy(node)

    def seed_nodes(self, count: int, prefix: str = "gpu-node-", labels: dict | None = None) -> list[str]:
        """Add ``count`` GPU nodes (labelled ``nvidia.com/gpu.present=true`` unless told otherwise)."""
        labels = {"nvidia.com/gpu.present": "true"} if labels is None else labels
        names = [f"{prefix}{i}" for i in range(count)]
        for name in names:
            self.add_node(name, labels=labels)
        return names

    def node(self, name: str) -> dict:
        with self._lock:
            return copy.deepcopy(self._nodes[name])

    def nodes(self) -> list[dict]:
        with self._lock:
            return [copy.deepcopy(n) for n in self._nodes.values()]

    def update_node(self, name: str, mutate: Callable[[dict], None]) -> dict:
        """Change a node as another actor would (kubelet, an operator): bumps resourceVersion."""
        with self._lock:
            old = self._nodes[name]
            new = copy.deepcopy(old)
            mutate(new)
            new["metadata"]["resourceVersion"] = self._bump()
            self._nodes[name] = new
            self._notify("nodes", "MODIFIED", new, old)
            return copy.deepcopy(new)

    def delete_node(self, name: str) -> None:
        with self._lock:
            old = self._nodes.pop(name)
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = self._bump()
            self._notify("nodes", "DELETED", gone, None)

    def _list_nodes(self, query):
        labels = parse_label_selector(query.get("labelSelector", ""))
        fields = parse_field_selector(query.get("fieldSelector", ""), NODE_FIELDS)
        with self._lock:
            version, nodes = self._list_source(query.get("resourceVersion", ""),
                                               query.get("resourceVersionMatch", ""))
            items = [copy.deepcopy(n) for _, n in sorted(nodes.items())
                     if labels(n["metadata"].get("labels") or {}) and fields(n)]
            meta = {"resourceVersion": str(version)}
            limit = query.get("limit", "")
            if limit.isdigit() and 0 < int(limit) < len(items):  # the first page, as the real server pages
                items = items[:int(limit)]
                meta["continue"] = f"fake-continue-{version}-{limit}"
            return {"kind": "NodeList", "apiVersion": "v1", "metadata": meta, "items": items}

    def _list_source(self, since: str, match: str) -> tuple[int, dict[str, dict]]:
        """(version, nodes) a list with this resourceVersion/resourceVersionMatch is served from."""
        if match and not since:
            raise ApiError(422, "Invalid", "ListOptions.meta.k8s.io \"\" is invalid: resourceVersionMatch: "
                                           "Forbidden: resourceVersionMatch is forbidden unless resourceVersion "
                                           "is provided")
        if match not in ("", "NotOlderThan"):
            raise ApiError(400, "BadRequest", f"resourceVersionMatch={match!r} is not served by the fake")
        if since and not since.isdigit():
            raise ApiError(400, "BadRequest", f"invalid resource version {since!r}")
        if not since:
            return self._rv, self._nodes  # a quorum read from etcd
        wanted = int(since)
        if wanted > self._rv:
            raise ApiError(504, "Timeout", f"Too large resource version: {wanted}, current: {self._rv}")
        if self._cache is not None and wanted <= self._cache[0]:
            return self._cache
        return self._rv, self._nodes  # the cache is (or caught up to) the live state

    def _node_request(self, method, name, status_sub, content_type, body):
        with self._lock:
            current = self._nodes.get(name)
            if method == "GET":
                if current is None:
                    raise _not_found("nodes", name)
                return 200, copy.deepcopy(current)
            if method == "DELETE":
                if current is None:
                    raise _not_found("nodes", name)
                self.delete_node(name)
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success",
                             "details": {"name": name, "kind": "nodes"}}
            if current is None:
                raise _not_found("nodes", name)
            if method == "PATCH":
                new = apply_patch(current, content_type, body, NODE_MERGE_KEYS)
                self._check_rv(new, current, "nodes", name)
            elif method == "PUT":
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "PUT body must be a Node object")
                new = copy.deepcopy(body)
                self._check_rv(new, current, "nodes", name)
            else:
                raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on nodes")
            if (new.get("metadata") or {}).get("name") != name:
                given = (new.get("metadata") or {}).get("name")
                raise ApiError(400, "BadRequest", f"the name of the object ({given}) does not match the "
                               f"name on the URL ({name})")
            new = self._subresource_view(new, current, status_sub)
            causes = _validate_node(new)
            if causes:
                raise _invalid("Node", name, causes)
            return 200, self._store_node(name, new, current)

    @staticmethod
    def _subresource_view(new: dict, current: dict, status_sub: bool) -> dict:
        """Main resource writes ignore status; status writes ignore spec and metadata changes."""
        new = copy.deepcopy(new)
        if status_sub:
            new["spec"] = copy.deepcopy(current.get("spec") or {})
            new["metadata"] = copy.deepcopy(current["metadata"])
        else:
            new["status"] = copy.deepcopy(current.get("status") or {})
            meta = new.setdefault("metadata", {})
            for fixed in ("uid", "creationTimestamp"):
                meta[fixed] = current["metadata"][fixed]
        new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        new.setdefault("apiVersion", "v1")
        new.setdefault("kind", "Node")
        return new

    def _store_node(self, name: str, new: dict, current: dict) -> dict:
        if new == current:
            return copy.deepcopy(current)  # a no-op write changes nothing, not even resourceVersion
        new["metadata"]["resourceVersion"] = self._bump()
        self._nodes[name] = new
        self._notify("nodes", "MODIFIED", new, current)
        return copy.deepcopy(new)
