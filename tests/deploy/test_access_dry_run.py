"""The dry run holds no write rights, proven with the agent's real credential on a real API server.

The ``dry-run`` overlay says "even a bug cannot write": its ClusterRole is nodes ``get``/``list``
and it has no Event or budget Role. That holds only if nothing of a live install is left behind,
so two installs are checked, each with ``kubectl apply --server-side`` as docs/install.md runs it:

- ``dry-run``: the dry-run overlay on a cluster without the agent;
- ``generic, then back``: the ``generic`` overlay (whose tokens can write, which the test checks
  first: the agent's and the budget counter's), then docs/install.md's commands for going back to
  the dry run, run as printed.

Then every call of the access matrix (``tests/support/access_cases.py``) that writes (a node
patch, an Event, a budget Lease, the GPU node count: the writes the agent and the budget counter
make and the ones their policies refuse) is made with the token it names (bound to a pod on node A,
as the DaemonSet's pods get, or the counter's) and must be refused by RBAC, before anything reaches
admission or storage. The node reads the dry run keeps stay allowed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.support.access_cases import MATRIX, ByRbac, Case
from tests.support.access_cluster import (
    ACCESS_KINDS,
    COUNTER_ACCOUNT,
    NAMESPACE,
    OWN_TAINT,
    Apis,
    World,
    agent_pod,
    attempt,
    delete_access_objects,
    forged_count,
    node_object,
    own_taints,
    pod_token,
    unbound_token,
    with_taints,
)
from tests.support.deploy import REPO
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

INSTALL = REPO / "docs" / "install.md"
PART_OF = "app.kubernetes.io/part-of=healthagent"
RBAC_TIMEOUT = 60.0  # a grant or its removal reaches the authorizer through an informer
KUBECTL_TIMEOUT = 120
# What an install applies here: the objects that grant (the rest of an overlay, the DaemonSet and
# the monitoring objects, grants nothing) and the budget counter's Deployment, which runs a writer.
INSTALLED_KINDS = (*ACCESS_KINDS, "Deployment")
# The matrix's calls that only read, and whether the dry run still allows them (nodes get/list);
# every other call of the matrix writes.
READS = {
    "get its own node": True,
    "list GPU nodes by label from the watch cache (the budget count)": True,
    "list its own node by field selector (the watch's list)": True,
    "watch its own node": False,
    "list the budget's Leases from the watch cache": False,
    "get a budget slot": False,
    "watch the budget's Leases (a held node)": False,
    **{name: False for name, case in MATRIX.items()
       if isinstance(case.expect, ByRbac) and case.expect.verb in ("get", "list", "watch")},
}
WRITES = {name: case for name, case in MATRIX.items() if name not in READS}
WRITE_VERBS = ("patch", "create", "update", "delete")


def going_back_commands() -> list[str]:
    """docs/install.md's commands for going back to the dry run, as printed."""
    section = INSTALL.read_text(encoding="utf-8").split("## 2. Going live", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line for line in block.splitlines() if line.strip()]


def test_going_back_applies_the_dry_run_overlay_then_deletes_every_role_and_the_counter():
    apply, delete, delete_counter = going_back_commands()
    assert shlex.split(apply)[:3] == ["kubectl", "kustomize", "deploy/overlays/dry-run"]
    assert apply.endswith("| kubectl apply --server-side -f -")
    words = shlex.split(delete)
    assert words[:3] == ["kubectl", "delete", "role,rolebinding"]
    assert "--all-namespaces" in words and words[words.index("-l") + 1] == PART_OF
    words = shlex.split(delete_counter)
    assert words[:2] == ["kubectl", "delete"] and COUNTER_ACCOUNT in words
    assert set(words[words.index(COUNTER_ACCOUNT) - 1].split(",")) == {
        "deployment", "serviceaccount", "clusterrole", "clusterrolebinding"}


