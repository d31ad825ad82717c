"""NVML goes wrong: the library is missing, a GPU answers GPU_IS_LOST in the middle of a collection,
a GPU vanishes from the device count.

NVML is the real ``nvidia-ml-py`` bindings against the stub ``libnvidia-ml.so.1`` (compiled with
``cc``; the demo node's scenario file is its state). The missing library runs the real
``healthagent run`` in a subprocess where no ``libnvidia-ml.so.1`` exists at all (this test process
may already hold the stub).
"""

from __future__ import annotations

import ctypes.util
import threading

import pytest

from tests.reliability.helpers import NODE, alive, events_by_reason, our_taints, scrape, wait_metric, wait_warm
from tests.support.live_agent import AgentProcess, wait_until, write_kubeconfig

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

FAST = dict(nvml="true", expected_gpus=8, nvml_interval_seconds=0.05, efa_interval_seconds=0.2)
LOST = 5


def test_gpu_is_lost_in_the_middle_of_a_collection(needs_cc, fake, demo, start_agent, monkeypatch):
    import pynvml

    from healthagent.demo import stub_nvml

    real_power = pynvml.nvmlDeviceGetPowerUsage
    armed, fired = threading.Event(), threading.Event()

    def power_usage(handle):
        """GPU 5 falls off the bus after its identity and ECC/remap/retired-page reads succeeded,
        just before its power reading, in the middle of the agent's collection."""
        if armed.is_set() and not fired.is_set() and pynvml.nvmlDeviceGetIndex(handle) == LOST:
            stub_nvml.set_gpu_lost(demo.scenario, LOST)
            pynvml.nvmlDeviceGetCount()  # a call that makes the stub re-read its scenario now
            fired.set()
        return real_power(handle)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", power_usage)
    runtime = start_agent(**FAST)
    wait_warm(runtime)
    uuid = next(g.uuid for g in runtime.agent._latest_gpus() if g.index == LOST)
    armed.set()
    assert fired.wait(60)
    lost = wait_metric(runtime, lambda s: s.total("healthagent_gpu_up", gpu=str(LOST)) == 0
                       and s.value("healthagent_findings", code="GPU_LOST", action="reboot_node") == 1,
                       "GPU 5 lost in the metrics")
    assert lost.value("healthagent_gpu_up", gpu=str(LOST), uuid=uuid, pci_bus_id=demo.gpu_pci_bus_ids[LOST]) == 0
    assert lost.total("healthagent_gpu_up") == 7  # the other seven still read
    assert lost.value("healthagent_source_errors_total", source="nvml", kind="lost") == 1
    wait_until(lambda: our_taints(fake) == [("reboot_node", "NoSchedule")], what="the reboot_node taint")

    # NVML keeps working for the other GPUs: an XID event on GPU 2 still arrives through it.
    stub_nvml.inject_xid(demo.scenario, 2, 13)
    cycles = runtime.agent.cycles
    after = wait_metric(runtime, lambda s: s.total("healthagent_xid_errors_total", gpu="2", xid="13") == 1,
                        "the NVML XID on GPU 2")
    wait_until(lambda: runtime.agent.cycles > cycles + 20, what="twenty more cycles")
    later = scrape(runtime)
    assert later.value("healthagent_source_errors_total", source="nvml", kind="lost") == 1  # once per episode
    assert later.total("healthagent_gpu_up", gpu=str(LOST)) == 0
    assert after.value("healthagent_source_up", source="nvml") == 1
    assert events_by_reason(fake).get("GPU_LOST") == 1
    assert our_taints(fake) == [("reboot_node", "NoSchedule")]
    assert alive(runtime)


def test_a_gpu_vanishes_from_the_device_count(needs_cc, fake, demo, start_agent):
    from healthagent.demo import stub_nvml

    runtime = start_agent(**FAST)
    wait_warm(runtime)
    gpus = {g.index: g for g in runtime.agent._latest_gpus()}
    assert len(gpus) == 8
    stub_nvml.remove_gpu(demo.scenario, 3)  # the GPUs after it move down one index, as NVML enumerates
    gone = wait_metric(runtime, lambda s: s.value("healthagent_source_errors_total", source="nvml",
                                                  kind="vanished") == 1, "the vanished GPU counted")
    assert gone.value("healthagent_gpu_up", gpu="3", uuid=gpus[3].uuid, pci_bus_id=gpus[3].pci_bus_id) == 0
    assert gone.value("healthagent_gpus_expected") == 8
    wait_until(lambda: our_taints(fake) == [("reboot_node", "NoSchedule")], what="the reboot_node taint")

    # The GPU that was index 5 is index 4 now; its kernel-log XID still lands on it (by PCI id).
    demo.inject_xid(5, 31)
    moved = wait_metric(runtime, lambda s: s.total("healthagent_xid_errors_total", xid="31") == 1, "the XID")
    assert moved.value("healthagent_xid_errors_total", gpu="4", uuid=gpus[5].uuid, xid="31") == 1
    findings = {s.labels["code"] for s in moved.samples if s.name == "healthagent_findings" and s.value > 0}
    assert {"GPU_LOST", "GPU_MISSING"} & findings
    reasons = events_by_reason(fake)
    assert all(count == 1 for count in reasons.values()), reasons
    assert alive(runtime)


def test_no_nvml_library_at_all(fake, demo, tmp_path):
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a libnvidia-ml: the library is not missing here")
    demo.scenario.unlink()  # without its scenario the demo root is a node with no NVIDIA driver
    agent = AgentProcess(dict(host_root=demo.root, kube="kubeconfig", node_name=NODE,
                              kubeconfig=write_kubeconfig(fake.url, tmp_path / "kubeconfig"),
                              state_file=tmp_path / "state.json", expected_efa_devices=32),
                         tmp_path / "agent.log")
    try:
        down = agent.wait_metric(lambda s: s.value("healthagent_source_up", source="nvml") == 0
                                 and s.value("healthagent_kube_reachable") == 1, what="NVML down, API up")
        assert down.value("healthagent_source_errors_total", source="nvml", kind="unavailable") >= 1
        assert down.total("healthagent_gpu_up") == 0 and down.value("healthagent_efa_devices") == 32
        demo.inject_xid(3, 95)  # the kernel log still reports, and it is enough to act on
        wait_until(lambda: our_taints(fake) == [("replace_node", "NoSchedule")], what="the taint")
        after = agent.wait_metric(lambda s: s.value("healthagent_xid_errors_total", gpu="", uuid="", xid="95") == 1,
                                  what="the XID counted")
        assert after.value("healthagent_node_action", action="replace_node") == 1
        wait_until(lambda: events_by_reason(fake) == {"GPU_XID": 1}, what="one Event")
        assert "libnvidia-ml.so.1 not found" in agent.log()
        assert agent.proc.poll() is None
    finally:
        agent.close()
