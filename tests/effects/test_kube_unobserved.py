"""What the verdict could not see (``Verdict.unobserved``) is reported as unknown, never healthy.

NodeEffects against the fake API server: an unobserved subsystem makes its condition ``Unknown``
and the health label ``unknown``; it never taints, never asks the budget, never removes a reboot
or replace taint whose finding it can no longer see, and never sends a ``Cleared`` Event.
"""

import pytest

from healthagent.effects.node_desired import HEALTH_LABEL
from healthagent.model import Action, SourceHealth
from tests.effects.helpers import (
    HEALTHY,
    T0,
    XID95,
    condition,
    finding,
    our_taints,
    started,
    verdict,
)

pytestmark = pytest.mark.integration

NODE = "gpu-node-0"
NVML_DOWN = SourceHealth(source="nvml", up=False, detail="nvmlInit: Driver Not Loaded")
EFA_DOWN = SourceHealth(source="efa", up=False, detail="/sys/class/infiniband: Permission denied")
KMSG_UP = SourceHealth(source="kmsg", up=True, detail="reading /dev/kmsg")


@pytest.fixture
def cluster(fake):
    fake.seed_nodes(20)
    return fake


def conditions(node):
    return {c["type"]: (c["status"], c["reason"]) for c in node["status"]["conditions"]
            if c["type"] in ("GpuHealthy", "NetworkHealthy")}


def budget_lists(fake):
    """The budget saying yes: a slot taken or kept in this node's name (effects/budget.py)."""
    return [r for r in fake.writes("/apis/coordination.k8s.io/")
            if ((r.body or {}).get("metadata") or {}).get("name", "").startswith("healthagent-budget-slot-")
            and ((r.body or {}).get("spec") or {}).get("holderIdentity") == NODE]


def test_gpus_not_observed_are_unknown_not_healthy(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    blind = verdict(unobserved=("gpu",))
    status = effects.reconcile(blind, T0, "boot-1", health=(NVML_DOWN, KMSG_UP))
    node = cluster.node(NODE)
    assert conditions(node) == {"GpuHealthy": ("Unknown", "GpuNotObserved"),
                                "NetworkHealthy": ("True", "AllChecksPassed")}
    message = condition(node, "GpuHealthy")["message"]
    assert "nvml: nvmlInit: Driver Not Loaded" in message and "unknown" in message
    assert node["metadata"]["labels"][HEALTH_LABEL] == "unknown"
    assert our_taints(node) == [] and cluster.events() == [] and budget_lists(cluster) == []
    assert status.pending_writes == 0 and not status.budget_blocked
    # the source's detail changes every cycle; the condition is not re-written for it
    cluster.reset_log()
    other = SourceHealth(source="nvml", up=False, detail="collect hung for 17 s")
    effects.reconcile(blind, T0 + 61, "boot-1", health=(other,))
    assert cluster.writes() == []
    # seen again: healthy, with no Cleared Event (nothing was cleared)
    effects.reconcile(HEALTHY, T0 + 70, "boot-1", health=(KMSG_UP,))
    node = cluster.node(NODE)
    assert conditions(node)["GpuHealthy"] == ("True", "AllChecksPassed")
    assert node["metadata"]["labels"][HEALTH_LABEL] == "healthy" and cluster.events() == []


def test_without_the_sources_health_the_message_is_generic(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(unobserved=("efa",)), T0, "boot-1")
    node = cluster.node(NODE)
    assert conditions(node) == {"GpuHealthy": ("True", "AllChecksPassed"),
                                "NetworkHealthy": ("Unknown", "NetworkNotObserved")}
    assert condition(node, "NetworkHealthy")["message"] == (
        "the agent cannot observe the EFA devices (no source answered); their health is unknown, not healthy")
    assert node["metadata"]["labels"][HEALTH_LABEL] == "unknown"


@pytest.mark.parametrize("unobserved,words", [
    (("rdma",), ["InfiniBand/RoCE ports (rdma: /sys/class/infiniband/mlx5_0: Input/output error)"]),
    (("efa", "rdma"), ["EFA devices", "InfiniBand/RoCE ports"]),
])
def test_infiniband_ports_not_observed_make_the_networking_condition_unknown(tmp_path, cluster, unobserved, words):
    """InfiniBand and RoCE ports share the networking condition with EFA: ports nobody could read
    are unknown there, never healthy, and when both are unseen one condition says both."""
    rdma_down = SourceHealth(source="rdma", up=False, detail="/sys/class/infiniband/mlx5_0: Input/output error")
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(unobserved=unobserved), T0, "boot-1", health=(rdma_down,))
    node = cluster.node(NODE)
    assert conditions(node) == {"GpuHealthy": ("True", "AllChecksPassed"),
                                "NetworkHealthy": ("Unknown", "NetworkNotObserved")}
    message = condition(node, "NetworkHealthy")["message"]
    assert all(w in message for w in words), message
    assert node["metadata"]["labels"][HEALTH_LABEL] == "unknown" and our_taints(node) == []


def test_an_open_finding_outranks_unobserved(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(finding(), unobserved=("efa", "kernel_log")), T0, "boot-1", health=(EFA_DOWN,))
    node = cluster.node(NODE)
    assert conditions(node) == {"GpuHealthy": ("False", "GPU_XID"), "NetworkHealthy": ("Unknown", "NetworkNotObserved")}
    assert "Permission denied" in condition(node, "NetworkHealthy")["message"]
    assert node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    assert [t["value"] for t in our_taints(node)] == ["replace_node"]


