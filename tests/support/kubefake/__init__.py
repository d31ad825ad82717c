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
409), ``queue_next(method, path, seconds)`` (the next such request counts as queued that long:
504 Timeout past its ``timeout`` parameter), ``drop_watches()`` (open watch streams are cut mid-stream, no final chunk),
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
resource but nodes, events.k8s.io/v1 events and leases (no core/v1 events, no discovery); PATCH
and a held watch cache for leases (their lists and watches are always live); protobuf, CBOR,
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

from tests.support.kubefake.errors import FAIL_REASONS, ApiError, _conflict, _invalid, _not_found
from tests.support.kubefake.handler import _Handler
from tests.support.kubefake.patches import (NODE_MERGE_KEYS, _get, _json_patch_op, _merge_list, _parent, _pointer,
                                            apply_patch, json_merge_patch, json_patch, strategic_merge_patch)
from tests.support.kubefake.recording import RecordedRequest
from tests.support.kubefake.selectors import (_REQ_RE, NODE_FIELDS, _split_requirements, parse_field_selector,
                                              parse_label_selector)
from tests.support.kubefake.store import KubeFake
from tests.support.kubefake.tables import node_table
from tests.support.kubefake.validation import (_MICRO_TIME_RE, _NAME_RE, _PREFIX_RE, _VALUE_RE, EVENT_TYPES,
                                               TAINT_EFFECTS, _validate_event, _validate_lease, _validate_node,
                                               label_value_problem, now_rfc3339, qualified_name_problem)
from tests.support.kubefake.watch import WATCH_HISTORY, _watch_event, _Watcher

__all__ = [
    "EVENT_TYPES", "FAIL_REASONS", "NODE_FIELDS", "NODE_MERGE_KEYS", "TAINT_EFFECTS", "WATCH_HISTORY",
    "ApiError", "KubeFake", "RecordedRequest", "apply_patch", "json_merge_patch", "json_patch",
    "label_value_problem", "node_table", "now_rfc3339", "parse_field_selector", "parse_label_selector",
    "qualified_name_problem", "strategic_merge_patch",
    # inner pieces, importable from here too
    "_MICRO_TIME_RE", "_NAME_RE", "_PREFIX_RE", "_REQ_RE", "_VALUE_RE", "_Handler", "_Watcher", "_conflict",
    "_get", "_invalid", "_json_patch_op", "_merge_list", "_not_found", "_parent", "_pointer",
    "_split_requirements", "_validate_event", "_validate_lease", "_validate_node", "_watch_event",
]
