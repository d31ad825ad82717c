"""PATCH semantics: strategic merge (with the Node schema's merge keys), JSON merge (RFC 7386)
and JSON patch (RFC 6902)."""

from __future__ import annotations

import copy
from typing import Any

from tests.support.kubefake.errors import ApiError

NODE_MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("status", "volumesAttached"): "name",
    ("metadata", "ownerReferences"): "uid",
}


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