def test_every_role_and_binding_of_the_live_install_carries_the_label_the_delete_selects(rendered):
    """What the second command selects is what a live install has: a Role or RoleBinding added
    without the label would survive the way back."""
    for overlay, objects in rendered.items():
        for obj in objects:
            if obj["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
                assert obj["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "healthagent", (
                    overlay, obj["kind"], obj["metadata"]["name"])
    assert not [o for o in rendered["dry-run"] if o["kind"] in ("Role", "RoleBinding")]


def _kubectl(kubectl: str, kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    result = subprocess.run([kubectl, *args], input=stdin, capture_output=True, text=True, env=env,
                            timeout=KUBECTL_TIMEOUT, check=False)
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result.stdout


def _apply_overlay(kubectl: str, kubeconfig: Path, objects: list[dict[str, Any]]) -> None:
    """``kubectl apply --server-side -f -`` of an overlay's ``INSTALLED_KINDS``."""
    access = [o for o in objects if o["kind"] in INSTALLED_KINDS]
    _kubectl(kubectl, kubeconfig, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(access))


@pytest.fixture(scope="module", params=["dry-run", "generic, then back"])
def install(request, control_plane, rendered, kubectl, tmp_path_factory) -> Iterator[str]:
    """The access objects of one install on the real server, removed afterwards (other modules
    apply the generic overlay's with their own field manager; the admission policies left on the
    shared server would refuse other modules' writes, so they go even when the setup fails). For
    the way back, the live grants are shown first (a node's token taints its node, the counter's
    token lists the budget's Leases), then docs/install.md's commands are run."""
    kubeconfig = control_plane.write_kubeconfig(tmp_path_factory.mktemp("kubeconfig") / "admin")
    live = [o for o in rendered["generic"] if o["kind"] in INSTALLED_KINDS]
    delete_access_objects(control_plane.api_client(), live)  # a clean start
    try:
        if request.param == "dry-run":
            _apply_overlay(kubectl, kubeconfig, rendered["dry-run"])
        else:
            _apply_overlay(kubectl, kubeconfig, rendered["generic"])
            with _world(control_plane, f"live-{request.param[:7]}") as world:
                wait_for(lambda: attempt(lambda: with_taints(world, world.a, lambda ts: ts + [dict(OWN_TAINT)]))
                         .status == 200, RBAC_TIMEOUT, "the live install's token to taint its node")
                assert own_taints(world) == [OWN_TAINT]
                wait_for(lambda: attempt(lambda: world.counter.leases.list_namespaced_lease(NAMESPACE)).status
                         == 200, RBAC_TIMEOUT, "the live install's counter token to list the budget's Leases")
            _go_back(kubectl, kubeconfig, rendered["dry-run"])
        yield request.param
    finally:
        delete_access_objects(control_plane.api_client(), live)


def _go_back(kubectl: str, kubeconfig: Path, dry_run: list[dict[str, Any]]) -> None:
    """docs/install.md's commands: the dry-run overlay applied, the deletes run as printed."""
    _apply_overlay(kubectl, kubeconfig, dry_run)
    for command in going_back_commands()[1:]:
        delete = shlex.split(command)
        assert delete[0] == "kubectl"
        _kubectl(kubectl, kubeconfig, *delete[1:])


@contextmanager
def _world(control_plane: Any, base: str) -> Iterator[World]:
    """Fresh nodes A and B, an agent pod bound to each, their tokens, a token naming no node and
    the budget counter's token. A dry run has no counter account (its overlay has no counter, the
    way back deletes it): it is made here, as anyone with the rights could, so that a grant left
    naming it would show; it goes again afterwards."""
    admin = Apis.of(control_plane.api_client())
    names = [f"{base}-{side}-{uuid.uuid4().hex[:6]}" for side in ("a", "b")]
    uids, pods = {}, []
    made_counter = attempt(lambda: admin.core.create_namespaced_service_account(
        NAMESPACE, {"metadata": {"name": COUNTER_ACCOUNT}})).status == 200
    try:
        for name in names:
            uids[name] = admin.core.create_node(node_object(name)).metadata.uid
            pods.append(admin.core.create_namespaced_pod(NAMESPACE, agent_pod(f"healthagent-{name}", name)))
        yield World(plane=control_plane, a=names[0], b=names[1], admin=admin, uids=uids,
                    agent=Apis.of(control_plane.api_client(pod_token(admin, pods[0]))),
                    agent_b=Apis.of(control_plane.api_client(pod_token(admin, pods[1]))),
                    unbound=Apis.of(control_plane.api_client(unbound_token(admin))),
                    counter=Apis.of(control_plane.api_client(unbound_token(admin, COUNTER_ACCOUNT))))
    finally:
        for pod in pods:
            attempt(lambda: admin.core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0))
        for name in uids:
            attempt(lambda: admin.core.delete_node(name))
        if made_counter:
            attempt(lambda: admin.core.delete_namespaced_service_account(COUNTER_ACCOUNT, NAMESPACE))


@pytest.fixture
def dry_world(install, control_plane) -> Iterator[World]:
    """Fresh nodes and tokens under the install, once the removed grants reach the authorizer."""
    with _world(control_plane, "dry-run") as world:
        wait_for(lambda: _refused_by_rbac(world, WRITES["strategic merge: set its health label"]), RBAC_TIMEOUT,
                 "the removed grants to reach the authorizer")
        wait_for(lambda: _refused_by_rbac(world, Case(lambda w: w.counter.leases.create_namespaced_lease(
            NAMESPACE, forged_count(w, "1"), dry_run="All"), ByRbac("create", "leases"))), RBAC_TIMEOUT,
            "the counter's removed grant to reach the authorizer")
        yield world
        for lease in world.leases():  # the slots the cases prepared
            attempt(lambda: world.admin.leases.delete_namespaced_lease(lease, NAMESPACE))


def _refused_by_rbac(world: World, case: Case) -> bool:
    outcome = attempt(lambda: case.call(world))
    return outcome.status == 403 and any(f"cannot {verb} resource" in outcome.message for verb in WRITE_VERBS)


def test_no_role_or_binding_of_the_agent_is_left(install, control_plane, kubectl, tmp_path, rendered):
    """No Role or RoleBinding of the agent's, and of the live install only what the dry-run overlay
    holds: not the budget counter (its grants, its service account, its Deployment)."""
    kubeconfig = control_plane.write_kubeconfig(tmp_path / "admin")
    left = _kubectl(kubectl, kubeconfig, "get", "role,rolebinding", "--all-namespaces", "-l", PART_OF, "-o", "name")
    assert left.strip() == "", left
    live = [o for o in rendered["generic"] if o["kind"] in INSTALLED_KINDS]
    dry_run = {_identity(o) for o in rendered["dry-run"]}
    present = {_identity(o) for o in live if _on_server(control_plane.api_client(), o)}
    assert present == {_identity(o) for o in live} & dry_run, present ^ ({_identity(o) for o in live} & dry_run)


def _identity(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _on_server(api_client: Any, obj: dict[str, Any]) -> bool:
    from kubernetes import dynamic
    from kubernetes.client.exceptions import ApiException

    resource = dynamic.DynamicClient(api_client).resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    try:
        resource.get(name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace"))
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


@pytest.mark.parametrize("name", list(WRITES), ids=list(WRITES))
def test_every_write_with_the_nodes_token_is_refused_by_rbac(dry_world, name):
    case = WRITES[name]
    if case.prepare is not None:
        case.prepare(dry_world)
    before = dry_world.node(), dry_world.leases()
    outcome = attempt(lambda: case.call(dry_world))
    assert outcome.status == 403 and outcome.reason == "Forbidden", (name, outcome)
    assert any(f"cannot {verb} resource" in outcome.message for verb in WRITE_VERBS), (name, outcome)
    after = dry_world.node(), dry_world.leases()
    assert after[0]["metadata"]["resourceVersion"] == before[0]["metadata"]["resourceVersion"]
    assert after[1] == before[1]


@pytest.mark.parametrize("name", list(READS), ids=list(READS))
def test_the_node_reads_stay_and_nothing_else(dry_world, name):
    case = MATRIX[name]
    if case.prepare is not None:
        case.prepare(dry_world)
    outcome = attempt(lambda: case.call(dry_world))
    if READS[name]:
        assert outcome.status == 200, (name, outcome)
    else:
        assert outcome.status == 403 and "cannot" in outcome.message, (name, outcome)


def test_the_matrix_holds_the_agents_writes_of_every_kind():
    """The writes a live install makes (the agent's node, its conditions, Events, budget Leases,
    and the budget counter's GPU node count) are all among those the dry run must refuse, beside
    the ones a live install refuses too; every read named here is a case of the matrix."""
    assert set(READS) <= set(MATRIX), set(READS) - set(MATRIX)
    for name in ("strategic merge: add its NoSchedule taint", "strategic merge on /status: GpuHealthy False, "
                 "NetworkHealthy added", "create an Event about its node, as the agent builds it",
                 "create a budget slot in its own name (the first to take it)",
                 "take a free slot (an update with the version read)",
                 "the budget counter's token records the fleet's GPU node count"):
        assert name in WRITES, name
    assert len(WRITES) >= 40, len(WRITES)
