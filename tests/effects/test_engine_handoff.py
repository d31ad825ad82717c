"""What the replacement engines read, held to their contracts on the fake and a real API server.

Karpenter's node repair and EKS node auto repair act on a condition's type and status, timed from
its ``lastTransitionTime``; SageMaker HyperPod acts on its node-health-status label; the job's pods
leave with the agent's ``NoExecute``. So once the agent has asked for a repair, a more severe
verdict must never take the request back: the condition stays ``False`` with one transition time,
``NoExecute`` stays with its ``timeAdded``, and a replacement is never downgraded to a reboot.
A poller reads the node every 0.5 s while the effects step through the escalation, so an
intermediate write (a node patch landed, the status patch not yet) would be seen too.
Karpenter v1.14.1 and v1.15.0 alike time repair from ``lastTransitionTime`` (v1.15.0 then waits for
the NodePool's budget and picks reboot or replacement by the reason: test_engine_contracts_v115.py),
so these invariants hold for both.
"""

from __future__ import annotations

import threading
import time

import pytest

from healthagent.effects.hyperpod import (
    HYPERPOD_FAULT_REASONS_LABEL,
    HYPERPOD_FAULT_TYPES_LABEL,
    HYPERPOD_HEALTH_LABEL,
    HYPERPOD_PENDING_REPLACEMENT,
)
from healthagent.model import Action, Verdict
from tests.effects.helpers import T0, TAINT_KEY
from tests.effects.test_scenarios import (  # noqa: F401 (cluster, fake_or_none: fixtures)
    XID79_LINE,
    XID94_LINE,
    cluster,
    effects_for,
    events_about,
    fake_or_none,
    no_internal_errors,
    ours,
    xid_finding,
)

pytestmark = pytest.mark.integration

PCI = "0000:29:00.0"
XID79 = Verdict.of([xid_finding(79, Action.REBOOT_NODE, PCI, XID79_LINE)], T0)
# The same incident on the same GPU, escalated by XID 94: one finding, now replace_node.
ESCALATED = Verdict.of([xid_finding(94, Action.REPLACE_NODE, PCI, XID94_LINE)], T0 + 130)
GRACE = 120.0


class NodePoller:
    """Reads the node every 0.5 s on a thread of its own and keeps what each read showed."""

    def __init__(self, cluster, name: str, gpu_type: str) -> None:
        self.cluster, self.name, self.gpu_type = cluster, name, gpu_type
        self.seen: list[tuple] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def look(self) -> tuple:
        node = self.cluster.node(self.name)
        cond = next((c for c in node["status"].get("conditions") or [] if c["type"] == self.gpu_type), {})
        taints = tuple((t["value"], t["effect"], t.get("timeAdded")) for t in ours(node))
        return cond.get("status"), cond.get("lastTransitionTime"), taints

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.append(self.look())
            self._stop.wait(0.5)

    def __enter__(self) -> "NodePoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.parametrize("vocab,gpu_type,reasons", [
    ("eks", "AcceleratedHardwareReady", ("NvidiaXID79Error", "NvidiaXID94Error")),
    ("healthagent", "GpuHealthy", ("GPU_XID", "GPU_XID")),
])
def test_an_escalation_never_takes_the_repair_request_back(tmp_path, cluster, vocab, gpu_type, reasons):  # noqa: F811
    name = cluster.name(0)
    effects, _ = effects_for(tmp_path, cluster, condition_vocabulary=vocab, replace_noexecute_grace_seconds=GRACE)
    effects.reconcile(XID79, T0, "boot-1")
    status = effects.reconcile(XID79, T0 + GRACE, "boot-1")
    assert status.taint_effect == "NoExecute"
    node = cluster.node(name)
    first = next(c for c in node["status"]["conditions"] if c["type"] == gpu_type)
    assert (first["status"], first["reason"]) == ("False", reasons[0])
    (taint,) = ours(node)
    asked = ("False", first["lastTransitionTime"], (("reboot_node", "NoExecute", taint["timeAdded"]),))
    with NodePoller(cluster, name, gpu_type) as poller:
        for now in (T0 + 130, T0 + 131, T0 + 130 + GRACE / 2, T0 + 130 + GRACE, T0 + 600):
            effects.reconcile(ESCALATED, now, "boot-1")
            poller.seen.append(poller.look())
    escalated = ("False", first["lastTransitionTime"], (("replace_node", "NoExecute", taint["timeAdded"]),))
    assert set(poller.seen) <= {asked, escalated}, set(poller.seen) - {asked, escalated}
    assert poller.seen[-1] == escalated
    last = next(c for c in cluster.node(name)["status"]["conditions"] if c["type"] == gpu_type)
    assert last["reason"] == reasons[1] and "XID 94" in last["message"]
    escalations = [e for e in events_about(cluster, name) if e["action"] == "Escalated"]
    assert len(escalations) == 1 and "escalated from reboot_node to replace_node" in escalations[0]["note"]
    no_internal_errors(effects)


