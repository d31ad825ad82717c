"""A FAKE Kubernetes API server for tests: nodes and ``events.k8s.io/v1`` Events over real HTTP.

No kube-apiserver can run on the test machines, so the agent's Kubernetes code is tested with the
REAL ``kubernetes`` Python client talking HTTP to this server (``ThreadingHTTPServer`` on
127.0.0.1, port 0). It honours the protocol for what the agent uses:

- ``GET``/``PATCH``/``PUT``/``DELETE`` ``/api/v1/nodes/{name}`` and ``/api/v1/nodes/{name}/status``
  (the main resource ignores status changes, the status subresource ignores spec and metadata,
  as the real registry strategies do);
- PATCH content types ``application/strategic-merge-patch+json`` (Node schema: ``spec.taints`` is
  an atomic list and is replaced whole; ``status.conditions`` and ``status.addresses`` merge by
  ``type``; ``$patch: delete|replace`` and ``$deleteFromPrimitiveList`` directives),
  ``application/merge-patch+json`` (RFC 7386) and ``application/json-patch+json`` (RFC 6902);
  server-side apply answers 415;
- ``resourceVersion``: one cluster-wide counter bumped on every change, never on a no-op write;
  a PATCH whose patched object carries another ``metadata.resourceVersion``, or a PUT with a stale
  one, gets ``409 Conflict`` with a proper ``Status`` object;
- ``LIST /api/v1/nodes`` with ``labelSelector`` (``=``, ``==``, ``!=``, exists, ``!key``, ``in``,
  ``notin``) and ``fieldSelector`` (``metadata.name``, ``spec.unschedulable``), and the list's
  ``resourceVersion`` semantics: unset is a quorum read (the live state); ``0`` is "any", served
  from the watch cache; ``N`` (alone or with ``resourceVersionMatch=NotOlderThan``) is "not older
  than N", served from the watch cache once it has caught up to N, ``504`` "Too large resource
  version" for a version the server has not reached; ``resourceVersionMatch`` without a
  ``resourceVersion`` is ``422 Invalid``. The watch cache is the live state unless
  ``hold_watch_cache()`` makes it lag behind (see the switches);
- ``watch=true`` streaming (chunked, one JSON event per line, ADDED/MODIFIED/DELETED with the
  selector transitions the real server makes): from ``resourceVersion`` ""/"0" it starts with an
  ADDED per object, from any other version it replays what happened after it; a version older
  than the kept history (``watch_history`` events, or ``compact()``, as etcd compaction does) gets
  an ``ERROR`` event with a 410 ``Expired`` Status inside a 200 stream, as the API server's watch
  cache answers it; ``timeoutSeconds`` ends the stream cleanly (final chunk);
  ``allowWatchBookmarks=true`` adds ``BOOKMARK`` events (an object with only
  ``metadata.resourceVersion``, the newest version) every ``bookmark_interval`` seconds and on
  ``send_bookmarks()``;
- ``POST``/``GET``/``PATCH``/``DELETE`` ``/apis/events.k8s.io/v1/namespaces/{ns}/events[/{name}]``
  with the events.k8s.io/v1 create validation (eventTime, reportingController, reportingInstance,
  action, reason, type Normal|Warning, note <= 1 kB) and ``409 AlreadyExists``;
- ``coordination.k8s.io/v1`` Leases: ``POST``/``GET`` (one, or a list with ``labelSelector``)/
  ``PUT``/``DELETE`` ``/apis/coordination.k8s.io/v1/namespaces/{ns}/leases[/{name}]``, with
  ``409 AlreadyExists`` on create, ``409 Conflict`` for a PUT naming another ``resourceVersion``,
  and the MicroTime format of ``acquireTime``/``renewTime`` checked (``422 Invalid``);
- the node list as a server-side Table (``Accept: application/json;as=Table;v=v1;g=meta.k8s.io``):
  one row per node with the cells kubectl shows (name, status, roles, age, version), the object
  omitted with ``includeObject=None``, else its metadata;
- validation the agent could trip: taint effects, duplicate taints, label keys and values,
  condition types (``422 Invalid``); ``404 NotFound`` Status for unknown objects and paths.

Fault switches: ``go_down()``/``come_up()`` (the port really refuses connections and open
keep-alive connections are cut), ``set_delay(seconds)`` (every answer is late), ``fail_next(n,
status=500)`` (the next n requests, watches included, get that status with a matching reason:
410 ``Expired``, 403 ``Forbidden``, ...), ``conflict_next_writes(n)`` (the next n writes get
409), ``drop_watches()`` (open watch streams are cut mid-stream, no final chunk),
``compact()`` (forget the watch history: resuming from any older version is a 410),
``hold_watch_cache()``/``release_watch_cache()`` (the watch cache stops at the current state, as
one lagging behind etcd does: cache-served lists answer from it, except a NotOlderThan list for a
newer version, which the real server answers once its cache caught up),
``send_raw_watch_line(text)`` (a line that is not an event, into every open stream). Every request
is recorded (``requests()``, ``writes()``, ``watches()``) so tests can count what the client did;
``open_watches()`` says how many streams are being served.

Use::

    with KubeFake() as fake:
        fake.seed_nodes(20)                          # gpu-node-0 .. gpu-node-19
        api = kubernetes.client.CoreV1Api(fake.api_client())
        ...                                          # the code under test
        fake.conflict_next_writes(3); fake.go_down(); fake.come_up()
        assert len(fake.writes("/api/v1/nodes/gpu-node-0")) == 2
        assert fake.node("gpu-node-0")["spec"]["taints"] == [...]

What it LEAVES OUT of Kubernetes: authentication, authorization (RBAC) and admission; every
resource but nodes, events.k8s.io/v1 events and leases (no core/v1 events, no discovery); lease
watches, PATCH and a held watch cache for leases (their lists are always live); protobuf, CBOR,
YAML, and tables of anything but nodes; server-side apply and managedFields; pagination
beyond a node list's first page (``limit`` cuts it and sets a ``continue`` token, which is not
served); ``resourceVersionMatch=Exact`` (400) and the up-to-3 s
wait before a "too large resource version" 504; ``dryRun``; ``generation``; finalizers and graceful deletion;
``$setElementOrder`` and ``$retainKeys`` (accepted, ignored); most field validation beyond the list
above; Event TTL expiry; HTTP/2. Of watches: ``sendInitialEvents``/``resourceVersionMatch``
(streaming lists), the "too large resource version" wait, watch-cache progress notifications
and the initial-events-end bookmark annotation; a watch's history is one list for all kinds.
"""

