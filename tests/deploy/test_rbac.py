"""The agent's RBAC: exactly the API calls the agent makes, nothing else; read-only in dry-run.

The expected grants are not a hand-kept list: they are derived from the ``kubernetes`` client
calls in healthagent/effects/backend.py and healthagent/effects/budget_leases.py, so a new call
there without its RBAC (a 403 on a real cluster, invisible to the fake API server of the effects
tests) fails here. A ``list_*`` call made with ``watch=True`` is the ``watch`` verb (the API server
authorizes a watch as such); a request the client's serializer builds by hand
(``resource_path=...``) is mapped by its method and path. The budget's Leases are granted by a
Role in the agent's own namespace, never cluster-wide (the nodes' heartbeat Leases live in
``kube-node-lease``).
"""

from __future__ import annotations

import re

import pytest

from healthagent.effects.events import EVENTS_NAMESPACE
from tests.support.deploy import OVERLAYS, REPO, find

pytestmark = pytest.mark.integration

SOURCES = (REPO / "healthagent" / "effects" / "backend.py", REPO / "healthagent" / "effects" / "budget_leases.py")
# kubernetes client method -> (API group, resource, verb); ``core`` is CoreV1Api, ``events``
# EventsV1Api, ``leases`` CoordinationV1Api.
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
    ("leases", "list_namespaced_lease"): ("coordination.k8s.io", "leases", "list"),
    ("leases", "read_namespaced_lease"): ("coordination.k8s.io", "leases", "get"),
    ("leases", "create_namespaced_lease"): ("coordination.k8s.io", "leases", "create"),
    ("leases", "replace_namespaced_lease"): ("coordination.k8s.io", "leases", "update"),
    ("leases", "patch_namespaced_lease"): ("coordination.k8s.io", "leases", "patch"),
    ("leases", "delete_namespaced_lease"): ("coordination.k8s.io", "leases", "delete"),
    ("raw", "GET /api/v1/nodes"): ("", "nodes", "list"),
    ("raw", "PATCH /api/v1/nodes/{name}"): ("", "nodes", "patch"),  # the node write with a deadline
    ("raw", "PATCH /api/v1/nodes/{name}/status"): ("", "nodes/status", "patch"),  # the conditions, likewise
}
ROLES = {"healthagent-events": ("events.k8s.io", "events"), "healthagent-budget": ("coordination.k8s.io", "leases")}
VERB_ORDER = ["get", "list", "watch", "create", "update", "patch", "delete"]
READ_ONLY = {("", "nodes"): ["get", "list"]}
COUNTER = "healthagent-budget-counter"  # the budget counter's account, roles and bindings


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


