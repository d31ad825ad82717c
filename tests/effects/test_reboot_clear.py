"""reboot_node on a real kube-apiserver: NoExecute after the grace, and a taint that clears itself
only when the node reports a new boot id (``status.nodeInfo.bootID``, as the kubelet does after a
reboot) and no finding needs it. Never a replace_node taint, never a fault still open."""

from __future__ import annotations

import pytest

from healthagent.effects.node_desired import HEALTH_LABEL, TAINT_BOOT_ANNOTATION
from healthagent.effects.api_time import rfc3339
from healthagent.model import Action, Finding, Verdict
from tests.effects.helpers import T0, TAINT_KEY, start_effects
from tests.effects.test_eks_conditions import real_cluster, settings_on
from tests.support.clusters import READY

pytestmark = pytest.mark.integration

XID79_LINE = "NVRM: Xid (PCI:0000:29:00): 79, pid=0, name=(null), GPU has fallen off the bus."


def xid(n: int, action: Action) -> Finding:
    return Finding(code="GPU_XID", action=action, summary=f"XID {n}", evidence=XID79_LINE, next_steps="n",
                   pci_bus_id="0000:29:00.0", xids=(n,), first_seen=T0, last_seen=T0)


XID79 = Verdict.of([xid(79, Action.REBOOT_NODE)], T0)
XID94 = Verdict.of([xid(94, Action.REPLACE_NODE)], T0)
HEALTHY = Verdict.of([], T0)


@pytest.fixture
def cluster(control_plane, unique_name):
    made = real_cluster(control_plane, unique_name("reboot") + "-")
    yield made
    made.close()


def boot(cluster, name: str, boot_id: str) -> None:
    """What the kubelet reports about the boot it runs in."""
    cluster.update_node(name, lambda n: n["status"].setdefault("nodeInfo", {}).update(bootID=boot_id))


def effects_on(tmp_path, cluster, mode: str = "healthagent"):
    name = cluster.name(0)
    settings = settings_on(tmp_path, cluster, name, condition_vocabulary=mode)
    effects = start_effects(settings, cluster)
    effects.startup(T0 - 1, "boot-a")
    return effects


def ours(node: dict) -> list[tuple[str, str]]:
    return [(t["value"], t["effect"]) for t in node["spec"].get("taints") or [] if t["key"] == TAINT_KEY]


def condition(node: dict, ctype: str) -> dict:
    return next(c for c in node["status"]["conditions"] if c["type"] == ctype)


MODES = [("healthagent", "GpuHealthy", "GPU_XID"), ("eks", "AcceleratedHardwareReady", "NvidiaXID79Error")]


@pytest.mark.parametrize("mode,gpu_type,reason", MODES, ids=[m[0] for m in MODES])
def test_a_rebooted_node_with_no_finding_clears_reboot_node(tmp_path, cluster, mode, gpu_type, reason):
    name = cluster.name(0)
    boot(cluster, name, "boot-a")
    effects = effects_on(tmp_path, cluster, mode)
    effects.reconcile(XID79, T0, "boot-a")
    node = cluster.node(name)
    assert ours(node) == [("reboot_node", "NoSchedule")]
    assert node["metadata"]["annotations"][TAINT_BOOT_ANNOTATION] == "boot-a"
    effects.reconcile(XID79, T0 + 120, "boot-a")  # the grace is over: the job's pods leave the node
    node = cluster.node(name)
    assert ours(node) == [("reboot_node", "NoExecute")]
    gpu = condition(node, gpu_type)
    assert (gpu["status"], gpu["reason"]) == ("False", reason)

    # the finding is gone but the node never rebooted (a lost state file, say): the taint stays
    effects.reconcile(HEALTHY, T0 + 200, "boot-a")
    node = cluster.node(name)
    assert ours(node) == [("reboot_node", "NoExecute")]
    assert node["metadata"]["labels"][HEALTH_LABEL] == "reboot-required"
    assert (condition(node, gpu_type)["status"], condition(node, gpu_type)["reason"]) == ("False", "RebootPending")

    boot(cluster, name, "boot-b")  # the node rebooted: the kubelet reports a new boot id
    effects.reconcile(HEALTHY, T0 + 900, "boot-b")
    node = cluster.node(name)
    assert ours(node) == [] and TAINT_BOOT_ANNOTATION not in (node["metadata"].get("annotations") or {})
    assert node["metadata"]["labels"][HEALTH_LABEL] == "healthy"
    gpu = condition(node, gpu_type)
    assert (gpu["status"], gpu["reason"], gpu["lastTransitionTime"]) == ("True", "AllChecksPassed", rfc3339(T0 + 900))
    assert condition(node, "Ready") == READY
    assert [e["reason"] for e in cluster.events() if e["regarding"]["name"] == name].count("Cleared") == 1
    assert effects.errors == {}


def test_a_new_boot_never_clears_a_replace_taint_or_a_fault_still_open(tmp_path, cluster):
    name = cluster.name(0)
    boot(cluster, name, "boot-a")
    effects = effects_on(tmp_path, cluster)
    effects.reconcile(XID79, T0, "boot-a")
    boot(cluster, name, "boot-b")
    effects.reconcile(XID79, T0 + 300, "boot-b")  # XID 79 again after the reboot
    node = cluster.node(name)
    assert ours(node) == [("reboot_node", "NoExecute")]
    assert node["metadata"]["annotations"][TAINT_BOOT_ANNOTATION] == "boot-b"  # now it waits out boot-b
    effects.reconcile(XID94, T0 + 400, "boot-b")  # escalated to replace_node
    boot(cluster, name, "boot-c")
    effects.reconcile(HEALTHY, T0 + 900, "boot-c")
    node = cluster.node(name)
    assert [value for value, _ in ours(node)] == ["replace_node"]  # only an operator clears it
    assert node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    assert condition(node, "GpuHealthy")["status"] == "False"
    assert effects.errors == {}