from __future__ import annotations

import copy
import json
import re
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

NODE_MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("status", "volumesAttached"): "name",
    ("metadata", "ownerReferences"): "uid",
}
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
EVENT_TYPES = ("Normal", "Warning")
WATCH_HISTORY = 1000
FAIL_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 410: "Expired",
                429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}

_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_PREFIX_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def qualified_name_problem(key: str) -> str | None:
    """Kubernetes' IsQualifiedName: ``[prefix/]name``, prefix a DNS subdomain <= 253."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and not prefix:
        return f"{key!r}: prefix part must be non-empty"
    if prefix and (len(prefix) > 253 or not _PREFIX_RE.match(prefix)):
        return f"{key!r}: prefix part must be a lowercase DNS subdomain"
    if not name or len(name) > 63 or not _NAME_RE.match(name):
        return f"{key!r}: name part must be 63 characters or less, alphanumeric, '-', '_' or '.'"
    return None


def label_value_problem(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"{value!r}: a label value must be a string"
    if len(value) > 63 or not _VALUE_RE.match(value):
        return f"{value!r}: a valid label must be 63 characters or less, alphanumeric, '-', '_' or '.'"
    return None


class ApiError(Exception):
    """An error the fake answers with a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def _not_found(kind: str, name: str, group: str = "") -> ApiError:
    resource = f"{kind}.{group}" if group else kind
    return ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": kind})


def _conflict(kind: str, name: str, group: str = "") -> ApiError:
    resource = f"{kind}.{group}" if group else kind
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": the object '
                    "has been modified; please apply your changes to the latest version and try again",
                    {"name": name, "kind": kind})


def _invalid(kind: str, name: str, causes: list[str]) -> ApiError:
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: ' + "; ".join(causes),
                    {"name": name, "kind": kind,
                     "causes": [{"reason": "FieldValueInvalid", "message": c} for c in causes]})