def test_hyperpods_own_replacement_is_kept_over_the_agents_reboot(tmp_path, cluster):  # noqa: F811
    """HyperPod's health agent labelled the node for replacement (with its fault labels); an XID 79
    that the agent answers with reboot_node must not downgrade it, nor take it back afterwards."""
    name = cluster.name(0)
    theirs = {HYPERPOD_HEALTH_LABEL: HYPERPOD_PENDING_REPLACEMENT, HYPERPOD_FAULT_TYPES_LABEL: "Gpu",
              HYPERPOD_FAULT_REASONS_LABEL: "NvidiaErrorTerminal"}
    cluster.update_node(name, lambda n: n["metadata"]["labels"].update(theirs))
    effects, _ = effects_for(tmp_path, cluster, hyperpod_labels=True)
    for now in (T0, T0 + GRACE, T0 + GRACE + 5):
        effects.reconcile(XID79, now, "boot-1")
    node = cluster.node(name)
    assert [(t["value"], t["effect"]) for t in ours(node)] == [("reboot_node", "NoExecute")]
    labels = node["metadata"]["labels"]
    assert {k: labels.get(k) for k in theirs} == theirs
    kept = [e for e in events_about(cluster, name) if e["reason"] == "HyperPodRequestKept"]
    assert len(kept) == 1 and HYPERPOD_PENDING_REPLACEMENT in kept[0]["note"]
    # the node rebooted and the checks pass: the agent's taint goes, HyperPod's request stays
    cluster.update_node(name, lambda n: n["status"].setdefault("nodeInfo", {}).update({"bootID": "boot-2"}))
    effects.reconcile(Verdict.of([], T0 + 900), T0 + 900, "boot-2")
    node = cluster.node(name)
    assert ours(node) == [] and {k: node["metadata"]["labels"].get(k) for k in theirs} == theirs
    no_internal_errors(effects)


NMA_MANAGER = "eks-node-monitoring-agent"


class MonitoringAgent:
    """Writes ``AcceleratedHardwareReady=True`` as the EKS node monitoring agent does: a JSON merge
    patch of the whole conditions list on ``/status``, under its own field manager, its reason
    ``NvidiaGPUIsReady``, a fresh ``lastHeartbeatTime`` each write."""

    def __init__(self, cluster, name: str) -> None:
        self.cluster, self.name = cluster, name
        self.writes = 0

    def write(self) -> None:
        from healthagent.effects.api_time import rfc3339

        self.writes += 1
        stamp = rfc3339(T0 + self.writes)
        mine = {"type": "AcceleratedHardwareReady", "status": "True", "reason": "NvidiaGPUIsReady",
                "message": "Monitoring for the Nvidia GPU system is active", "lastHeartbeatTime": stamp,
                "lastTransitionTime": rfc3339(T0)}
        node = self.cluster.node(self.name)
        conditions = [c for c in node["status"]["conditions"] if c["type"] != mine["type"]] + [mine]
        if self.cluster.kind == "real":
            from kubernetes import client

            client.CoreV1Api(self.cluster.api_client()).patch_node_status(
                self.name, {"status": {"conditions": conditions}}, field_manager=NMA_MANAGER,
                _content_type="application/merge-patch+json")
            time.sleep(1.05)  # managedFields times have one-second resolution: one write, one time
        else:
            self.cluster.update_node(self.name, lambda n: n["status"].update(conditions=conditions))


def test_the_condition_is_taken_back_once_the_monitoring_agent_stops_writing(tmp_path, cluster):  # noqa: F811
    """While the monitoring agent writes the condition (every 5 s here), the agent leaves it alone
    and still taints; once it stops, the agent owns the condition again within 5 minutes, with no
    restart and no hand edit, says so in one Event, and asks for the repair."""
    name = cluster.name(0)
    nma = MonitoringAgent(cluster, name)
    nma.write()
    effects, _ = effects_for(tmp_path, cluster, condition_vocabulary="eks", replace_noexecute_grace_seconds=0.0)
    fault = Verdict.of([xid_finding(94, Action.REPLACE_NODE, "0000:53:00.0", XID94_LINE)], T0)
    now = T0
    while now < T0 + 30:  # it writes every 5 s: the agent leaves AcceleratedHardwareReady to it
        effects.reconcile(fault, now, "boot-1")
        gpu = next(c for c in cluster.node(name)["status"]["conditions"] if c["type"] == "AcceleratedHardwareReady")
        assert gpu["reason"] == "NvidiaGPUIsReady", now - T0
        nma.write()
        now += 5
    stopped = now
    assert [(t["value"], t["effect"]) for t in ours(cluster.node(name))] == [("replace_node", "NoExecute")]
    taken = None
    while now <= stopped + 300:
        effects.reconcile(fault, now, "boot-1")
        gpu = next(c for c in cluster.node(name)["status"]["conditions"] if c["type"] == "AcceleratedHardwareReady")
        if gpu["reason"] != "NvidiaGPUIsReady":
            taken = now
            break
        now += 5
    assert taken is not None, "the agent never took the condition back"
    assert stopped + 60 <= taken <= stopped + 300  # quiet for three of its 5 s gaps, at least a minute
    assert (gpu["status"], gpu["reason"]) == ("False", "NvidiaXID94Error")
    said = {e["reason"] for e in events_about(cluster, name)}
    assert {"ConditionOwnedElsewhere", "ConditionTakenBack"} <= said
    # it comes back: the agent steps back again at once
    nma.write()
    effects.reconcile(fault, now + 5, "boot-1")
    effects.reconcile(fault, now + 10, "boot-1")
    gpu = next(c for c in cluster.node(name)["status"]["conditions"] if c["type"] == "AcceleratedHardwareReady")
    assert gpu["reason"] == "NvidiaGPUIsReady"
    no_internal_errors(effects)