def call_arguments(source: str, start: int, end: int) -> str:
    """The arguments of the call that ``source[start:end]`` makes (``self.core.x(...)``) or is
    passed to (``self._send(self.core.x, ...)``)."""
    rest = source[end:].lstrip()
    if rest.startswith("("):
        opened = end + source[end:].index("(")
    else:  # a method reference: the innermost call still open before it
        depth, opened = 0, -1
        for index in range(start - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(source[index], 0)
            if depth < 0:
                opened = index
                break
        if opened < 0:
            return ""
    depth = 0
    for index in range(opened, len(source)):
        depth += {"(": 1, ")": -1}.get(source[index], 0)
        if depth == 0:
            return source[opened + 1:index]
    raise AssertionError("unbalanced call in backend.py")


def client_calls(source: str) -> set[tuple[str, str, bool]]:
    """(api, method, is a watch) for every ``self.core.X``/``self.events.X``/``self.leases.X`` in
    the source, and ("raw", "METHOD path") for every request built with ``resource_path=``."""
    calls = set()
    for match in re.finditer(r"self\.(core|events|leases)\.(\w+)", source):
        if match.group(2) == "api_client":
            continue
        arguments = call_arguments(source, match.start(), match.end())
        watching = bool(re.search(r"\bwatch\s*=\s*True\b", arguments))
        calls.add((match.group(1), match.group(2), watching))
    for match in re.finditer(r'method="(\w+)",\s*resource_path="([^"]+)"', source):
        calls.add(("raw", f"{match.group(1)} {match.group(2)}", False))
    return calls


def grants_used_by_the_agent() -> dict[tuple[str, str], list[str]]:
    calls = set().union(*(client_calls(path.read_text(encoding="utf-8")) for path in SOURCES))
    unknown = {(api, method) for api, method, _ in calls} - set(CLIENT_CALLS)
    assert not unknown, f"map {sorted(unknown)} to their RBAC verb here and grant it in deploy/base/rbac.yaml"
    out: dict[tuple[str, str], list[str]] = {}
    for api, method, watching in calls:
        group, resource, verb = CLIENT_CALLS[(api, method)]
        if watching:
            assert verb == "list", f"{method} with watch=True is not a list call"
            verb = "watch"
        out.setdefault((group, resource), []).append(verb)
    return {key: sorted(set(verbs), key=VERB_ORDER.index) for key, verbs in out.items()}


def test_the_agent_calls_what_the_manifests_grant():
    """The derivation itself: the calls in backend.py and budget_leases.py today."""
    assert grants_used_by_the_agent() == {
        ("", "nodes"): ["get", "list", "watch", "patch"],
        ("", "nodes/status"): ["patch"],
        ("events.k8s.io", "events"): ["create"],
        ("coordination.k8s.io", "leases"): ["get", "list", "watch", "create", "update"],
    }


@pytest.mark.parametrize("source,expected", [
    ("self.core.list_node(label_selector=s)", {("core", "list_node", False)}),
    ("self._send(self.core.list_node, field_selector=f(x), watch=True,\n  timeout_seconds=t)",
     {("core", "list_node", True)}),
    ("self.core.list_node(watch=False)", {("core", "list_node", False)}),
    ("self._call(self.events.create_namespaced_event, ns, body)", {("events", "create_namespaced_event", False)}),
    ("self._backend._call(self.leases.replace_namespaced_lease, name, ns, body)",
     {("leases", "replace_namespaced_lease", False)}),
    ('api.param_serialize(\n  method="GET", resource_path="/api/v1/nodes",\n  query_params=q)',
     {("raw", "GET /api/v1/nodes", False)}),
    ("LeaseStore(self.core.api_client)", set()),
])
def test_a_watch_is_told_from_a_list(source, expected):
    assert client_calls(source) == expected


@pytest.mark.parametrize("overlay", ["generic", "hyperpod"])
def test_roles_grant_exactly_the_calls_the_agent_makes(rendered, overlay):
    objects = rendered[overlay]
    cluster = grants(find(objects, "ClusterRole", "healthagent"))
    events = grants(find(objects, "Role", "healthagent-events"))
    budget = grants(find(objects, "Role", "healthagent-budget"))
    assert find(objects, "Role", "healthagent-events")["metadata"]["namespace"] == EVENTS_NAMESPACE
    account = find(objects, "ServiceAccount", "healthagent")["metadata"]["namespace"]
    assert find(objects, "Role", "healthagent-budget")["metadata"]["namespace"] == account
    assert {**cluster, **events, **budget} == grants_used_by_the_agent()
    assert set(events) == {ROLES["healthagent-events"]} and set(budget) == {ROLES["healthagent-budget"]}
    assert ROLES["healthagent-budget"] not in cluster  # never every namespace's Leases


def test_dry_run_is_read_only(rendered):
    objects = rendered["dry-run"]
    assert grants(find(objects, "ClusterRole", "healthagent")) == READ_ONLY
    assert [o for o in objects if o["kind"] in ("Role", "RoleBinding")] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_wildcards_and_no_other_roles(rendered, overlay):
    roles = [o for o in rendered[overlay] if o["kind"] in ("Role", "ClusterRole")]
    assert {r["metadata"]["name"] for r in roles} <= {"healthagent", COUNTER, *ROLES}
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
    bindings = [o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")
                and o["roleRef"]["name"] != COUNTER]
    assert bindings
    for binding in bindings:
        role_kind = "ClusterRole" if binding["kind"] == "ClusterRoleBinding" else "Role"
        role = find(objects, role_kind, binding["roleRef"]["name"])
        assert binding["roleRef"]["kind"] == role_kind and binding["subjects"] == subject
        assert binding["metadata"].get("namespace") == role["metadata"].get("namespace")


@pytest.mark.parametrize("overlay", ["generic", "hyperpod", "eks-node-repair"])
def test_the_budget_counter_may_list_nodes_and_write_leases_in_its_namespace_only(rendered, overlay):
    """healthagent/budget_counter.py lists the GPU nodes (a Table) and lists, creates and updates
    the count Leases; its own account, which the agent's pods never run as, holds exactly that."""
    objects = rendered[overlay]
    assert grants(find(objects, "ClusterRole", COUNTER)) == {("", "nodes"): ["list"]}
    role = find(objects, "Role", COUNTER)
    assert grants(role) == {("coordination.k8s.io", "leases"): ["list", "create", "update"]}
    account = find(objects, "ServiceAccount", COUNTER)["metadata"]
    assert role["metadata"]["namespace"] == account["namespace"]
    subject = [{"kind": "ServiceAccount", "name": COUNTER, "namespace": account["namespace"]}]
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        binding = find(objects, kind, COUNTER)
        assert binding["subjects"] == subject and binding["roleRef"]["name"] == COUNTER
    pod = find(objects, "Deployment", COUNTER)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == COUNTER
    daemonset = find(objects, "DaemonSet", "healthagent")["spec"]["template"]["spec"]["containers"][0]
    agent_env = {e["name"]: e.get("value") for e in daemonset.get("env", [])}
    counter_env = {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}
    selector = "HEALTHAGENT_BUDGET_NODE_SELECTOR"
    assert counter_env[selector] == agent_env.get(selector, "nvidia.com/gpu.present=true")  # one set of nodes