# -- patches ---------------------------------------------------------------------------------------


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, null deletes, everything else (lists included) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = json_merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, merge_keys: dict[tuple[str, ...], str],
                          path: tuple[str, ...] = ()) -> Any:
    """Kubernetes strategic merge for the schema given by ``merge_keys`` (path -> merge key).

    Lists not named in ``merge_keys`` are atomic and replaced whole (as ``spec.taints`` is).
    Returns None for a map carrying ``$patch: delete``.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive is not None:
        raise ApiError(422, "Invalid", f"unknown $patch directive {directive!r}")
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key == "$retainKeys":
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [x for x in result.get(field) or [] if x not in (value or [])]
            continue
        if value is None:
            result.pop(key, None)
            continue
        sub = path + (key,)
        if isinstance(value, list) and sub in merge_keys:
            result[key] = _merge_list(result.get(key) or [], value, merge_keys[sub], sub, merge_keys)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value, merge_keys, sub)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(current: list, items: list, key: str, path: tuple[str, ...],
                merge_keys: dict[tuple[str, ...], str]) -> list:
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in items):
        return [copy.deepcopy(i) for i in items if not (isinstance(i, dict) and "$patch" in i)]
    result = copy.deepcopy(current)
    for item in items:
        if not isinstance(item, dict) or key not in item:
            raise ApiError(422, "Invalid", f"map in list {'.'.join(path)} lacks merge key {key!r}")
        index = next((n for n, have in enumerate(result)
                      if isinstance(have, dict) and have.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
            continue
        if index is None:
            result.append(strategic_merge_patch({}, item, merge_keys, path))
        else:
            result[index] = strategic_merge_patch(result[index], item, merge_keys, path)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"json patch path {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str]) -> Any:
    node = doc
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise ApiError(422, "Invalid", f"json patch: path element {part!r} does not exist")
    return node


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 (add, remove, replace, move, copy, test)."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "json patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        try:
            doc = _json_patch_op(doc, op)
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, "Invalid", f"json patch operation {op!r} failed: {exc!r}") from None
    return doc


def _get(doc: Any, parts: list[str]) -> Any:
    node = doc
    for part in parts:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _json_patch_op(doc: Any, op: dict) -> Any:
    kind, parts = op["op"], _pointer(op["path"])
    if kind == "test":
        # as the API server's JSON patch: a missing member tests equal to null (its parent must
        # exist), and a failed test is the same generic 422 as any invalid patch
        try:
            value = _get(doc, parts)
        except (KeyError, IndexError):
            _parent(doc, parts)
            value = None
        if value != op["value"]:
            raise ApiError(422, "Invalid", "the server rejected our request due to an error in our request")
        return doc
    if kind in ("move", "copy"):
        value = copy.deepcopy(_get(doc, _pointer(op["from"])))
        if kind == "move":
            doc = _json_patch_op(doc, {"op": "remove", "path": op["from"]})
        return _json_patch_op(doc, {"op": "add", "path": op["path"], "value": value})
    if not parts:
        if kind == "remove":
            raise ValueError("cannot remove the whole document")
        return copy.deepcopy(op["value"])
    parent, last = _parent(doc, parts), parts[-1]
    if kind == "add":
        if isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
        else:
            parent[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    elif kind == "replace":
        if isinstance(parent, list):
            parent[int(last)] = copy.deepcopy(op["value"])
        else:
            if last not in parent:
                raise KeyError(last)
            parent[last] = copy.deepcopy(op["value"])
    else:
        raise ValueError(f"unknown op {kind!r}")
    return doc


def apply_patch(current: dict, content_type: str, patch: Any, merge_keys: dict) -> dict:
    if content_type == "application/strategic-merge-patch+json":
        if not isinstance(patch, dict):
            raise ApiError(400, "BadRequest", "strategic merge patch must be a JSON object")
        return strategic_merge_patch(current, patch, merge_keys)
    if content_type == "application/merge-patch+json":
        if not isinstance(patch, dict):
            raise ApiError(400, "BadRequest", "merge patch must be a JSON object")
        return json_merge_patch(current, patch)
    if content_type == "application/json-patch+json":
        return json_patch(current, patch)
    raise ApiError(415, "UnsupportedMediaType",
                   f"the body of the request was in an unknown format ({content_type}); this fake "
                   "supports strategic-merge, merge and json patches")


# -- selectors -------------------------------------------------------------------------------------

_REQ_RE = re.compile(
    r"^\s*(?:(?P<notexists>!)\s*(?P<nkey>[^\s!=,()]+)"
    r"|(?P<skey>[^\s!=,()]+)\s*(?P<setop>in|notin)\s*\((?P<values>[^)]*)\)"
    r"|(?P<key>[^\s!=,()]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[^\s,()=!]*))?)\s*$"
)


def _split_requirements(selector: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    return parts


def parse_label_selector(selector: str) -> Callable[[dict], bool]:
    """A predicate over a labels map; raises ApiError 400 for a selector the server would reject."""
    checks: list[Callable[[dict], bool]] = []
    for raw in _split_requirements(selector or ""):
        m = _REQ_RE.match(raw)
        if not m:
            raise ApiError(400, "BadRequest", f"unable to parse requirement {raw!r} in labelSelector")
        if m.group("notexists"):
            key = m.group("nkey")
            checks.append(lambda labels, k=key: k not in labels)
        elif m.group("setop"):
            key, values = m.group("skey"), {v.strip() for v in m.group("values").split(",") if v.strip()}
            if m.group("setop") == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif m.group("op"):
            key, op, value = m.group("key"), m.group("op"), m.group("value")
            if op == "!=":
                checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                checks.append(lambda labels, k=key, v=value: k in labels and labels[k] == v)
        else:
            key = m.group("key")
            checks.append(lambda labels, k=key: k in labels)
    return lambda labels: all(check(labels or {}) for check in checks)


NODE_FIELDS: dict[str, Callable[[dict], str]] = {
    "metadata.name": lambda o: o["metadata"]["name"],
    "spec.unschedulable": lambda o: "true" if o.get("spec", {}).get("unschedulable") else "false",
}


def parse_field_selector(selector: str, fields: dict[str, Callable[[dict], str]]) -> Callable[[dict], bool]:
    checks: list[Callable[[dict], bool]] = []
    for raw in _split_requirements(selector or ""):
        m = re.match(r"^\s*([^!=\s]+)\s*(==|=|!=)\s*([^\s]*)\s*$", raw)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector {raw!r}")
        field, op, value = m.groups()
        if field not in fields:
            raise ApiError(400, "BadRequest", f'"{field}" is not a known field selector: only '
                           + ", ".join(f'"{f}"' for f in fields))
        getter = fields[field]
        if op == "!=":
            checks.append(lambda o, g=getter, v=value: g(o) != v)
        else:
            checks.append(lambda o, g=getter, v=value: g(o) == v)
    return lambda obj: all(check(obj) for check in checks)


# -- the store -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the fake saw it (``status`` is what it answered; 0 = cut off)."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any
    status: int
    at: float

    @property
    def is_write(self) -> bool:
        return self.method in ("POST", "PUT", "PATCH", "DELETE")


@dataclass
class _Watcher:
    kind: str
    matches: Callable[[dict], bool]
    events: list  # event dicts, or str: a raw line (``send_raw_watch_line``)
    cond: threading.Condition
    dropped: bool = False
    bookmarks: bool = False


def _validate_node(node: dict) -> list[str]:
    causes = []
    meta = node.get("metadata") or {}
    for key, value in (meta.get("labels") or {}).items():
        problem = qualified_name_problem(key) or label_value_problem(value)
        if problem:
            causes.append(f"metadata.labels: Invalid value: {problem}")
    for key, value in (meta.get("annotations") or {}).items():
        if qualified_name_problem(key):
            causes.append(f"metadata.annotations: Invalid value: {qualified_name_problem(key)}")
        if not isinstance(value, str):
            causes.append(f"metadata.annotations[{key}]: must be a string")
    seen = set()
    for n, taint in enumerate((node.get("spec") or {}).get("taints") or []):
        where = f"spec.taints[{n}]"
        if not isinstance(taint, dict) or not taint.get("key"):
            causes.append(f"{where}.key: Required value")
            continue
        problem = qualified_name_problem(taint["key"])
        if problem:
            causes.append(f"{where}.key: Invalid value: {problem}")
        if taint.get("value") and label_value_problem(taint["value"]):
            causes.append(f"{where}.value: Invalid value: {label_value_problem(taint['value'])}")
        if taint.get("effect") not in TAINT_EFFECTS:
            causes.append(f"{where}.effect: Unsupported value: {taint.get('effect')!r}: supported "
                          "values: " + ", ".join(TAINT_EFFECTS))
        pair = (taint["key"], taint.get("effect"))
        if pair in seen:
            causes.append(f"{where}: Duplicate value: taints must be unique by key and effect pair")
        seen.add(pair)
    types = set()
    for n, cond in enumerate((node.get("status") or {}).get("conditions") or []):
        if not isinstance(cond, dict) or not cond.get("type"):
            causes.append(f"status.conditions[{n}].type: Required value")
            continue
        if cond["type"] in types:
            causes.append(f"status.conditions[{n}].type: Duplicate value: {cond['type']!r}")
        types.add(cond["type"])
        if cond.get("status") not in ("True", "False", "Unknown"):
            causes.append(f"status.conditions[{n}].status: Unsupported value: {cond.get('status')!r}")
    return causes


_MICRO_TIME_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)$")


def _validate_event(event: dict) -> list[str]:
    """events.k8s.io/v1 create validation; ``eventTime`` must parse as MicroTime (RFC3339 with
    exactly six fraction digits), as Go's ``time.Parse(RFC3339Micro)`` in the API server demands."""
    causes = []
    if event.get("eventTime") and not _MICRO_TIME_RE.match(str(event["eventTime"])):
        raise ApiError(400, "BadRequest", f"eventTime {event['eventTime']!r}: cannot parse as "
                       "RFC3339Micro (2006-01-02T15:04:05.000000Z07:00)")
    for field in ("eventTime", "reportingController", "reportingInstance", "action", "reason"):
        if not event.get(field):
            causes.append(f"{field}: Required value")
    if event.get("reportingController") and qualified_name_problem(event["reportingController"]):
        problem = qualified_name_problem(event["reportingController"])
        causes.append(f"reportingController: Invalid value: {problem}")
    for field in ("reportingInstance", "action", "reason"):
        if len(event.get(field) or "") > 128:
            causes.append(f"{field}: Too long: must have at most 128 bytes")
    if event.get("type") not in EVENT_TYPES:
        causes.append(f"type: Unsupported value: {event.get('type')!r}: supported values: Normal, Warning")
    if len((event.get("note") or "").encode("utf-8")) > 1024:
        causes.append("note: Too long: must have at most 1024 bytes")
    return causes


