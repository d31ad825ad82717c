"""The disruption budget at fleet scale, on a real API server: what one agent decision costs.

    .venv/bin/python -m bench.bench_api_scale [--nodes 200 1000] [--agents 40] [--budget 10]
                                              [--runs 10] [--spread 0.05] [--json PATH]

Needs ``etcd`` and ``kube-apiserver`` (``KUBEBUILDER_ASSETS``, the envtest convention; see
``tests/support/envtest.py``). One control plane serves the bench; for each fleet size it creates
that many Node objects of realistic size (about 40 labels: the well-known ones, GPU feature
discovery's, the cloud's and the node group's; 30 container images with digests in the status;
capacity, allocatable, addresses, node info and the kubelet's conditions: ~11 kB of JSON each, as
a busy GPU node's object is), all matching the budget's selector (``nvidia.com/gpu.present=true``).

Each run picks ``--agents`` of those nodes, deletes and re-creates them (a clean object), builds
one ``NodeEffects`` per node (the agent's Kubernetes side, each with its own API client, as its
own pod would have), starts them, and then lets them all fault at once: released together by a
barrier, each waits a random 0-``--spread`` s and reconciles an XID 95 verdict (``replace_node``)
with ``budget_max_fraction=0.1``, ``budget_max_nodes=--budget`` and a NoExecute grace of 0 (the
worst case: a node with a slot is taken out at once, as HyperPod would replace it at once).

What is reported, per fleet size, over all runs:
- nodes taken out at the end of each run (the agent's NoExecute: must be exactly the budget), the
  most taken out at any moment, and the nodes held at NoSchedule (every other faulty node: NoSchedule
  is never budgeted), from a watch on the nodes that sees every change in the API server's order;
  and the holders of the budget's slots (Lease slots only: must be exactly the nodes taken out);
- bytes the API server sent per agent decision: the change of its own
  ``apiserver_response_sizes_sum`` (LIST and GET, every resource) over the decision window,
  divided by the agents; also every verb's requests per decision (``apiserver_request_total``);
- time to decision: each agent's reconcile, from its release to its return, p50/p99;
- the budget's shared GPU node count (the new budget only): the bytes of its one LIST, taken at
  the first start.

Nothing else of the bench talks to the API server in the decision window (its watch is a WATCH,
which the size metric does not record). The API server's own requests do: its OpenAPI and endpoint
reads are left out of the request counts (only nodes, leases and events are counted), and its
identity Lease, renewed every 10 s, is among the PUT leases (about 0.1 per decision in a window of
40 s, none in one of a second). Every wait is bounded; all traffic is on loopback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import machine, percentile, table
from tests.support.envtest import ControlPlane, find_assets, missing_reason

TAINT_KEY = "healthagent.io/unhealthy"
GPU_SELECTOR = "nvidia.com/gpu.present=true"
NAMESPACE = "healthagent"
SIZE_METRIC = re.compile(r'^apiserver_response_sizes_sum\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)
REQUEST_METRIC = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)
WAIT_METRIC = re.compile(r'^apiserver_flowcontrol_request_wait_duration_seconds_(?P<part>sum|count)\{(?P<labels>[^}]*)\} '
                         r'(?P<value>\S+)$', re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')
STEP_TIMEOUT = 300.0  # the longest any single wait may take (a bound, never a measurement)
AGENT_RESOURCES = ("nodes", "nodes/status", "leases", "events")  # what the agents' requests touch


# -- realistic nodes ------------------------------------------------------------------------------------

def node_name(i: int) -> str:
    return f"ip-10-{i // 65536 % 256}-{i // 256 % 256}-{i % 256}.us-west-2.compute.internal"


def realistic_node(i: int, rng: random.Random) -> dict:
    """A GPU node as a busy cluster shows it: ~40 labels, 30 images with digests, capacity and
    allocatable, addresses, node info and the kubelet's conditions (~11 kB of JSON)."""
    name = node_name(i)
    zone = f"us-west-2{'abcd'[i % 4]}"
    labels = {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/instance-type": "p5.48xlarge", "node.kubernetes.io/instance-type": "p5.48xlarge",
        "topology.kubernetes.io/region": "us-west-2", "topology.kubernetes.io/zone": zone,
        "failure-domain.beta.kubernetes.io/region": "us-west-2", "failure-domain.beta.kubernetes.io/zone": zone,
        "topology.k8s.aws/zone-id": f"usw2-az{i % 4 + 1}", "topology.k8s.aws/network-node-layer-1": f"nn-{rng.getrandbits(48):012x}",
        "topology.k8s.aws/network-node-layer-2": f"nn-{rng.getrandbits(48):012x}",
        "topology.k8s.aws/network-node-layer-3": f"nn-{rng.getrandbits(48):012x}",
        "eks.amazonaws.com/nodegroup": "gpu-p5-a", "eks.amazonaws.com/capacityType": "ON_DEMAND",
        "eks.amazonaws.com/nodegroup-image": f"ami-{rng.getrandbits(64):017x}"[:21],
        "eks.amazonaws.com/sourceLaunchTemplateId": f"lt-{rng.getrandbits(64):017x}"[:20],
        "eks.amazonaws.com/sourceLaunchTemplateVersion": "7", "k8s.io/cloud-provider-aws": f"{rng.getrandbits(128):032x}",
        "vpc.amazonaws.com/efa.present": "true", "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.family": "hopper", "nvidia.com/gpu.machine": "p5.48xlarge",
        "nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/cuda.driver.major": "550", "nvidia.com/cuda.driver.minor": "127",
        "nvidia.com/cuda.driver.rev": "05", "nvidia.com/cuda.runtime.major": "12", "nvidia.com/cuda.runtime.minor": "4",
        "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "single", "nvidia.com/gpu.deploy.driver": "pre-installed",
        "nvidia.com/gpu.deploy.device-plugin": "true", "nvidia.com/gpu.deploy.dcgm-exporter": "true",
        "feature.node.kubernetes.io/pci-10de.present": "true", "feature.node.kubernetes.io/kernel-version.full": "5.10.219-208.866.amzn2.x86_64",
        "training.example.com/pool": f"pool-{i % 8}",
    }
    images = []
    for k in range(30):
        repo = f"{rng.getrandbits(40):012d}.dkr.ecr.us-west-2.amazonaws.com/ml/{rng.choice(['train', 'serve', 'eval', 'base'])}-{k}"
        images.append({"names": [f"{repo}@sha256:{rng.getrandbits(256):064x}", f"{repo}:v{k}.{rng.randrange(99)}.{rng.randrange(99)}"],
                       "sizeBytes": rng.randrange(50_000_000, 20_000_000_000)})
    resources = {"cpu": "192", "memory": "2097152Mi", "pods": "737", "nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32",
                 "ephemeral-storage": "3758096384Ki", "hugepages-1Gi": "0", "hugepages-2Mi": "21Gi"}
    heartbeat = "2026-11-23T10:00:00Z"
    conditions = [{"type": t, "status": "False", "reason": f"KubeletHasNo{t}", "message": f"kubelet has no {t.lower()}",
                   "lastHeartbeatTime": heartbeat, "lastTransitionTime": "2026-11-01T00:00:00Z"}
                  for t in ("MemoryPressure", "DiskPressure", "PIDPressure")]
    conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                       "message": "kubelet is posting ready status", "lastHeartbeatTime": heartbeat,
                       "lastTransitionTime": "2026-11-01T00:00:00Z"})
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {
            "alpha.kubernetes.io/provided-node-ip": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}",
            "node.alpha.kubernetes.io/ttl": "0", "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            "csi.volume.kubernetes.io/nodeid": json.dumps({"efs.csi.aws.com": f"i-{rng.getrandbits(64):017x}"})}},
        "spec": {"providerID": f"aws:///{zone}/i-{rng.getrandbits(64):017x}"},
        "status": {"capacity": dict(resources), "allocatable": {**resources, "cpu": "191450m", "memory": "2062932Mi"},
                   "conditions": conditions, "images": images, "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                   "addresses": [{"type": "InternalIP", "address": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"},
                                 {"type": "InternalDNS", "address": name}, {"type": "Hostname", "address": name}],
                   "nodeInfo": {"machineID": f"{rng.getrandbits(128):032x}", "systemUUID": f"ec2{rng.getrandbits(116):029x}",
                                "bootID": f"{rng.getrandbits(128):032x}", "kernelVersion": "5.10.219-208.866.amzn2.x86_64",
                                "osImage": "Amazon Linux 2", "containerRuntimeVersion": "containerd://1.7.11",
                                "kubeletVersion": "v1.30.0-eks-036c24b", "kubeProxyVersion": "v1.30.0-eks-036c24b",
                                "operatingSystem": "linux", "architecture": "amd64"}},
    }


