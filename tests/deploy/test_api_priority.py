"""The component api-priority on the real kube-apiserver: its FlowSchema and priority level are
accepted as every overlay ships them (server-side apply), and the API server classifies the agents'
and the budget counter's requests into them - as two flows (ByUser), while another service account
of the same namespace stays in the built-in schemas.

The API server names the FlowSchema and priority level it classified a request into on every
reply (``X-Kubernetes-PF-FlowSchema-UID``, ``X-Kubernetes-PF-PriorityLevel-UID``), whatever the
reply (a request RBAC refuses was classified first), and counts what it dispatched per schema in
``apiserver_flowcontrol_dispatched_requests_total``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.effects.helpers import wait_for
from tests.support.access_cluster import apply_access_objects, delete_access_objects
from tests.support.deploy import OVERLAYS, find
from tests.support.gated_source import LONG

pytestmark = pytest.mark.integration

NAMESPACE = "healthagent"
AGENT = f"system:serviceaccount:{NAMESPACE}:healthagent"
COUNTER = f"system:serviceaccount:{NAMESPACE}:healthagent-budget-counter"
DISPATCHED = re.compile(r'^apiserver_flowcontrol_dispatched_requests_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)


@pytest.fixture
def priority(control_plane, rendered) -> dict[str, Any]:
    """The generic overlay's FlowSchema and priority level, applied as an install applies them
    (the level first: the schema names it); deleted afterwards (the chart tests install their own)."""
    objects = [find(rendered["generic"], "PriorityLevelConfiguration", "healthagent"),
               find(rendered["generic"], "FlowSchema", "healthagent")]
    client = control_plane.api_client()
    apply_access_objects(client, objects)
    try:
        from kubernetes import dynamic

        resources = dynamic.DynamicClient(client).resources
        live = {o["kind"]: resources.get(api_version=o["apiVersion"], kind=o["kind"]).get(name="healthagent")
                for o in objects}
        yield {kind: obj.metadata.uid for kind, obj in live.items()} | {"resources": resources}
    finally:
        delete_access_objects(client, objects)


def classified(control_plane, user: str) -> tuple[str, str]:
    """(FlowSchema uid, priority level uid) the API server gives a request of ``user``."""
    reply = control_plane.admin_session().get(
        f"{control_plane.url}/api/v1/nodes", params={"limit": "1"}, timeout=30,
        headers={"Impersonate-User": user, "Impersonate-Group": "system:serviceaccounts"})
    return (reply.headers.get("X-Kubernetes-PF-FlowSchema-UID", ""),
            reply.headers.get("X-Kubernetes-PF-PriorityLevel-UID", ""))


def dispatched(control_plane, schema: str) -> float:
    text = control_plane.admin_session().get(f"{control_plane.url}/metrics", timeout=30).text
    return sum(float(m.group("value")) for m in DISPATCHED.finditer(text)
               if f'flow_schema="{schema}"' in m.group("labels"))


def test_every_overlay_ships_the_same_priority_objects(rendered):
    wanted = [find(rendered["generic"], kind, "healthagent") for kind in ("FlowSchema", "PriorityLevelConfiguration")]
    for overlay in OVERLAYS:
        assert [find(rendered[overlay], o["kind"], "healthagent") for o in wanted] == wanted, overlay
    schema, level = wanted
    assert schema["spec"]["distinguisherMethod"] == {"type": "ByUser"}
    assert schema["spec"]["matchingPrecedence"] < 9000  # ahead of the built-in service-accounts schema
    queuing = level["spec"]["limited"]["limitResponse"]["queuing"]
    assert queuing["handSize"] <= queuing["queues"] and level["spec"]["limited"]["limitResponse"]["type"] == "Queue"


def test_the_server_accepts_them_and_classifies_the_agents_and_the_counter_into_their_level(
        control_plane, priority):
    resources = priority["resources"]
    schemas = resources.get(api_version="flowcontrol.apiserver.k8s.io/v1", kind="FlowSchema")

    def dangling() -> str:
        conditions = schemas.get(name="healthagent").to_dict().get("status", {}).get("conditions") or []
        return next((c["status"] for c in conditions if c["type"] == "Dangling"), "")

    wait_for(lambda: dangling() == "False", LONG, "the API server to take the FlowSchema up")
    mine = (priority["FlowSchema"], priority["PriorityLevelConfiguration"])
    wait_for(lambda: classified(control_plane, AGENT) == mine, LONG, "the agents' requests in their level")
    assert classified(control_plane, COUNTER) == mine
    before = dispatched(control_plane, "healthagent")
    for _ in range(3):
        assert classified(control_plane, AGENT) == mine
    assert dispatched(control_plane, "healthagent") >= before + 3
    other = classified(control_plane, f"system:serviceaccount:{NAMESPACE}:default")
    assert other[0] and other[0] != mine[0]  # another account stays in the built-in schemas
