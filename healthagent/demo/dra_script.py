"""``healthagent demo --dra``: one bad GPU of eight quarantined alone, the node kept in the job.

The same agent as ``healthagent demo`` (``script.py`` starts it, the stub in NVML's place), with
the DRA layer around its effects (``dra/effects.py``) and no cluster: the DRA calls are a dry run
(``dra/dry_run.py``) over a ResourceSlice shaped as NVIDIA's DRA driver (v0.4.1) publishes the
node's eight GPUs, so each DeviceTaintRule is said, not written. The script:

1. the healthy node and its GPUs as the driver publishes them (``gpu.nvidia.com``, pool = node,
   ``gpu-<minor>``, with the GPU's UUID and PCI bus id);
2. XID 48 (an uncorrectable ECC error, NVIDIA's RESET_GPU bucket) on GPU 3 in the kernel log,
   with the volatile DBE count NVML reports going to 1, as the driver counts it;
3. the one DeviceTaintRule the agent would write for that device (NoSchedule, then NoExecute after
   the demo's 3 s grace), and no taint on the Node;
4. ``nvidia-smi -r -i 3``: the stub reports the volatile count back at 0, as a reset leaves it;
   the agent sees the reset through NVML, closes the GPU's findings and removes the rule;
5. what Prometheus scrapes: ``healthagent_gpu_quarantined`` while it stood, then nothing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from healthagent.demo import stub_nvml
from healthagent.demo.node import DemoNode, build_demo_root
from healthagent.demo.script import (DEMO_GRACE_SECONDS, Urls, demo_settings, first_cycle, keep_running,
                                     metrics_excerpt, running_agent, say, say_findings, say_scrape, wait_for)
from healthagent.dra.dry_run import DryRunDraApi
from healthagent.dra.effects import DraEffects
from healthagent.dra.slices import DRIVER_VERSION, NVIDIA_GPU_DRIVER, PCI_BUS_ID_ATTRIBUTE
from healthagent.policy.scope import ScopePolicy
from healthagent.wiring import AgentRuntime

DRA_XID = 48  # RESET_GPU: NVIDIA's workflow clears it with a GPU reset
NODE = "demo-p5-node"  # demo_settings' node name


def demo_slice(node_name: str, uuids: list[str], pci_bus_ids: list[str]) -> dict:
    """The node's GPUs as NVIDIA's DRA driver publishes them: one ResourceSlice of driver
    ``gpu.nvidia.com``, pool named after the node, a device ``gpu-<minor>`` per full GPU with the
    string attributes ``type``, ``uuid``, ``productName`` and ``resource.kubernetes.io/pciBusID``
    (the demo's GPUs' minor numbers are their indexes)."""
    def text(value: str) -> dict:
        return {"string": value}

    devices = [{"name": f"gpu-{i}", "attributes": {
        "type": text("gpu"), "uuid": text(uuid), "productName": text("NVIDIA H100 80GB HBM3"),
        "brand": text("Nvidia"), "architecture": text("Hopper"), "cudaComputeCapability": {"version": "9.0.0"},
        PCI_BUS_ID_ATTRIBUTE: text(pci)}} for i, (uuid, pci) in enumerate(zip(uuids, pci_bus_ids))]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node_name}-{NVIDIA_GPU_DRIVER}-demo"},
            "spec": {"driver": NVIDIA_GPU_DRIVER, "nodeName": node_name,
                     "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices}}


def say_rules(api: DryRunDraApi) -> None:
    """The DeviceTaintRules as the dry run would have them in the cluster now."""
    for name, body in sorted(api.written.items()):
        selector, taint = body["spec"]["deviceSelector"], body["spec"]["taint"]
        say(f"   DeviceTaintRule {name}: device {selector['driver']}/{selector['pool']}/{selector['device']}, "
            f"taint {taint['key']}={taint['value']}:{taint['effect']}")


def run_dra_demo(args: argparse.Namespace, tmp: Path) -> int:
    """The per-GPU quarantine on the p5.48xlarge-shaped node, with its host root under ``tmp``."""
    node = build_demo_root(tmp / "host")
    settings = demo_settings(node, tmp, args.listen)
    api = DryRunDraApi(NODE, [demo_slice(NODE, node.gpu_uuids, node.gpu_pci_bus_ids)])

    def wrap(effects: Any) -> DraEffects:
        return DraEffects(effects, api, ScopePolicy(), settings.taint_key, settings.replace_noexecute_grace_seconds)

    say("healthagent demo --dra: a p5.48xlarge-shaped node (8 x H100 answered by the stub NVML library the "
        "demo builds), its GPUs published by NVIDIA's DRA driver; Kubernetes in dry-run (no cluster: each "
        "DeviceTaintRule is said, not written)")
    with running_agent(node, settings, effects_wrap=wrap) as runtime:
        return _script(args, node, runtime, api)


def _script(args: argparse.Namespace, node: DemoNode, runtime: AgentRuntime, api: DryRunDraApi) -> int:
    agent = runtime.agent
    urls = Urls.of(runtime)
    if not first_cycle(agent):
        return 3
    say(f"\n1. Healthy start: {len(agent._latest_gpus())} GPUs; verdict = {agent.verdict.action.value}. "
        f"NVIDIA's DRA driver ({NVIDIA_GPU_DRIVER}, {DRIVER_VERSION}) publishes them in one ResourceSlice:")
    for i, (uuid, pci) in enumerate(zip(node.gpu_uuids, node.gpu_pci_bus_ids)):
        say(f"   {NVIDIA_GPU_DRIVER}/{NODE}/gpu-{i}  {uuid}  {pci}")
    urls.say_served()

    gpu, pci = args.gpu, node.gpu_pci_bus_ids[args.gpu]
    say(f"\n2. Fault: the driver logs XID {args.xid} (uncorrectable ECC error) on GPU {gpu} ({pci}) and NVML "
        "counts one volatile DBE")
    stub_nvml.set_gpu_field(node.scenario, gpu, "ecc_volatile_uncorrected", 1)
    node.inject_xid(gpu, args.xid)
    # Both reported: the XID from the kernel log, the DBE count from NVML's next read (once a second
    # in the demo); the reset below is seen against that read.
    if not wait_for(lambda: any(args.xid in f.xids for f in agent.verdict.findings)
                    and any(f.code == "GPU_ECC_DBE" for f in agent.verdict.findings), 10):
        say("   the agent did not report the XID and the DBE count within 10 s")
        return 3
    say_findings(agent.verdict)

    say("\n3. What the agent would write to Kubernetes (dry-run)")
    if not wait_for(lambda: bool(agent.kube_status.gpu_quarantines) and bool(api.written), 10):
        say("   no DeviceTaintRule within 10 s; see the log lines above")
        return 3
    say_rules(api)
    say("   NoSchedule now: new claims stay off that one GPU. NoExecute follows once the grace has passed "
        f"({DEMO_GRACE_SECONDS:g} s in the demo, 120 s by default), while the node holds a slot of the "
        "disruption budget (dry-run: always)")
    evicting = lambda: [row[3] for row in agent.kube_status.gpu_quarantines] == ["NoExecute"]  # noqa: E731
    if wait_for(evicting, DEMO_GRACE_SECONDS + 15):
        say_rules(api)
        say(f"   NoExecute now: the pods using GPU {gpu} are evicted (their claims go elsewhere) so it can be reset")
    else:
        say(f"   no NoExecute within {DEMO_GRACE_SECONDS + 15:g} s; see the log lines above")
    say(f"   Node taint: {agent.kube_status.taint_effect or 'none'}: the node stays in the job, its other "
        f"{len(node.gpu_uuids) - 1} GPUs keep working")
    say_scrape(runtime, urls, lambda line: line.startswith("healthagent_gpu_quarantine"))

    say(f"\n4. The GPU is reset (nvidia-smi -r -i {gpu}): NVML reports its volatile DBE count back at 0")
    started = time.monotonic()
    stub_nvml.set_gpu_field(node.scenario, gpu, "ecc_volatile_uncorrected", 0)
    lifted = wait_for(lambda: not agent.kube_status.gpu_quarantines and not api.written
                      and not any(f.pci_bus_id == pci for f in agent.verdict.findings), 15)
    if not lifted:
        say("   the quarantine was not lifted within 15 s; see the log lines above")
        return 3
    say(f"   reset seen through NVML in {(time.monotonic() - started) * 1000:.0f} ms: GPU {gpu}'s findings "
        f"closed, DeviceTaintRule removed; verdict = {agent.verdict.action.value}")
    wait_for(lambda: (snapshot := runtime.telemetry.snapshot) is not None and snapshot.kube == agent.kube_status, 10)
    left = metrics_excerpt(urls.metrics, lambda line: line.startswith("healthagent_gpu_quarantined"))
    say("   " + ("\n   ".join(left) if left else "no healthagent_gpu_quarantined series now: no GPU is quarantined"))
    if args.keep_running:
        keep_running(runtime, urls)
    return 0