# -- the API server's own counters ---------------------------------------------------------------------

def scrape(plane: ControlPlane) -> dict[tuple[str, str, str], float]:
    """(metric, verb, resource) -> value for the response sizes and the request totals ("bytes",
    "requests"), and the requests answered 429 ("429")."""
    text = plane.admin_session().get(f"{plane.url}/metrics", timeout=30).text
    out: dict[tuple[str, str, str], float] = {}
    for metric, pattern in (("bytes", SIZE_METRIC), ("requests", REQUEST_METRIC)):
        for match in pattern.finditer(text):
            labels = dict(LABEL.findall(match.group("labels")))
            resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
            key = (metric, labels.get("verb", ""), resource)
            out[key] = out.get(key, 0.0) + float(match.group("value"))
            if metric == "requests" and labels.get("code") == "429":  # refused by API Priority and Fairness
                key = ("429", labels.get("verb", ""), resource)
                out[key] = out.get(key, 0.0) + float(match.group("value"))
    for match in WAIT_METRIC.finditer(text):  # time in API Priority and Fairness queues, by priority level
        labels = dict(LABEL.findall(match.group("labels")))
        key = (f"apf_wait_{match.group('part')}", labels.get("priority_level", ""), labels.get("flow_schema", ""))
        out[key] = out.get(key, 0.0) + float(match.group("value"))
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


