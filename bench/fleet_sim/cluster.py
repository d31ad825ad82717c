"""The control plane of a simulated fleet: access objects, Nodes, identities, process figures."""

from __future__ import annotations

import functools
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.bench_api_scale import GPU_SELECTOR, NAMESPACE, node_name, realistic_node
from tests.support.envtest import ControlPlane

AGENT_ACCOUNT = "healthagent"
COUNTER_ACCOUNT = "healthagent-budget-counter"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
CREATE_THREADS = 16
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@functools.lru_cache(maxsize=1)
def generic_overlay() -> tuple[dict, ...]:
    """The generic overlay's objects, rendered once (``kubectl kustomize`` takes seconds)."""
    from tests.support.deploy import DEPLOY, kubectl_binary, render

    return tuple(render(DEPLOY / "overlays" / "generic", kubectl_binary()))


def apply_generic_access(plane: ControlPlane) -> None:
    """The generic overlay's namespace, service accounts, RBAC and admission policies, as an
    install applies them (``tests/support/access_cluster.py`` does the same for the tests)."""
    from tests.support.access_cluster import ACCESS_KINDS, apply_access_objects

    apply_access_objects(plane.api_client(), [o for o in generic_overlay() if o["kind"] in ACCESS_KINDS])


PRIORITY_KINDS = ("PriorityLevelConfiguration", "FlowSchema")


def apply_api_priority(plane: ControlPlane) -> dict[str, str]:
    """The generic overlay's API Priority and Fairness objects (component api-priority: the
    agents' and the counter's own priority level), server-side applied as an install applies
    them; their uids by kind, to tell the requests classified into them."""
    from kubernetes import dynamic

    from tests.support.access_cluster import apply_access_objects

    objects = [o for o in generic_overlay() if o["kind"] in PRIORITY_KINDS]
    objects.sort(key=lambda o: PRIORITY_KINDS.index(o["kind"]))  # the level before the schema naming it
    apply_access_objects(plane.api_client(), objects)
    resources = dynamic.DynamicClient(plane.api_client()).resources
    return {o["kind"]: resources.get(api_version=o["apiVersion"], kind=o["kind"]).get(
        name=o["metadata"]["name"]).metadata.uid for o in objects}


def shed_watchers(plane: ControlPlane) -> int:
    """How often the API server so far closed a watcher it could not keep up with ("Forcing ...
    watcher close due to unresponsiveness" in its log, every API server run since the start)."""
    path = plane.workdir / "kube-apiserver.log"
    try:
        with open(path, "rb") as log:
            return sum(line.count(b"watcher close due to unresponsiveness") for line in log)
    except OSError:
        return 0


def identity(plane: ControlPlane, account: str, node: str = "") -> Any:
    """An API client that acts as ``account`` in the agents' namespace, as its pod's token
    would: the admin impersonates the service account (and, for an agent, the node its
    pod-bound token names), so RBAC and every admission policy judge the request as the agent's."""
    client = plane.api_client()
    client.set_default_header("Impersonate-User", f"system:serviceaccount:{NAMESPACE}:{account}")
    client.set_default_header("Impersonate-Group", "system:serviceaccounts")
    if node:
        client.set_default_header(f"Impersonate-Extra-{NODE_NAME_EXTRA.replace('/', '%2F')}", node)
    return client


def create_nodes(plane: ControlPlane, count: int, seed: int = 16) -> tuple[list[str], float]:
    """``count`` realistic GPU nodes (``bench_api_scale.realistic_node``, ~10 kB each); (names,
    seconds taken). Nodes that exist already are kept."""
    rng = random.Random(seed)
    session = plane.admin_session()
    url = f"{plane.url}/api/v1/nodes"
    names = [node_name(i) for i in range(count)]
    begin = time.monotonic()

    def create(index: int) -> None:
        body = realistic_node(index, random.Random(rng.random() + index))
        reply = session.post(url, json=body, timeout=120)
        if reply.status_code not in (201, 409):
            reply.raise_for_status()

    with ThreadPoolExecutor(CREATE_THREADS) as pool:
        list(pool.map(create, range(count)))
    return names, time.monotonic() - begin


def ensure_namespace(plane: ControlPlane) -> None:
    plane.admin_session().post(f"{plane.url}/api/v1/namespaces", json={"metadata": {"name": NAMESPACE}}, timeout=30)


def process_figures(pid: int) -> tuple[float, int]:
    """(CPU seconds used, resident bytes) of process ``pid`` from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, resident


def plane_pids(plane: ControlPlane) -> dict[str, int]:
    """The pids of kube-apiserver and etcd (the ones running now: a restart makes a new one)."""
    out = {}
    for name, proc in (("kube-apiserver", plane._apiserver), ("etcd", plane._etcd)):
        if proc is not None:
            out[name] = proc.pid
    return out


def etcd_size(plane: ControlPlane) -> int:
    """etcd's database size in bytes (its own ``etcd_mvcc_db_total_size_in_bytes``)."""
    import requests

    text = requests.get(f"http://127.0.0.1:{plane.etcd_port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("etcd_mvcc_db_total_size_in_bytes "):
            return int(float(line.split()[1]))
    return 0


__all__ = ["GPU_SELECTOR", "NAMESPACE", "apply_generic_access", "apply_api_priority", "shed_watchers", "identity",
           "create_nodes", "ensure_namespace",
           "process_figures", "plane_pids", "etcd_size", "AGENT_ACCOUNT", "COUNTER_ACCOUNT"]
