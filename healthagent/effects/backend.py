"""How the effects reach the node: the API server through the ``kubernetes`` client, or a log.

Both backends speak raw JSON dicts (the node as the API server returns it), so a field this client
version does not model is never lost, and the effects code is the same for both. Errors are
classified once, here: ``Conflict`` (409 on a stale resourceVersion: re-read and retry),
``AlreadyExists`` (409 on create: the Event is already there), ``ApiUnavailable`` (connection
refused, timeout, 5xx, 429, a reply that is not JSON: keep the desired state, retry later),
``Expired`` (410 Gone: a watch's resourceVersion left the server's window; list again) and
``ApiRejected`` (any other 4xx: a bug or missing RBAC; counted and logged).

Writes to the node carry preconditions on exactly what they depend on, not on the whole object:
``patch_node`` sends a JSON patch (RFC 6902) whose ``test`` operations pin the node's uid and the
values it replaces (the taint list as read, an owned label before it is removed). A foreign
writer that changes another label, an annotation or the kubelet's status 100 times a second never
conflicts with the agent; one that changes the taints does, and the write is planned again. The
``/status`` patch carries no precondition at all: conditions merge by ``type`` on the server and
the agent writes only its own (as node-problem-detector does).

The client's own retries are switched off (``without_client_retries``): a retry inside urllib3
bypasses the agent's backoff and its once-a-minute log limit and prints a WARNING per attempt.
The agent's retry policy (``effects/kube.py``) is the only one.

The watch on the agent's own node (``effects/node_watch.py``) goes through the same typed call as
the list, ``list_node(watch=True)``, and reads the open response line by line here
(``WatchStream``), so its errors are classified the same way.
"""

from __future__ import annotations

import copy
import json
import logging
import random
from typing import Any, Callable, Iterator

import urllib3

from healthagent.model import API_CONDITION_KINDS

log = logging.getLogger(__name__)

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
DEFAULT_REQUEST_TIMEOUT = (3.05, 10.0)  # (connect, read) seconds for every API call
# The server-side deadline of a node write (the ``timeout`` query parameter, which kube-apiserver
# honours on every non-watch request): a write queued or slowed past it fails (504) instead of
# landing late. The disruptive write follows a confirm that re-wrote the node's budget slot, and no
# judge finds a slot stale before SLOT_GRACE_SECONDS (45 s) after its last change: 10 s leaves the
# rest for the judges' looks and clocks, so the step lands while its slot is its own or not at all.
NODE_WRITE_DEADLINE_SECONDS = 10
# Any other node write (a NoSchedule, a taint's removal, labels) may land late without harm: it
# waits longer (API Priority and Fairness queues a request for a quarter of its deadline before it
# answers 429), and the agent waits for its answer as long. In a burst of faults the cordon queues
# at the API server instead of being refused and sent again.
HOLD_WRITE_DEADLINE_SECONDS = 30
# A watch is quiet until the node changes: its read timeout is the server-side timeoutSeconds
# plus this slack, so only a stream the server should already have ended counts as hung.
WATCH_READ_SLACK_SECONDS = 30.0


class ApiError(Exception):
    """Base of the classified API errors; ``str()`` is one log-ready line."""


class Conflict(ApiError):
    """409 on a stale resourceVersion, or a JSON patch whose ``test`` no longer holds; ``node``
    is the node as re-read to find that out (None when the caller must read it)."""

    def __init__(self, message: str, node: dict | None = None) -> None:
        super().__init__(message)
        self.node = node


class AlreadyExists(ApiError):
    pass


class ApiUnavailable(ApiError):
    """``retry_after``: the seconds of the server's ``Retry-After`` (a 429 from API Priority and
    Fairness), 0 when it named none."""

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ApiRejected(ApiError):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"status={status} reason={reason} message={message}")
        self.status = status
        self.reason = reason


class Expired(ApiRejected):
    """410 Gone: the resourceVersion a watch resumes from is older than the server keeps."""