# -- the bench's watch on the nodes ---------------------------------------------------------------------

class TaintWatch:
    """Every node change in the API server's order (a watch from a list's version): the effect of
    the agent's taint on each node after each change, and the most nodes taken out (NoExecute) at
    any moment."""

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane
        self._session = plane.admin_session()
        reply = self._session.get(f"{plane.url}/api/v1/nodes", params={"labelSelector": GPU_SELECTOR}, timeout=60)
        reply.raise_for_status()
        body = reply.json()
        self._version = body["metadata"]["resourceVersion"]
        self.effects = {n["metadata"]["name"]: _effect(n) for n in body["items"] if _effect(n)}
        self.most = len(self.taken_out)
        self._markers: set[str] = set()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="taint-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        params = {"watch": "true", "labelSelector": GPU_SELECTOR, "resourceVersion": self._version,
                  "timeoutSeconds": "600"}
        with self._session.get(f"{self._plane.url}/api/v1/nodes", params=params, stream=True, timeout=(10, 700)) as reply:
            for line in reply.iter_lines(chunk_size=None):
                if not line:
                    continue
                event = json.loads(line)
                node = event.get("object") or {}
                name = (node.get("metadata") or {}).get("name", "")
                with self._cond:
                    effect = "" if event.get("type") == "DELETED" else _effect(node)
                    if effect:
                        self.effects[name] = effect
                    else:
                        self.effects.pop(name, None)
                    self.most = max(self.most, len(self.taken_out))
                    marker = ((node.get("metadata") or {}).get("annotations") or {}).get("bench.healthagent.io/marker")
                    if marker:
                        self._markers.add(marker)
                        self._cond.notify_all()
                    if marker == "stop":
                        return

    def caught_up(self, name: str, marker: str) -> None:
        """Write an annotation on ``name`` and wait for it: the watch has then seen every earlier change."""
        self._session.patch(f"{self._plane.url}/api/v1/nodes/{name}", timeout=30,
                            headers={"Content-Type": "application/merge-patch+json"},
                            data=json.dumps({"metadata": {"annotations": {"bench.healthagent.io/marker": marker}}}))
        with self._cond:
            if not self._cond.wait_for(lambda: marker in self._markers, STEP_TIMEOUT):
                raise TimeoutError(f"the bench's watch did not deliver marker {marker}")

    def stop(self, name: str) -> None:
        self.caught_up(name, "stop")
        self._thread.join(30)

    @property
    def taken_out(self) -> set[str]:
        """The nodes with the agent's NoExecute (their pods evicted)."""
        return {name for name, effect in self.effects.items() if effect == "NoExecute"}

    @property
    def held(self) -> set[str]:
        """The nodes with the agent's NoSchedule only."""
        return {name for name, effect in self.effects.items() if effect == "NoSchedule"}


