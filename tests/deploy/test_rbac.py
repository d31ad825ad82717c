"""The agent's RBAC: exactly the API calls the agent makes, nothing else; read-only in dry-run.

The expected grants are not a hand-kept list: they are derived from the ``kubernetes`` client
calls in healthagent/effects/backend.py, so a new call there without its RBAC (a 403 on a real
cluster, invisible to the fake API server of the effects tests) fails here.
"""

from __future__ import annotations

import re

import pytest

from healthagent.effects.events import EVENTS_NAMESPACE
from tests.support.deploy import OVERLAYS, REPO, find

pytestmark = pytest.mark.integration

BACKEND = REPO / "healthagent" / "effects" / "backend.py"
# kubernetes client method -> (API group, resource, verb); ``core`` is CoreV1Api, ``events`` EventsV1Api.
CLIENT_CALLS = {
    ("core", "read_node"): ("", "nodes", "get"),
    ("core", "list_node"): ("", "nodes", "list"),
    ("core", "patch_node"): ("", "nodes", "patch"),
    ("core", "replace_node"): ("", "nodes", "update"),
    ("core", "read_node_status"): ("", "nodes/status", "get"),
    ("core", "patch_node_status"): ("", "nodes/status", "patch"),
    ("core", "replace_node_status"): ("", "nodes/status", "update"),
    ("events", "create_namespaced_event"): ("events.k8s.io", "events", "create"),
    ("events", "patch_namespaced_event"): ("events.k8s.io", "events", "patch"),
}
VERB_ORDER = ["get", "list", "watch", "create", "update", "patch", "delete"]
READ_ONLY = {("", "nodes"): ["get", "list"]}


def grants(role) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (group, resource)
                assert key not in out, f"{key} granted twice"
                out[key] = list(rule["verbs"])
    return out


def grants_used_by_the_agent() -> dict[tuple[str, str], list[str]]:
    calls = set(re.findall(r"self\.(core|events)\.(\w+)", BACKEND.read_text(encoding="utf-8")))
    unknown = calls - set(CLIENT_CALLS)
    assert not unknown, f"map {sorted(unknown)} to their RBAC verb here and grant it in deploy/base/rbac.yaml"
    out: dict[tuple[str, str], list[str]] = {}
    for call in calls:
        group, resource, verb = CLIENT_CALLS[call]
        out.setdefault((group, resource), []).append(verb)
    return {key: sorted(verbs, key=VERB_ORDER.index) for key, verbs in out.items()}


def test_the_agent_calls_what_the_manifests_grant():
    """The derivation itself: the calls in backend.py today."""
    assert grants_used_by_the_agent() == {
        ("", "nodes"): ["get", "list", "patch"],
        ("", "nodes/status"): ["patch"],
        ("events.k8s.io", "events"): ["create"],
    }


@pytest.mark.parametrize("overlay", ["generic", "hyperpod"])
def test_roles_grant_exactly_the_calls_the_agent_makes(rendered, overlay):
    objects = rendered[overlay]
    cluster = grants(find(objects, "ClusterRole", "healthagent"))
    events = grants(find(objects, "Role", "healthagent-events"))
    assert find(objects, "Role", "healthagent-events")["metadata"]["namespace"] == EVENTS_NAMESPACE
    assert {**cluster, **events} == grants_used_by_the_agent()
    assert set(events) == {("events.k8s.io", "events")}


def test_dry_run_is_read_only(rendered):
    objects = rendered["dry-run"]
    assert grants(find(objects, "ClusterRole", "healthagent")) == READ_ONLY
    assert [o for o in objects if o["kind"] in ("Role", "RoleBinding")] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_wildcards_and_no_other_roles(rendered, overlay):
    roles = [o for o in rendered[overlay] if o["kind"] in ("Role", "ClusterRole")]
    assert {r["metadata"]["name"] for r in roles} <= {"healthagent", "healthagent-events"}
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_bindings_tie_the_roles_to_the_agents_service_account(rendered, overlay):
    objects = rendered[overlay]
    account = find(objects, "ServiceAccount", "healthagent")
    subject = [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                "namespace": account["metadata"]["namespace"]}]
    pod = find(objects, "DaemonSet", "healthagent")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    bindings = [o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    assert bindings
    for binding in bindings:
        role_kind = "ClusterRole" if binding["kind"] == "ClusterRoleBinding" else "Role"
        role = find(objects, role_kind, binding["roleRef"]["name"])
        assert binding["roleRef"]["kind"] == role_kind and binding["subjects"] == subject
        assert binding["metadata"].get("namespace") == role["metadata"].get("namespace")
