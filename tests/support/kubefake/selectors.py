"""Label and field selectors, parsed into predicates as the API server reads them."""

from __future__ import annotations

import re
from typing import Callable

from tests.support.kubefake.errors import ApiError

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