def _effect(node: dict) -> str:
    """The effect of the agent's taint on ``node`` ("" without one; NoExecute wins)."""
    effects = {t.get("effect") for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") == TAINT_KEY}
    return "NoExecute" if "NoExecute" in effects else next(iter(effects), "")


def slot_holders(plane: ControlPlane) -> set[str] | None:
    """The nodes the budget's slot Leases name as holders; None for a budget without slots."""
    reply = plane.admin_session().get(f"{plane.url}/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases",
                                      params={"labelSelector": "healthagent.io/budget=slot"}, timeout=60)
    reply.raise_for_status()
    items = reply.json().get("items") or []
    if not items:
        return None
    return {str(i["spec"]["holderIdentity"]) for i in items if (i.get("spec") or {}).get("holderIdentity")}


# -- one run -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    taken_out: int  # NoExecute at the end: exactly the budget
    most_taken_out: int  # the most NoExecute at any moment
    held: int  # NoSchedule only at the end: every other agent
    slot_holders: int | None  # None: a budget without slots
    holders_taken_out: bool | None  # the slot holders are exactly the nodes taken out
    bytes_per_decision: float
    requests_per_decision: dict[str, float]
    decision_seconds: list[float]
    list_get_bytes: dict[str, float]


def reset(plane: ControlPlane, names: list[str], bodies: dict[str, dict]) -> None:
    """The run's nodes as new objects, no Events, no budget slots (the shared count stays: a fleet
    that has been running has one)."""
    session = plane.admin_session()

    def renew(name: str) -> None:
        session.delete(f"{plane.url}/api/v1/nodes/{name}", timeout=60)
        reply = session.post(f"{plane.url}/api/v1/nodes", json=bodies[name], timeout=60)
        reply.raise_for_status()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(renew, names))
    session.delete(f"{plane.url}/apis/events.k8s.io/v1/namespaces/default/events", timeout=60)
    session.delete(f"{plane.url}/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases", timeout=60,
                   params={"labelSelector": "healthagent.io/budget=slot"})


def agents_for(plane: ControlPlane, names: list[str], budget: int, folder: Path) -> list:
    from healthagent.config import Settings
    from healthagent.effects.kube import NodeEffects
    from healthagent.effects.state import StateStore

    known = {f.name for f in dataclasses.fields(Settings)}
    agents = []
    for name in names:
        values = dict(node_name=name, kube="kubeconfig", kubeconfig="unused", state_file=str(folder / name / "state.json"),
                      budget_max_fraction=0.1, budget_max_nodes=budget, budget_node_selector=GPU_SELECTOR,
                      replace_noexecute_grace_seconds=0.0)
        if "budget_namespace" in known:
            values["budget_namespace"] = NAMESPACE
        settings = Settings(**values)
        store = StateStore(settings.state_file)
        store.load()
        agents.append(NodeEffects(settings, plane.api_client(), store, request_timeout=(10.0, 120.0)))
    return agents