class KubeFake:
    """The fake API server. Use as a context manager or ``start()``/``stop()``."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self._lock = threading.RLock()
        self._rv = 100
        self._nodes: dict[str, dict] = {}
        self._events: dict[tuple[str, str], dict] = {}
        self._leases: dict[tuple[str, str], dict] = {}
        self._history: list[tuple[int, str, str, dict, dict | None]] = []  # rv, kind, type, obj, old
        self._history_floor = 0  # a watch from a version older than this is a 410
        self._cache: tuple[int, dict[str, dict]] | None = None  # a held watch cache: (rv, nodes)
        self._watchers: list[_Watcher] = []
        self._log: list[RecordedRequest] = []
        self._fail_next = 0
        self._fail_status = 500
        self._conflict_next = 0
        self._delay = 0.0
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self.down = False
        self.watch_history = WATCH_HISTORY
        self.bookmark_interval: float | None = 60.0  # roughly the real watch cache's cadence

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> "KubeFake":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "KubeFake":
        self._stopping.clear()
        self._listen()
        return self

    def _listen(self) -> None:
        handler = type("Handler", (_Handler,), {"fake": self})
        server = ThreadingHTTPServer((self.host, self.port), handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="kubefake", daemon=True)
        self._thread.start()
        self.down = False

    def _close_listener(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            conns = list(self._conns)
            for watcher in self._watchers:
                with watcher.cond:
                    watcher.dropped = True
                    watcher.cond.notify_all()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        self._stopping.set()
        self._close_listener()
        self.down = True

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def configuration(self):
        from kubernetes import client

        configuration = client.Configuration(host=self.url)
        return configuration

    def api_client(self):
        from kubernetes import client

        return client.ApiClient(self.configuration())

    # -- fault switches ----------------------------------------------------------------------------

    def go_down(self) -> None:
        """Stop listening (connection refused) and cut every open connection."""
        self._close_listener()
        self.down = True

    def come_up(self) -> None:
        """Listen again on the same port."""
        if self.down and not self._stopping.is_set():
            self._listen()

    def set_delay(self, seconds: float) -> None:
        self._delay = seconds

    def fail_next(self, n: int, status: int = 500) -> None:
        """The next ``n`` requests get ``status`` (a Status with the reason the real server gives)."""
        with self._lock:
            self._fail_next, self._fail_status = n, status

    def conflict_next_writes(self, n: int) -> None:
        with self._lock:
            self._conflict_next = n

    def drop_watches(self) -> None:
        with self._lock:
            for watcher in self._watchers:
                with watcher.cond:
                    watcher.dropped = True
                    watcher.cond.notify_all()

    def compact(self) -> None:
        """Forget the watch history, as etcd compaction does: a watch resuming from a version
        older than the current one gets 410 Expired and must list again."""
        with self._lock:
            self._history.clear()
            self._history_floor = self._rv

    def hold_watch_cache(self) -> None:
        """Lists served from the watch cache answer with the nodes as they are now, until
        ``release_watch_cache()``: a cache lagging behind etcd."""
        with self._lock:
            self._cache = (self._rv, copy.deepcopy(self._nodes))

    def release_watch_cache(self) -> None:
        with self._lock:
            self._cache = None

    def send_bookmarks(self) -> None:
        """A BOOKMARK with the newest resourceVersion into every watch that asked for them."""
        with self._lock:
            for watcher in self._watchers:
                if watcher.bookmarks:
                    self._queue(watcher, self._bookmark())

    def send_raw_watch_line(self, text: str) -> None:
        """Write ``text`` as one line into every open watch stream (garbage, for the client)."""
        with self._lock:
            for watcher in self._watchers:
                self._queue(watcher, text)

    @staticmethod
    def _queue(watcher: _Watcher, event: dict | str) -> None:
        with watcher.cond:
            watcher.events.append(event)
            watcher.cond.notify_all()

    def _bookmark(self) -> dict:
        return {"type": "BOOKMARK", "object": {"kind": "Node", "apiVersion": "v1",
                                               "metadata": {"resourceVersion": str(self._rv)}}}

    # -- data for tests ----------------------------------------------------------------------------

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

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
            return copy.deepcopy(lease)

    def events(self, namespace: str | None = None) -> list[dict]:
        with self._lock:
            return [copy.deepcopy(e) for (ns, _), e in sorted(self._events.items())
                    if namespace is None or ns == namespace]

    @property
    def resource_version(self) -> int:
        return self._rv

    # -- request log -------------------------------------------------------------------------------

    def requests(self, method: str | None = None, path: str | None = None) -> list[RecordedRequest]:
        """Recorded requests, optionally of one method and under one path prefix."""
        with self._lock:
            return [r for r in self._log
                    if (method is None or r.method == method) and (path is None or r.path.startswith(path))]

    def writes(self, path: str | None = None) -> list[RecordedRequest]:
        """Recorded POST/PUT/PATCH/DELETE requests (whatever they were answered)."""
        return [r for r in self.requests(path=path) if r.is_write]

    def watches(self, path: str | None = None) -> list[RecordedRequest]:
        """Recorded watch requests (``watch=true``), whatever they were answered."""
        return [r for r in self.requests("GET", path) if r.query.get("watch") in ("true", "1")]

    def open_watches(self) -> int:
        """Watch streams the server is serving now (a client that went away is noticed)."""
        with self._lock:
            return len(self._watchers)

    def reset_log(self) -> None:
        with self._lock:
            self._log.clear()

    def _record(self, req: RecordedRequest) -> None:
        with self._lock:
            self._log.append(req)

    # -- watch plumbing ----------------------------------------------------------------------------

    def _notify(self, kind: str, etype: str, obj: dict, old: dict | None) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self._history.append((rv, kind, etype, copy.deepcopy(obj), copy.deepcopy(old)))
        excess = len(self._history) - self.watch_history
        if excess > 0:
            self._history_floor = self._history[excess - 1][0]
            del self._history[:excess]
        for watcher in self._watchers:
            if watcher.kind != kind:
                continue
            event = _watch_event(etype, obj, old, watcher.matches)
            if event:
                self._queue(watcher, event)

    # -- request handling (called by the handler threads) ------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str], content_type: str,
               body: Any, accept: str = "") -> tuple[int, Any]:
        """Return (status, JSON body) or (200, _Watcher) for a watch. Raises nothing."""
        try:
            with self._lock:
                if self._fail_next > 0:
                    self._fail_next -= 1
                    reason = FAIL_REASONS.get(self._fail_status, "InternalError")
                    raise ApiError(self._fail_status, reason, f"{reason}: injected by the test (fail_next)")
                if method in ("PUT", "PATCH") and self._conflict_next > 0:
                    self._conflict_next -= 1
                    name = path.rstrip("/").split("/")[-1]
                    if name == "status":
                        name = path.rstrip("/").split("/")[-2]
                    kind = next((k for k in ("nodes", "leases") if f"/{k}/" in path), "events")
                    raise _conflict(kind, name)
            return self._route(method, path, query, content_type, body, accept)
        except ApiError as err:
            return err.code, err.status()

    def _route(self, method, path, query, content_type, body, accept=""):
        m = re.fullmatch(r"/api/v1/nodes", path)
        if m and method == "GET":
            if query.get("watch") in ("true", "1"):
                return 200, self._open_watch("nodes", query, NODE_FIELDS)
            nodes = self._list_nodes(query)
            return 200, node_table(nodes, query.get("includeObject", "")) if "as=Table" in accept else nodes
        m = re.fullmatch(r"/apis/coordination\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/leases(?:/(?P<name>[^/]+))?", path)
        if m:
            return self._lease_request(method, m.group("ns"), m.group("name"), query, body)
        m = re.fullmatch(r"/api/v1/nodes/(?P<name>[^/]+)(?P<sub>/status)?", path)
        if m:
            return self._node_request(method, m.group("name"), bool(m.group("sub")), content_type, body)
        m = re.fullmatch(r"/apis/events\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/events(?:/(?P<name>[^/]+))?", path)
        if m:
            return self._event_request(method, m.group("ns"), m.group("name"), content_type, body)
        m = re.fullmatch(r"/apis/events\.k8s\.io/v1/events", path)
        if m and method == "GET":
            return 200, {"kind": "EventList", "apiVersion": "events.k8s.io/v1",
                         "metadata": {"resourceVersion": str(self._rv)}, "items": self.events()}
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

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

    def _open_watch(self, kind, query, fields):
        labels = parse_label_selector(query.get("labelSelector", ""))
        field_match = parse_field_selector(query.get("fieldSelector", ""), fields)

        def matches(obj: dict) -> bool:
            return labels(obj["metadata"].get("labels") or {}) and field_match(obj)

        watcher = _Watcher(kind=kind, matches=matches, events=[], cond=threading.Condition(),
                           bookmarks=query.get("allowWatchBookmarks") in ("true", "1"))
        since = query.get("resourceVersion", "")
        if since not in ("", "0") and not since.isdigit():
            raise ApiError(400, "BadRequest", f"invalid resource version {since!r}")
        with self._lock:
            if since in ("", "0"):
                for node in sorted(self._nodes.values(), key=lambda n: n["metadata"]["name"]):
                    if matches(node):
                        watcher.events.append({"type": "ADDED", "object": copy.deepcopy(node)})
            else:
                start = int(since)
                if start < self._history_floor:
                    gone = ApiError(410, "Expired", f"too old resource version: {start} ({self._history_floor})")
                    watcher.events.append({"type": "ERROR", "object": gone.status()})
                else:
                    for rv, hkind, etype, obj, old in self._history:
                        if rv > start and hkind == kind:
                            event = _watch_event(etype, obj, old, matches)
                            if event:
                                watcher.events.append(event)
            self._watchers.append(watcher)
        return watcher

    def _close_watch(self, watcher: _Watcher) -> None:
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

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
    def _check_rv(new: dict, current: dict, kind: str, name: str) -> None:
        """Optimistic concurrency: a write naming another resourceVersion is a 409. A write naming
        none is unconditional (nodes and events allow that, as the real registry does)."""
        rv = (new.get("metadata") or {}).get("resourceVersion")
        if rv not in (None, "") and rv != current["metadata"]["resourceVersion"]:
            raise _conflict(kind, name)

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

    def _event_request(self, method, ns, name, content_type, body):
        with self._lock:
            if name is None:
                if method == "GET":
                    return 200, {"kind": "EventList", "apiVersion": "events.k8s.io/v1",
                                 "metadata": {"resourceVersion": str(self._rv)}, "items": self.events(ns)}
                if method != "POST":
                    raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on the event list")
                return self._create_event(ns, body)
            key = (ns, name)
            current = self._events.get(key)
            if current is None:
                raise _not_found("events", name, "events.k8s.io")
            if method == "GET":
                return 200, copy.deepcopy(current)
            if method == "DELETE":
                del self._events[key]
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
            if method == "PATCH":
                new = apply_patch(current, content_type, body, {})
            elif method == "PUT":
                new = copy.deepcopy(body)
            else:
                raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on events")
            self._check_rv(new, current, "events", name)
            causes = _validate_event(new)
            if causes:
                raise _invalid("Event", name, causes)
            new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            if new != current:
                new["metadata"]["resourceVersion"] = self._bump()
                self._events[key] = new
            return 200, copy.deepcopy(self._events[key])

    def _lease_request(self, method, ns, name, query, body):
        with self._lock:
            if name is None:
                if method == "GET":
                    if query.get("watch") in ("true", "1"):
                        raise ApiError(405, "MethodNotAllowed", "lease watches are not served by the fake")
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
        return self._store_new(self._leases, ns, name, lease, _validate_lease(lease), "Lease",
                               "coordination.k8s.io")

    def _store_new(self, objects: dict, ns: str, name: str, obj: dict, causes: list[str], kind: str,
                   group: str) -> tuple[int, dict]:
        """Create ``obj`` as ``ns``/``name`` in ``objects``: 422 with ``causes``, 409 AlreadyExists."""
        if causes:
            raise _invalid(kind, name, causes)
        resource = f"{kind.lower()}s"
        if (ns, name) in objects:
            raise ApiError(409, "AlreadyExists", f'{resource}.{group} "{name}" already exists',
                           {"name": name, "group": group, "kind": resource})
        obj["metadata"].update({"name": name, "namespace": ns, "uid": str(uuid.uuid4()),
                                "creationTimestamp": now_rfc3339(), "resourceVersion": self._bump()})
        obj.setdefault("apiVersion", f"{group}/v1")
        obj.setdefault("kind", kind)
        objects[(ns, name)] = obj
        return 201, copy.deepcopy(obj)

    def _create_event(self, ns, body):
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "event body must be an object")
        event = copy.deepcopy(body)
        meta = event.setdefault("metadata", {})
        if meta.get("namespace") not in (None, "", ns):
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not match "
                                              "the namespace sent on the request")
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = meta["generateName"] + uuid.uuid4().hex[:5]
        if not name:
            raise _invalid("Event", "", ["metadata.name: Required value: name or generateName is required"])
        return self._store_new(self._events, ns, name, event, _validate_event(event), "Event", "events.k8s.io")


def _validate_lease(lease: dict) -> list[str]:
    """coordination.k8s.io/v1 Lease validation the agent could trip: MicroTimes, the duration."""
    causes = []
    spec = lease.get("spec") or {}
    for field in ("acquireTime", "renewTime"):
        if spec.get(field) is not None and not _MICRO_TIME_RE.match(str(spec[field])):
            causes.append(f"spec.{field}: Invalid value: {spec[field]!r}: not RFC3339Micro")
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        causes.append("spec.leaseDurationSeconds: Invalid value: must be greater than 0")
    if spec.get("holderIdentity") is not None and not isinstance(spec["holderIdentity"], str):
        causes.append("spec.holderIdentity: Invalid value: must be a string")
    return causes


def node_table(node_list: dict, include_object: str) -> dict:
    """A NodeList as the server-side Table kubectl asks for (the default columns only)."""
    columns = [{"name": name, "type": "string", "format": "name" if name == "Name" else "",
                "description": f"the node's {name.lower()}", "priority": 0}
               for name in ("Name", "Status", "Roles", "Age", "Version")]
    rows = []
    for node in node_list["items"]:
        ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
        row: dict[str, Any] = {"cells": [node["metadata"]["name"],
                                         "Ready" if ready.get("status") == "True" else "NotReady",
                                         "<none>", "1d", ""]}
        if include_object != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": copy.deepcopy(node["metadata"])}
        rows.append(row)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": dict(node_list["metadata"]),
            "columnDefinitions": columns, "rows": rows}


def _watch_event(etype: str, obj: dict, old: dict | None, matches: Callable[[dict], bool]) -> dict | None:
    """The event a selector-filtered watcher sees (the real server's ADDED/DELETED transitions)."""
    now_matches = matches(obj)
    if etype == "MODIFIED" and old is not None:
        was = matches(old)
        if was and now_matches:
            return {"type": "MODIFIED", "object": copy.deepcopy(obj)}
        if was:
            return {"type": "DELETED", "object": copy.deepcopy(obj)}
        if now_matches:
            return {"type": "ADDED", "object": copy.deepcopy(obj)}
        return None
    return {"type": etype, "object": copy.deepcopy(obj)} if now_matches else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms stalls
    fake: KubeFake  # set on the subclass made per server

    def log_message(self, format, *args) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def setup(self) -> None:
        super().setup()
        with self.fake._lock:
            self.fake._conns.add(self.connection)

    def finish(self) -> None:
        with self.fake._lock:
            self.fake._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _serve(self, method: str) -> None:
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body: Any = None
        status, answer = 0, None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                status, answer = 400, ApiError(400, "BadRequest", "request body is not JSON").status()
        if self.fake._delay > 0:
            self.fake._stopping.wait(self.fake._delay)
        if answer is None:
            status, answer = self.fake.handle(method, split.path, query, content_type, body,
                                              self.headers.get("Accept") or "")
        self.fake._record(RecordedRequest(method, split.path, query, content_type, body, status, time.time()))
        try:
            if isinstance(answer, _Watcher):
                self._stream(answer, float(query.get("timeoutSeconds") or 0) or None)
            else:
                self._send_json(status, answer)
        except OSError:
            self.close_connection = True

    def _send_json(self, status: int, answer: Any) -> None:
        data = json.dumps(answer).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, watcher: _Watcher, timeout: float | None) -> None:
        deadline = time.monotonic() + timeout if timeout else None
        last_bookmark = time.monotonic()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while not self.fake._stopping.is_set():
                if self._peer_closed():
                    return  # the client went away (a real server notices at once, too)
                interval = self.fake.bookmark_interval
                if watcher.bookmarks and interval and time.monotonic() - last_bookmark >= interval:
                    last_bookmark = time.monotonic()
                    with self.fake._lock:  # every event up to the newest version is queued first
                        self.fake._queue(watcher, self.fake._bookmark())
                with watcher.cond:
                    if not watcher.events and not watcher.dropped:
                        watcher.cond.wait(0.05)
                    pending, watcher.events = watcher.events, []
                    dropped = watcher.dropped
                for event in pending:
                    text = event if isinstance(event, str) else json.dumps(event)
                    line = text.encode("utf-8") + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                    if isinstance(event, dict) and event["type"] == "ERROR":
                        deadline = time.monotonic()
                if dropped:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)  # cut mid-stream, no final chunk
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    break
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        finally:
            self.fake._close_watch(watcher)

    def _peer_closed(self) -> bool:
        """Has the client closed a quiet stream? (readable with nothing to read = EOF)"""
        try:
            # poll, not select: select() refuses descriptors past 1023, and an agent in the same
            # process holding its EFA counter files open pushes socket numbers past that.
            poller = select.poll()
            poller.register(self.connection, select.POLLIN)
            readable = poller.poll(0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._serve("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._serve("PATCH")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")
