"""Server-side Tables (``Accept: application/json;as=Table;v=v1;g=meta.k8s.io``): nodes only."""

from __future__ import annotations

import copy
from typing import Any


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
