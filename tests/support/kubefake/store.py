"""``KubeFake``: the store (one resourceVersion counter, one lock), its lifecycle and the routing
of requests to nodes, events and leases."""

from __future__ import annotations

import copy
import re
import socket
import threading
import uuid
from http.server import ThreadingHTTPServer
from typing import Any

from tests.support.kubefake.errors import FAIL_REASONS, ApiError, _conflict, _invalid
from tests.support.kubefake.events import EventsMixin
from tests.support.kubefake.faults import FaultsMixin
from tests.support.kubefake.handler import _Handler
from tests.support.kubefake.leases import LeasesMixin
from tests.support.kubefake.nodes import NodesMixin
from tests.support.kubefake.recording import RecordedRequest, RequestLogMixin
from tests.support.kubefake.selectors import NODE_FIELDS
from tests.support.kubefake.tables import node_table
from tests.support.kubefake.validation import now_rfc3339
from tests.support.kubefake.watch import WATCH_HISTORY, WatchMixin, _Watcher


class KubeFake(FaultsMixin, WatchMixin, NodesMixin, LeasesMixin, EventsMixin, RequestLogMixin):
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
        self._fail_retry_after: int | None = None
        self._conflict_next = 0
        self._delay = 0.0
        self._queued: dict[tuple[str, str], float] = {}  # (method, path): seconds the next one waits in line
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

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    @property
    def resource_version(self) -> int:
        return self._rv

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

    @staticmethod
    def _check_rv(new: dict, current: dict, kind: str, name: str) -> None:
        """Optimistic concurrency: a write naming another resourceVersion is a 409. A write naming
        none is unconditional (nodes and events allow that, as the real registry does)."""
        rv = (new.get("metadata") or {}).get("resourceVersion")
        if rv not in (None, "") and rv != current["metadata"]["resourceVersion"]:
            raise _conflict(kind, name)

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