@pytest.mark.parametrize("label,shown", [
    (("kernel_log",), "unknown"),
    ((), "healthy"),
])
def test_the_label_is_unknown_when_anything_is_unobserved_and_nothing_worse_applies(tmp_path, cluster, label, shown):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(unobserved=label), T0, "boot-1")
    node = cluster.node(NODE)
    assert node["metadata"]["labels"][HEALTH_LABEL] == shown
    assert conditions(node) == {"GpuHealthy": ("True", "AllChecksPassed"), "NetworkHealthy": ("True", "AllChecksPassed")}


def test_degraded_outranks_unknown(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(finding("GPU_THERMAL_THROTTLE", Action.MONITOR, xids=()), unobserved=("efa",)),
                      T0, "boot-1")
    assert cluster.node(NODE)["metadata"]["labels"][HEALTH_LABEL] == "degraded"


REMAP_PENDING = finding("GPU_ROW_REMAP_PENDING", Action.REBOOT_NODE, xids=())
EFA_STUCK = finding("EFA_ADMIN_QUEUE_STUCK", Action.REBOOT_NODE, pci="", efa="rdmap79s0", xids=())
SXID = finding("NVSWITCH_SXID", Action.REBOOT_NODE, pci="0000:05:00.0", xids=(20034,))


@pytest.mark.parametrize("fault,unobserved,held", [
    (REMAP_PENDING, ("gpu",), True),  # after the reboot the driver does not answer: not a recovery
    (REMAP_PENDING, ("efa", "kernel_log"), False),  # the GPUs are seen, and healthy
    (EFA_STUCK, ("efa",), True),
    (EFA_STUCK, ("gpu",), False),
    (SXID, ("kernel_log",), True),
    (SXID, ("gpu",), False),
], ids=["gpu-blind", "gpu-seen", "efa-blind", "efa-seen", "sxid-blind", "sxid-seen"])
def test_a_reboot_taint_stays_while_its_finding_cannot_be_seen(tmp_path, cluster, fault, unobserved, held):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(fault), T0, "boot-1")
    assert [t["value"] for t in our_taints(cluster.node(NODE))] == ["reboot_node"]
    lists = len(budget_lists(cluster))
    # rebooted; the policy dropped the finding, but part of the node cannot be observed
    status = effects.reconcile(verdict(unobserved=unobserved), T0 + 600, "boot-2")
    node = cluster.node(NODE)
    reasons = sorted(e["reason"] for e in cluster.events())
    if held:  # past its grace, with the slot it took at T0: NoExecute, as any reboot taint
        assert [(t["value"], t["effect"]) for t in our_taints(node)] == [("reboot_node", "NoExecute")]
        assert node["metadata"]["labels"][HEALTH_LABEL] == "reboot-required"
        assert status.taint_effect == "NoExecute" and reasons == [fault.code]  # no Cleared Event
    else:
        assert our_taints(node) == [] and node["metadata"]["labels"][HEALTH_LABEL] == "unknown"
        assert reasons == sorted(["Cleared", fault.code])
    # the budget is not asked either way; the held node's step confirms the slot it holds by a write
    assert len(budget_lists(cluster)) == lists + int(held)
    # seen again and healthy: the taint clears as after any reboot
    effects.reconcile(HEALTHY, T0 + 700, "boot-2")
    assert our_taints(cluster.node(NODE)) == []
    assert sorted(e["reason"] for e in cluster.events()) == sorted(["Cleared", fault.code])


def test_a_held_reboot_taint_gets_the_unknown_condition(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(REMAP_PENDING), T0, "boot-1")
    effects.reconcile(verdict(unobserved=("gpu",)), T0 + 600, "boot-2", health=(NVML_DOWN,))
    assert conditions(cluster.node(NODE))["GpuHealthy"] == ("Unknown", "GpuNotObserved")


def test_a_replace_taint_stays_and_says_replace_pending(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(XID95, T0, "boot-1")
    effects.reconcile(verdict(unobserved=("gpu",)), T0 + 10, "boot-1", health=(NVML_DOWN,))
    node = cluster.node(NODE)
    assert [t["value"] for t in our_taints(node)] == ["replace_node"]
    assert conditions(node)["GpuHealthy"] == ("False", "ReplacePending")
    assert node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    assert [e["reason"] for e in cluster.events()] == ["GPU_XID"]


def test_unobserved_never_taints_a_node(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    status = effects.reconcile(verdict(unobserved=("gpu", "efa", "kernel_log")), T0, "boot-1")
    assert our_taints(cluster.node(NODE)) == [] and status.taint_effect == ""
    assert budget_lists(cluster) == [] and cluster.events() == []


def test_a_held_reboot_taint_removed_by_hand_is_an_operator_clear(tmp_path, cluster):
    effects = started(tmp_path, cluster)
    effects.reconcile(verdict(REMAP_PENDING), T0, "boot-1")
    blind = verdict(unobserved=("gpu",))
    effects.reconcile(blind, T0 + 600, "boot-2")
    cluster.update_node(NODE, lambda n: n["spec"].update(taints=[]))  # kubectl taint node ... -
    status = effects.reconcile(blind, T0 + 700, "boot-2")
    token = f"taint-removed-{int(T0 + 700)}"
    assert status.clear_pending == token
    assert our_taints(cluster.node(NODE)) == []  # not put back
    assert effects.reconcile(blind, T0 + 750, "boot-2").taint_effect == ""  # while policy catches up
    after = verdict(unobserved=("gpu",), clear_token=token)
    assert effects.reconcile(after, T0 + 800, "boot-2").taint_effect == ""
