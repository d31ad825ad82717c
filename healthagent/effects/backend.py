"""How the effects reach the node: the API server through the ``kubernetes`` client, or a log.

Both backends speak raw JSON dicts (the node as the API server returns it), so a field this client
version does not model is never lost, and the effects code is the same for both. Errors are
classified once, here: ``Conflict`` (409 on a stale resourceVersion: re-read and retry),
``AlreadyExists`` (409 on create: the Event is already there), ``ApiUnavailable`` (connection
refused, timeout, 5xx, 429, a reply that is not JSON: keep the desired state, retry later) and
``ApiRejected`` (any other 4xx: a bug or missing RBAC; counted and logged).
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
DEFAULT_REQUEST_TIMEOUT = (3.05, 10.0)  # (connect, read) seconds for every API call


class ApiError(Exception):
    """Base of the classified API errors; ``str()`` is one log-ready line."""


class Conflict(ApiError):
    pass


class AlreadyExists(ApiError):
    pass


class ApiUnavailable(ApiError):
    pass


class ApiRejected(ApiError):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"status={status} reason={reason} message={message}")
        self.status = status
        self.reason = reason


class ApiBackend:
    """The real API server, through the official client's typed calls.

    Every call passes ``_request_timeout`` and ``_preload_content=False`` (the reply is parsed as
    plain JSON, not into models that drop unknown fields). PATCH calls name the strategic-merge
    content type explicitly: version 37 of the client otherwise sends ``json-patch+json`` for a
    dict body, which the API server rejects.
    """

    def __init__(self, api_client: Any, node_name: str,
                 request_timeout: tuple[float, float] = DEFAULT_REQUEST_TIMEOUT) -> None:
        from kubernetes import client

        self.node_name = node_name
        self.timeout = request_timeout
        self.core = client.CoreV1Api(api_client)
        self.events = client.EventsV1Api(api_client)

    def read_node(self) -> dict:
        return self._call(self.core.read_node, self.node_name)

    def patch_node(self, patch: dict) -> dict:
        return self._call(self.core.patch_node, self.node_name, patch, _content_type=STRATEGIC_MERGE)

    def patch_node_status(self, patch: dict) -> dict:
        return self._call(self.core.patch_node_status, self.node_name, patch, _content_type=STRATEGIC_MERGE)

    def list_nodes(self, label_selector: str) -> list[dict]:
        reply = self._call(self.core.list_node, label_selector=label_selector)
        items = reply.get("items") if isinstance(reply, dict) else None
        if not isinstance(items, list):
            raise ApiUnavailable("node list reply has no items")
        return [i for i in items if isinstance(i, dict)]

    def create_event(self, namespace: str, body: dict) -> None:
        self._call(self.events.create_namespaced_event, namespace, body)

    def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            response = fn(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
        except ApiException as exc:
            raise classify_api_exception(exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiUnavailable(f"{type(exc).__name__}: {exc}") from None
        try:
            data = response.data
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiUnavailable(f"reading the reply: {type(exc).__name__}: {exc}") from None
        finally:
            release = getattr(response, "release_conn", None)
            if release:
                release()
        try:
            return json.loads(data)
        except (ValueError, TypeError):
            raise ApiUnavailable("the reply is not JSON") from None


def classify_api_exception(exc: Any) -> ApiError:
    """Map a client ``ApiException`` to the error kinds the effects act on."""
    status = int(getattr(exc, "status", 0) or 0)
    reason, message = str(getattr(exc, "reason", "") or ""), ""
    try:
        body = json.loads(getattr(exc, "body", "") or "")
        if isinstance(body, dict):
            reason = str(body.get("reason") or reason)
            message = str(body.get("message") or "")
    except (ValueError, TypeError):
        pass
    if status == 409:
        if reason == "AlreadyExists":
            return AlreadyExists(message or "already exists")
        return Conflict(message or "conflict")
    if status == 0 or status == 429 or status >= 500:
        return ApiUnavailable(f"status={status} reason={reason} {message}".strip())
    return ApiRejected(status, reason, message)


class DryRunBackend:
    """``--kube dry-run``: no network. Writes become one log line each and change a node kept in
    memory (and in the state file), so the next reconcile sees what was "applied" and a steady
    state logs nothing."""

    def __init__(self, node_name: str, node: dict | None = None) -> None:
        self.node_name = node_name
        self.node = copy.deepcopy(node) if isinstance(node, dict) else {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node_name, "uid": "", "resourceVersion": "0", "labels": {}, "annotations": {}},
            "spec": {}, "status": {"conditions": []},
        }

    def read_node(self) -> dict:
        return copy.deepcopy(self.node)

    def patch_node(self, patch: dict) -> dict:
        meta = patch.get("metadata") or {}
        for field in ("labels", "annotations"):
            target = self.node["metadata"].setdefault(field, {})
            for key, value in (meta.get(field) or {}).items():
                log.info("dry_run=1 write=%s node=%s key=%s value=%s", field[:-1], self.node_name, key,
                         "<removed>" if value is None else value)
                if value is None:
                    target.pop(key, None)
                else:
                    target[key] = value
        if "taints" in (patch.get("spec") or {}):
            self._log_taints(self.node["spec"].get("taints") or [], patch["spec"]["taints"])
            self.node["spec"]["taints"] = copy.deepcopy(patch["spec"]["taints"])
        self._bump()
        return self.read_node()

    def _log_taints(self, before: list, after: list) -> None:
        was = {(t.get("key"), t.get("value"), t.get("effect")) for t in before}
        now = {(t.get("key"), t.get("value"), t.get("effect")) for t in after}
        for key, value, effect in sorted(now - was, key=str):
            log.info("dry_run=1 write=taint node=%s key=%s value=%s effect=%s", self.node_name, key, value, effect)
        for key, value, effect in sorted(was - now, key=str):
            log.info("dry_run=1 write=untaint node=%s key=%s value=%s effect=%s", self.node_name, key, value,
                     effect)

    def patch_node_status(self, patch: dict) -> dict:
        conditions = self.node.setdefault("status", {}).setdefault("conditions", [])
        for cond in (patch.get("status") or {}).get("conditions") or []:
            log.info("dry_run=1 write=condition node=%s type=%s status=%s reason=%s message=%r",
                     self.node_name, cond["type"], cond["status"], cond["reason"], cond["message"])
            conditions[:] = [c for c in conditions if c.get("type") != cond["type"]] + [copy.deepcopy(cond)]
        self._bump()
        return self.read_node()

    def list_nodes(self, label_selector: str) -> list[dict]:
        log.info("dry_run=1 budget=unchecked selector=%s (no cluster view in dry-run)", label_selector)
        return []

    def create_event(self, namespace: str, body: dict) -> None:
        log.info("dry_run=1 event type=%s reason=%s action=%s node=%s note=%r", body["type"], body["reason"],
                 body["action"], self.node_name, body["note"])

    def _bump(self) -> None:
        meta = self.node["metadata"]
        meta["resourceVersion"] = str(int(meta.get("resourceVersion") or 0) + 1)
