"""The validation the agent could trip: label and annotation keys and values, node taints and
conditions, events.k8s.io/v1 Events and coordination.k8s.io/v1 Leases."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from tests.support.kubefake.errors import ApiError

TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
EVENT_TYPES = ("Normal", "Warning")

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
