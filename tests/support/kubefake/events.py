"""events.k8s.io/v1 Events: served (create, get, list, patch, replace, delete)."""

from __future__ import annotations

import copy
import uuid

from tests.support.kubefake.errors import ApiError, _invalid, _not_found
from tests.support.kubefake.patches import apply_patch
from tests.support.kubefake.validation import _validate_event


class EventsMixin:
    """``KubeFake``'s Events."""

    def events(self, namespace: str | None = None) -> list[dict]:
        with self._lock:
            return [copy.deepcopy(e) for (ns, _), e in sorted(self._events.items())
                    if namespace is None or ns == namespace]

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
