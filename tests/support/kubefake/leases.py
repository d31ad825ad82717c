"""coordination.k8s.io/v1 Leases: put by other actors, and served (create, get, list, watch,
replace, delete)."""

from __future__ import annotations

import copy
import uuid

from tests.support.kubefake.errors import ApiError, _invalid, _not_found
from tests.support.kubefake.selectors import parse_label_selector
from tests.support.kubefake.validation import _validate_lease, now_rfc3339


class LeasesMixin:
    """``KubeFake``'s Leases."""

    def leases(self, namespace: str | None = None) -> list[dict]:
        """The Leases (all, or one namespace's), sorted by namespace and name."""
        with self._lock:
            return [copy.deepcopy(lease) for (ns, _), lease in sorted(self._leases.items())
                    if namespace is None or ns == namespace]

    def put_lease(self, namespace: str, lease: dict) -> dict:
        """Create or replace a Lease as another actor would (a peer agent, an operator)."""
        with self._lock:
            lease = copy.deepcopy(lease)
            meta = lease.setdefault("metadata", {})
            old = self._leases.get((namespace, meta["name"]))
            meta.update({"namespace": namespace, "resourceVersion": self._bump(),
                         "uid": (old or {}).get("metadata", {}).get("uid") or str(uuid.uuid4()),
                         "creationTimestamp": (old or {}).get("metadata", {}).get("creationTimestamp")
                         or now_rfc3339()})
            lease.setdefault("apiVersion", "coordination.k8s.io/v1")
            lease.setdefault("kind", "Lease")
            self._leases[(namespace, meta["name"])] = lease
            self._notify(f"leases/{namespace}", "MODIFIED" if old else "ADDED", lease, old)
            return copy.deepcopy(lease)

    def _lease_request(self, method, ns, name, query, body):
        with self._lock:
            if name is None:
                if method == "GET":
                    if query.get("watch") in ("true", "1"):
                        return 200, self._open_watch(f"leases/{ns}", query, {},
                                                     [lease for (lns, _), lease in self._leases.items() if lns == ns])
                    labels = parse_label_selector(query.get("labelSelector", ""))
                    items = [lease for lease in self.leases(ns)
                             if labels(lease["metadata"].get("labels") or {})]
                    return 200, {"kind": "LeaseList", "apiVersion": "coordination.k8s.io/v1",
                                 "metadata": {"resourceVersion": str(self._rv)}, "items": items}
                if method != "POST":
                    raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on the lease list")
                return self._create_lease(ns, body)
            current = self._leases.get((ns, name))
            if current is None:
                raise _not_found("leases", name, "coordination.k8s.io")
            if method == "GET":
                return 200, copy.deepcopy(current)
            if method == "DELETE":
                del self._leases[(ns, name)]
                self._notify(f"leases/{ns}", "DELETED", {**current, "metadata": {
                    **current["metadata"], "resourceVersion": self._bump()}}, None)
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
            if method != "PUT":
                raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on leases by the fake")
            if not isinstance(body, dict) or (body.get("metadata") or {}).get("name") != name:
                raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
            self._check_rv(body, current, "leases.coordination.k8s.io", name)
            causes = _validate_lease(body)
            if causes:
                raise _invalid("Lease", name, causes)
            new = copy.deepcopy(body)
            for fixed in ("uid", "creationTimestamp", "namespace"):
                new["metadata"][fixed] = current["metadata"][fixed]
            new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            new.setdefault("apiVersion", "coordination.k8s.io/v1")
            new.setdefault("kind", "Lease")
            if new != current:
                new["metadata"]["resourceVersion"] = self._bump()
                self._leases[(ns, name)] = new
                self._notify(f"leases/{ns}", "MODIFIED", new, current)
            return 200, copy.deepcopy(self._leases[(ns, name)])

    def _create_lease(self, ns, body):
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "lease body must be an object")
        lease = copy.deepcopy(body)
        meta = lease.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise _invalid("Lease", "", ["metadata.name: Required value"])
        if meta.get("resourceVersion"):
            raise _invalid("Lease", name, ["metadata.resourceVersion: Invalid value: must be empty on create"])
        status, created = self._store_new(self._leases, ns, name, lease, _validate_lease(lease), "Lease",
                                          "coordination.k8s.io")
        self._notify(f"leases/{ns}", "ADDED", created, None)
        return status, created