def split_api_conditions(counts: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(internal errors, API conditions) of one error tally, by kind."""
    internal = {k: v for k, v in counts.items() if k not in API_CONDITION_KINDS}
    api = {k: v for k, v in counts.items() if k in API_CONDITION_KINDS}
    return internal, api


def jittered_backoff(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d], d = min(cap, base * 2**attempt).

    The jitter keeps a fleet of agents that failed together (an API server restart) from
    retrying together."""
    delay = min(cap, base * (2 ** max(0, attempt)))
    return rng.uniform(delay / 2, delay)


class ApiBackend:
    """The real API server, through the official client's typed calls.

    Every call passes ``_request_timeout`` and ``_preload_content=False`` (the reply is parsed as
    plain JSON, not into models that drop unknown fields). PATCH calls name the strategic-merge
    content type explicitly: version 37 of the client otherwise sends ``json-patch+json`` for a
    dict body, which the API server rejects.
    """

    def __init__(self, api_client: Any, node_name: str,
                 request_timeout: tuple[float, float] = DEFAULT_REQUEST_TIMEOUT) -> None:
        # deferred: the kubernetes client (about 0.3 s to load) loads only when the agent talks to a cluster
        from kubernetes import client

        without_client_retries(api_client)
        self.node_name = node_name
        self.timeout = request_timeout
        self.core = client.CoreV1Api(api_client)
        self.events = client.EventsV1Api(api_client)

    def read_node(self) -> dict:
        return self._call(self.core.read_node, self.node_name)

    def patch_node(self, patch: dict, basis: dict, disruptive: bool = True) -> dict:
        """Apply ``patch`` (labels/annotations/taints, as ``node_patch`` plans it against ``basis``,
        the node as read) with preconditions on what it replaces, within
        ``NODE_WRITE_DEADLINE_SECONDS`` when it is a ``disruptive`` step (else
        ``HOLD_WRITE_DEADLINE_SECONDS``). The API server answers a
        failed ``test`` with the same 422 as any invalid patch, so a 422 re-reads the node: if a
        tested value moved, it is a ``Conflict`` (carrying the fresh node); if not, the server
        really refuses the patch (``ApiRejected``)."""
        ops = json_patch_ops(basis, patch)
        try:
            return self._patch_within_deadline(dict(method="PATCH", resource_path="/api/v1/nodes/{name}"),
                                               JSON_PATCH, ops, disruptive)
        except ApiRejected as exc:
            if exc.status != 422:
                raise
            fresh = self.read_node()
            moved = [op["path"] for op in ops if op["op"] == "test" and pointer_get(fresh, op["path"]) != op["value"]]
            if moved:
                raise Conflict(f"changed since read: {', '.join(moved)}", node=fresh) from None
            raise

    def _patch_within_deadline(self, request: dict, content_type: str, body: Any, disruptive: bool) -> dict:
        """The ``request`` (method and path: the node or its ``/status``) with ``timeout=<deadline>s``
        in the query (the typed calls have no parameter for it), built and sent by the client's own
        serializer; the client waits for the answer as long as the server may still apply it."""
        deadline = NODE_WRITE_DEADLINE_SECONDS if disruptive else HOLD_WRITE_DEADLINE_SECONDS
        api = self.core.api_client

        def send(_preload_content: bool = False, _request_timeout: Any = None) -> Any:
            # deferred: the kubernetes client (about 0.3 s to load) loads only when the agent talks to a cluster
            from kubernetes.client.exceptions import ApiException

            method, url, headers, payload, _ = api.param_serialize(
                **request, path_params={"name": self.node_name}, query_params=[("timeout", f"{deadline}s")],
                header_params={"Content-Type": content_type, "Accept": "application/json"}, body=body,
                auth_settings=["BearerToken"])
            response = api.call_api(method, url, header_params=headers, body=payload, _request_timeout=_request_timeout)
            if not 200 <= response.status <= 299:
                response.read()
                raise ApiException.from_response(http_resp=response, body=None, data=None)
            return response.response

        return self._call(send, _request_timeout=(self.timeout[0], max(self.timeout[1], deadline)))

    def patch_node_status(self, patch: dict, disruptive: bool = True) -> dict:
        """The conditions, merged by type on the server (no precondition), within the same
        deadline as a node write: a gated condition's ``False`` is a disruptive step too."""
        return self._patch_within_deadline(dict(method="PATCH", resource_path="/api/v1/nodes/{name}/status"),
                                           STRATEGIC_MERGE, patch, disruptive)

    def list_nodes(self, label_selector: str, not_older_than: str = "") -> list[dict]:
        """The nodes matching ``label_selector``, from the API server's watch cache, never a quorum
        read from etcd (the budget's counts; see ``effects/budget.py``): ``resourceVersion=0``
        (any cached state), or with ``not_older_than`` a list at least as new as that version
        (``resourceVersionMatch=NotOlderThan``; the server waits briefly for its cache, then 504)."""
        if not_older_than:
            versions = dict(resource_version=not_older_than, resource_version_match="NotOlderThan")
        else:
            versions = dict(resource_version="0")
        return _items(self._call(self.core.list_node, label_selector=label_selector, **versions))[0]

    def list_own_node(self) -> tuple[dict | None, str]:
        """The node through a LIST by name: (the node or None, the list's resourceVersion).

        A watch starts from the LIST's version, not the object's: the object's may be older than
        the server's watch window (a node nobody changed for a while) and would only earn a 410."""
        items, version = _items(self._call(self.core.list_node, field_selector=self.field_selector))
        if not version:
            raise ApiUnavailable("node list reply has no resourceVersion")
        node = next((i for i in items if (i.get("metadata") or {}).get("name") == self.node_name), None)
        return node, version

    def watch_own_node(self, resource_version: str, timeout_seconds: int) -> "WatchStream":
        """Open a watch on the agent's node from ``resource_version``; the server ends it after
        ``timeout_seconds``. Bookmarks are asked for: they move the resume version forward while
        the node itself does not change, so a resume after a quiet hour is not a 410."""
        response = self._send(self.core.list_node, field_selector=self.field_selector, watch=True,
                              resource_version=resource_version, allow_watch_bookmarks=True,
                              timeout_seconds=timeout_seconds,
                              _request_timeout=(self.timeout[0], timeout_seconds + WATCH_READ_SLACK_SECONDS))
        return WatchStream(response)

    @property
    def field_selector(self) -> str:
        return f"metadata.name={self.node_name}"

    def create_event(self, namespace: str, body: dict) -> None:
        self._call(self.events.create_namespaced_event, namespace, body)

    def _send(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Call a typed client method for its raw response; errors classified."""
        # deferred: the kubernetes client (about 0.3 s to load) loads only when the agent talks to a cluster
        from kubernetes.client.exceptions import ApiException

        kwargs.setdefault("_request_timeout", self.timeout)
        try:
            return fn(*args, _preload_content=False, **kwargs)
        except ApiException as exc:
            raise classify_api_exception(exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiUnavailable(f"{type(exc).__name__}: {exc}") from None

    def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        response = self._send(fn, *args, **kwargs)
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


def without_client_retries(api_client: Any) -> None:
    """Switch off urllib3's retries in ``api_client`` (the client's default is three per call,
    each logged as a WARNING): a failed call fails at once and the agent's backoff decides."""
    # deferred: the kubernetes client (about 0.3 s to load) loads only when the agent talks to a cluster
    from kubernetes.client import rest

    configuration = api_client.configuration
    if configuration.retries is False:
        return
    configuration.retries = False
    api_client.rest_client = rest.RESTClientObject(configuration)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def pointer_get(doc: Any, path: str) -> Any:
    """The value at a JSON pointer, None where any part is missing (what a ``test`` for null
    passes on, as the API server's JSON patch does)."""
    node = doc
    for part in path.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def json_patch_ops(basis: dict, patch: dict) -> list[dict]:
    """The JSON patch for a planned node change, with a ``test`` before everything it replaces.

    ``patch`` has the strategic-merge shape ``node_patch`` plans (``metadata.labels``/
    ``annotations`` with None for a removal, ``spec.taints`` as the whole new list). The uid is
    always tested (a Node deleted and re-created between read and write is not the node planned
    for); a label or annotation removed is tested for the value read (removing one that is
    already gone would fail the patch); the taint list is replaced whole after a test that it is
    the list read (the agent keeps every foreign taint in place, so one added meanwhile must not
    be lost). Setting a label or annotation needs no test: the keys are the agent's own."""
    meta = basis.get("metadata") or {}
    ops: list[dict] = []
    if meta.get("uid"):
        ops.append({"op": "test", "path": "/metadata/uid", "value": meta["uid"]})
    for field in ("labels", "annotations"):
        changes = (patch.get("metadata") or {}).get(field) or {}
        if not changes:
            continue
        current = meta.get(field)
        if not isinstance(current, dict):
            ops.append({"op": "test", "path": f"/metadata/{field}", "value": None})
            ops.append({"op": "add", "path": f"/metadata/{field}",
                        "value": {k: v for k, v in changes.items() if v is not None}})
            continue
        for key, value in sorted(changes.items()):
            path = f"/metadata/{field}/{_escape(key)}"
            if value is not None:
                ops.append({"op": "add", "path": path, "value": value})
            elif key in current:
                ops.append({"op": "test", "path": path, "value": current[key]})
                ops.append({"op": "remove", "path": path})
    if "taints" in (patch.get("spec") or {}):
        if not isinstance(basis.get("spec"), dict):
            ops.append({"op": "test", "path": "/spec", "value": None})
            ops.append({"op": "add", "path": "/spec", "value": {"taints": patch["spec"]["taints"]}})
        else:
            ops.append({"op": "test", "path": "/spec/taints", "value": basis["spec"].get("taints")})
            ops.append({"op": "add", "path": "/spec/taints", "value": patch["spec"]["taints"]})
    return ops


def _items(reply: Any) -> tuple[list[dict], str]:
    """A list reply's items (Node objects only) and its resourceVersion."""
    items = reply.get("items") if isinstance(reply, dict) else None
    if not isinstance(items, list):
        raise ApiUnavailable("node list reply has no items")
    version = str(((reply.get("metadata") or {}).get("resourceVersion")) or "")
    return [i for i in items if isinstance(i, dict)], version


class WatchStream:
    """An open watch response: ``lines()`` yields its lines (one JSON event each).

    ``interrupt()`` may be called from any thread: it shuts the socket down so a read blocked on
    a quiet stream returns (how the watch thread is stopped). ``close()`` is for the reading
    thread: it closes the response and gives the connection back to the pool."""

    def __init__(self, response: Any) -> None:
        self._response = response

    def lines(self) -> Iterator[str]:
        """The stream's lines until the server ends it cleanly; a cut or a hung stream raises
        ``ApiUnavailable``."""
        # deferred: the kubernetes client (about 0.3 s to load) loads only when the agent talks to a cluster
        from kubernetes.watch.watch import iter_resp_lines

        try:
            yield from iter_resp_lines(self._response)
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            raise ApiUnavailable(f"watch stream: {type(exc).__name__}: {exc}") from None

    def interrupt(self) -> None:
        self._end("shutdown")  # urllib3 >= 2.3; an older one leaves the read to its timeout

    def close(self) -> None:
        self._end("close", "release_conn")

    def _end(self, *methods: str) -> None:
        for name in methods:
            method = getattr(self._response, name, None)
            if method is None:
                continue
            try:
                method()
            except Exception:  # noqa: BLE001 - ending a broken socket may fail in any way; it is ended
                log.debug("watch stream %s failed", name, exc_info=True)


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
    return classify_status(status, reason, message, retry_after_seconds(getattr(exc, "headers", None)))


def retry_after_seconds(headers: Any) -> float:
    """A reply's ``Retry-After`` in seconds (the API server sends whole seconds); 0 when absent or
    not a number (an HTTP date is not what the API server sends)."""
    try:
        value = headers.get("Retry-After") if headers is not None else None
        return max(0.0, min(float(value), 600.0)) if value is not None else 0.0
    except (AttributeError, TypeError, ValueError):
        return 0.0


def classify_status(status: int, reason: str, message: str, retry_after: float = 0.0) -> ApiError:
    """The error kind for an API ``Status`` (an error reply, or a watch's ERROR event);
    ``retry_after``: the reply's ``Retry-After`` in seconds, kept on a 429 or 5xx."""
    if status == 410:
        return Expired(status, reason or "Expired", message)
    if status == 409:
        if reason == "AlreadyExists":
            return AlreadyExists(message or "already exists")
        return Conflict(message or "conflict")
    if status == 0 or status == 429 or status >= 500:
        return ApiUnavailable(f"status={status} reason={reason} {message}".strip(), retry_after)
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

    def patch_node(self, patch: dict, basis: dict | None = None, disruptive: bool = True) -> dict:
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

    def patch_node_status(self, patch: dict, disruptive: bool = True) -> dict:
        conditions = self.node.setdefault("status", {}).setdefault("conditions", [])
        for cond in (patch.get("status") or {}).get("conditions") or []:
            log.info("dry_run=1 write=condition node=%s type=%s status=%s reason=%s message=%r",
                     self.node_name, cond["type"], cond["status"], cond["reason"], cond["message"])
            conditions[:] = [c for c in conditions if c.get("type") != cond["type"]] + [copy.deepcopy(cond)]
        self._bump()
        return self.read_node()

    def list_nodes(self, label_selector: str, not_older_than: str = "") -> list[dict]:
        log.info("dry_run=1 budget=unchecked selector=%s (no cluster view in dry-run)", label_selector)
        return []

    def create_event(self, namespace: str, body: dict) -> None:
        log.info("dry_run=1 event type=%s reason=%s action=%s node=%s note=%r", body["type"], body["reason"],
                 body["action"], self.node_name, body["note"])

    def _bump(self) -> None:
        meta = self.node["metadata"]
        meta["resourceVersion"] = str(int(meta.get("resourceVersion") or 0) + 1)
