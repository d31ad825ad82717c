"""The smallest patches that bring the node to the desired state (``effects/node_desired.py``).

Pure functions: the node as last read, the ``DesiredNode`` and the wall time to write decide two
strategic-merge patches, one for the node object (labels, annotations, taints) and one for
``/status`` (conditions). Everything the agent does not own is left exactly as it was: foreign
taints keep their place in the list, foreign labels, annotations and conditions are never in a
patch.
"""

from __future__ import annotations

from typing import Mapping

from healthagent.effects.api_time import rfc3339
from healthagent.effects.node_desired import DesiredNode, TaintSpec, annotations_of, labels_of


def node_patch(node: Mapping, desired: DesiredNode, taint_key: str, wall: float) -> dict | None:
    """A strategic-merge patch for the node object (labels, annotations, taints), or None.

    ``spec.taints`` is an atomic list in the Node schema, so when the agent's taint changes the
    patch carries the whole list: every foreign taint as read, in place, plus the agent's one.
    The backend sends it with preconditions on what it replaces (``effects/backend.py``); a
    write that finds the node changed there is planned again from a fresh read.
    """
    meta: dict = {}
    labels = labels_of(node)
    label_changes = {k: v for k, v in desired.labels.items() if labels.get(k) != v}
    if label_changes:
        meta["labels"] = label_changes
    annotations = annotations_of(node)
    annotation_changes = {k: v for k, v in desired.annotations.items() if annotations.get(k) != v}
    if annotation_changes:
        meta["annotations"] = annotation_changes
    patch: dict = {}
    taints = _taints_after(node, desired.taint, taint_key, wall)
    if taints is not None:
        patch["spec"] = {"taints": taints}
    if not meta and not patch:
        return None
    if meta:
        patch["metadata"] = meta
    return patch


def _taints_after(node: Mapping, want: TaintSpec | None, taint_key: str, wall: float) -> list | None:
    """The full taint list after the change, or None when the agent's taints are already right
    (``timeAdded`` is the wall time ``wall`` of a new effect: people and the API read it)."""
    current = list((node.get("spec") or {}).get("taints") or [])
    ours = [t for t in current if t.get("key") == taint_key]
    if want is None:
        if not ours:
            return None
        return [t for t in current if t.get("key") != taint_key]
    if len(ours) == 1 and ours[0].get("value") == want.value and ours[0].get("effect") == want.effect:
        return None
    # An escalation (reboot_node, then replace_node) under the same effect keeps the taint's
    # timeAdded: pods that tolerate a NoExecute for a while count from it, and so does the grace.
    same_effect = [t for t in ours if t.get("effect") == want.effect and t.get("timeAdded")]
    added = same_effect[0]["timeAdded"] if same_effect else rfc3339(wall)
    entry = {"key": taint_key, "value": want.value, "effect": want.effect, "timeAdded": added}
    result, placed = [], False
    for taint in current:
        if taint.get("key") != taint_key:
            result.append(taint)
        elif not placed:
            result.append(entry)
            placed = True
    if not placed:
        result.append(entry)
    return result


def status_patch(node: Mapping, desired: DesiredNode, wall: float) -> dict | None:
    """A strategic-merge patch for ``/status``: only the agent's conditions that differ.

    Conditions merge by ``type`` on the server, so other writers' conditions (the kubelet's
    Ready, node-problem-detector's) are never in the patch. ``lastTransitionTime`` moves only when
    the status flips; ``lastHeartbeatTime`` is the time the agent last wrote the condition (the
    agent does not heartbeat: a steady state costs no writes). No ``resourceVersion``: the
    kubelet's heartbeats and foreign label writes would make every condition write conflict,
    and a merge by type cannot lose another writer's condition.
    """
    existing = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or []}
    changed = []
    for spec in desired.conditions:
        have = existing.get(spec.type)
        if have and (have.get("status"), have.get("reason"), have.get("message")) == (
                spec.status, spec.reason, spec.message):
            continue
        transition = rfc3339(wall)
        if have and have.get("status") == spec.status and have.get("lastTransitionTime"):
            transition = have["lastTransitionTime"]
        changed.append({"type": spec.type, "status": spec.status, "reason": spec.reason,
                        "message": spec.message, "lastHeartbeatTime": rfc3339(wall),
                        "lastTransitionTime": transition})
    if not changed:
        return None
    return {"status": {"conditions": changed}}