def one_run(plane: ControlPlane, fleet: list[str], bodies: dict[str, dict], args: argparse.Namespace,
            rng: random.Random, verdict: Any, previous: list[str]) -> tuple[Run, list[str]]:
    names = rng.sample(fleet, args.agents)
    reset(plane, sorted(set(names) | set(previous)), bodies)
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as folder:
        agents = agents_for(plane, names, args.budget, Path(folder))
        for effects in agents:
            effects.startup(time.time(), "boot-1")
        deadline = time.monotonic() + STEP_TIMEOUT
        while not all(effects.watching for effects in agents) and time.monotonic() < deadline:
            time.sleep(0.05)
        watch = TaintWatch(plane)
        started = scrape(plane)
        barrier = threading.Barrier(len(agents))
        waits = [rng.uniform(0.0, args.spread) for _ in agents]

        def decide(index: int) -> float:
            barrier.wait()
            begin = time.monotonic()
            time.sleep(waits[index])
            agents[index].reconcile(verdict, time.time(), "boot-1")
            return time.monotonic() - begin - waits[index]

        with ThreadPoolExecutor(len(agents)) as pool:
            seconds = list(pool.map(decide, range(len(agents))))
        after = scrape(plane)
        watch.caught_up(fleet[0] if fleet[0] not in names else next(n for n in fleet if n not in names), "end")
        taken_out, held, most = len(watch.taken_out), len(watch.held), watch.most
        holders = slot_holders(plane)
        match = None if holders is None else holders == watch.taken_out
        watch.stop(next(n for n in fleet if n not in names))
        for effects in agents:
            effects.close()
    window = delta(after, started)
    sizes = {f"{verb} {resource}": value for (metric, verb, resource), value in window.items()
             if metric == "bytes" and verb in ("LIST", "GET")}
    requests: dict[str, float] = {}
    for (metric, verb, resource), value in window.items():
        if metric == "requests" and verb != "WATCH" and resource in AGENT_RESOURCES:
            requests[f"{verb} {resource}"] = value / args.agents
    run = Run(taken_out=taken_out, most_taken_out=most, held=held,
              slot_holders=None if holders is None else len(holders), holders_taken_out=match,
              bytes_per_decision=sum(sizes.values()) / args.agents,
              requests_per_decision=requests, decision_seconds=seconds,
              list_get_bytes=sizes)
    return run, names


def count_cost(plane: ControlPlane) -> float:
    """Bytes of the budget counter's one count (a paged Table without the objects)."""
    from healthagent.budget_counter import BudgetCounter
    from healthagent.effects.backend import ApiBackend

    before = scrape(plane)
    BudgetCounter(ApiBackend(plane.api_client(), ""), NAMESPACE, GPU_SELECTOR).round(time.time())
    return sum(v for (metric, verb, resource), v in delta(scrape(plane), before).items()
               if metric == "bytes" and verb == "LIST" and resource == "nodes")


def create_fleet(plane: ControlPlane, size: int, rng: random.Random) -> tuple[list[str], dict[str, dict]]:
    session = plane.admin_session()
    existing = session.get(f"{plane.url}/api/v1/nodes", params={"labelSelector": GPU_SELECTOR}, timeout=120).json()
    have = {n["metadata"]["name"] for n in existing["items"]}
    bodies = {node_name(i): realistic_node(i, rng) for i in range(size)}

    def create(name: str) -> None:
        if name not in have:
            session.post(f"{plane.url}/api/v1/nodes", json=bodies[name], timeout=60).raise_for_status()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, bodies))
    return list(bodies), bodies


def ensure_namespace(plane: ControlPlane) -> None:
    plane.admin_session().post(f"{plane.url}/api/v1/namespaces", json={"metadata": {"name": NAMESPACE}}, timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--budget", type=int, default=10)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--spread", type=float, default=0.05, help="agents fault within this many seconds")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    assets = find_assets()
    if assets is None:
        raise SystemExit(missing_reason())
    from tests.effects.helpers import XID95

    rng = random.Random(args.seed)
    print(machine())
    results: dict[int, dict] = {}
    with ControlPlane(assets) as plane:
        version = plane.admin_session().get(f"{plane.url}/version", timeout=10).json().get("gitVersion")
        print(f"kube-apiserver {version}; {args.agents} agents, budget {args.budget}, {args.runs} runs a size, "
              f"faults within {args.spread:.2f} s")
        ensure_namespace(plane)
        previous: list[str] = []  # the last run's nodes (a larger fleet holds the smaller one's nodes)
        for size in sorted(args.nodes):
            fleet, bodies = create_fleet(plane, size, rng)
            sample = len(json.dumps(plane.admin_session().get(f"{plane.url}/api/v1/nodes/{fleet[0]}", timeout=30).json()))
            count = count_cost(plane)
            runs = []
            for index in range(args.runs):
                run, previous = one_run(plane, fleet, bodies, args, rng, XID95, previous)
                runs.append(run)
                print(f"  {size} nodes, run {index + 1}: taken out {run.taken_out} (most at once "
                      f"{run.most_taken_out}), held at NoSchedule {run.held}, slot holders {run.slot_holders} "
                      f"(the nodes taken out: {run.holders_taken_out}), "
                      f"{run.bytes_per_decision / 1e3:,.1f} kB per decision", flush=True)
            results[size] = {"node_bytes": sample, "runs": [dataclasses.asdict(r) for r in runs], "count": count}
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def report(results: dict[int, dict], args: argparse.Namespace) -> None:
    rows = []
    for size, result in sorted(results.items()):
        runs = [Run(**r) for r in result["runs"]]
        seconds = [s for r in runs for s in r.decision_seconds]
        per_bytes = sorted(r.bytes_per_decision for r in runs)
        requests: dict[str, float] = {}
        for r in runs:
            for key, value in r.requests_per_decision.items():
                requests[key] = requests.get(key, 0.0) + value / len(runs)
        count = result["count"]
        holders = sorted({r.slot_holders for r in runs if r.slot_holders is not None})
        same = {r.holders_taken_out for r in runs if r.holders_taken_out is not None}
        rows.append([
            size, f"{result['node_bytes'] / 1e3:.1f} kB",
            f"{sorted({r.taken_out for r in runs})} / max at once {max(r.most_taken_out for r in runs)}",
            f"{sorted({r.held for r in runs})}",
            f"{holders}, the nodes taken out: {'every run' if same == {True} else 'NOT in every run'}" if holders else "-",
            f"{per_bytes[len(per_bytes) // 2] / 1e3:,.1f} kB ({per_bytes[0] / 1e3:,.1f}-{per_bytes[-1] / 1e3:,.1f})",
            f"{sum(requests.values()):.1f}",
            f"{percentile(seconds, 0.5) * 1000:.0f} / {percentile(seconds, 0.99) * 1000:.0f} ms",
            f"{count / 1e3:,.1f} kB" if count else "-",
        ])
        print(f"\n{size} nodes, requests per decision (mean of {len(runs)} runs):")
        print(table(["request", "per decision"], [[k, f"{v:.2f}"] for k, v in sorted(requests.items())]))
    print()
    print(table(["nodes", "Node object", f"taken out: NoExecute (budget {args.budget})", "held at NoSchedule",
                 "slot holders", "bytes per decision (median, range)",
                 "requests / decision", "decision p50 / p99", "GPU node count (once)"],
                rows))
    sizes = sorted(results)
    if len(sizes) >= 2:
        def median_bytes(size: int) -> float:
            values = sorted(r["bytes_per_decision"] for r in results[size]["runs"])
            return values[len(values) // 2]

        low, high = sizes[0], sizes[-1]
        slope = (median_bytes(high) - median_bytes(low)) / (high - low)
        print(f"\nbytes per decision grow by {slope:,.1f} B per node between {low} and {high} nodes; "
              f"at 10,000 nodes: {(median_bytes(high) + slope * (10_000 - high)) / 1e3:,.1f} kB per decision")
        if results[high]["count"]:
            per_node = results[high]["count"] / high
            print(f"the shared GPU node count: {per_node:,.0f} B per node, {per_node * 10_000 / 1e6:,.1f} MB at "
                  "10,000 nodes, once per 10 minutes at most")


if __name__ == "__main__":
    main()
