"""``healthagent demo --fabric ib``: the real agent on the InfiniBand demo node through a port going down.

The same agent as ``healthagent demo`` (``script.py`` starts it the same way, Kubernetes in
dry-run), on a DGX H100-shaped node (``ib_node.py``): 8 x H100, eight NDR InfiniBand ports, one
behind each GPU's PCIe switch, and two RoCE ports for storage, no EFA. The scripted fault is an
everyday one on InfiniBand nodes: a cable or a transceiver fails, and the port's sysfs files read
``1: DOWN`` / ``2: Polling``, and the adapter's driver logs the cable unplugged (an informational
event, action none: counted in ``healthagent_mlx5_events_total`` and opening no finding; the port
going down is what takes the node out). What the demo prints is read back from the running agent:
the ports it read, its verdict, the node condition and taints the effects wrote (dry-run logs each
write, and the demo reads the condition from that record) and its ``/metrics``.

The port-down rule judges only a port it has seen up (an unused port is never "down"), so the
demo waits until the agent has published a reading of every port up before pulling the cable. The
rule waits until a port has been down for 30 s by default, and judges nothing within 5 min of a
boot; the demo's policy file turns both off (the demo node's boot is this machine's, which may be
recent) and the ports are read twice a second, so the port-down shows within half a second, as
the default demo's 3 s grace stands for 120 s. The demo says what the defaults are as it goes.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from healthagent.demo.ib_node import UNPLUGGED, IbDemoNode, build_ib_demo_root
from healthagent.demo.rdma_tree import DOWN, POLLING
from healthagent.demo.script import (Urls, demo_settings, first_cycle, keep_running, running_agent, say,
                                     say_findings, say_scrape, take_out, wait_for)
from healthagent.effects.conditions import vocabulary
from healthagent.model import AgentSnapshot
from healthagent.policy.debounce import row

if TYPE_CHECKING:
    from healthagent.wiring import AgentRuntime

CODE = "RDMA_PORT_DOWN"
DEMO_NODE = "demo-dgx-node"
READ_SECONDS = 0.5  # the ports' reading interval in the demo; 10 s by default
POLICY = f"""\
# healthagent demo --fabric ib: {CODE} opens as soon as a port that was up reads down (by default
# once it has been down for 30 s, and not within 5 min of a boot), so the demo's port-down shows at once.
findings:
  {CODE}: {{sustain: 0, after_boot_grace: 0}}
"""
# What step 4 shows of the port that went down and its adapter's kernel-log events (every other
# port's lines look like its own did).
PORT_FAMILIES = tuple(f"healthagent_infiniband_{name}" for name in (
    "port_up", "state_id", "physical_state_id", "link_downed_total", "port_gpu_info")) + (
    "healthagent_mlx5_events_total",)
EFFECTS_LOG = "healthagent.effects.backend"


@dataclass(frozen=True)
class ConditionWrite:
    """One node condition as the effects wrote it."""

    type: str
    status: str
    reason: str
    message: str


class ConditionWrites(logging.Handler):
    """The node conditions the effects write, from dry-run's record of each write: what the demo
    says about a condition is what the agent wrote, not what the demo expects it to."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.latest: dict[str, ConditionWrite] = {}  # by condition type; replaced whole per write

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if str(record.msg).startswith("dry_run=1 write=condition") and isinstance(args, tuple) and len(args) == 5:
            _node, ctype, status, reason, message = (str(a) for a in args)
            self.latest = {**self.latest, ctype: ConditionWrite(ctype, status, reason, message)}


def run_ib_demo(args: argparse.Namespace, workdir: Path) -> int:
    """Build the InfiniBand node in ``workdir``, run the agent on it and narrate the port going down."""
    ib = build_ib_demo_root(workdir / "host")
    say(f"healthagent demo --fabric ib: a DGX H100-shaped node (8 x H100 answered by the stub NVML library "
        f"the demo builds, {len(ib.fabric.ports)} ports: 8 InfiniBand NDR, one behind each GPU's PCIe "
        f"switch, and 2 RoCE for storage; no EFA), Kubernetes in dry-run")
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY, encoding="utf-8")
    settings = demo_settings(ib.node, workdir, args.listen, node_name=DEMO_NODE, policy_file=str(policy),
                             rdma_interval_seconds=READ_SECONDS)
    conditions = ConditionWrites()
    logging.getLogger(EFFECTS_LOG).addHandler(conditions)
    try:
        with running_agent(ib.node, settings) as runtime:
            return _script(args, ib, runtime, conditions)
    finally:
        logging.getLogger(EFFECTS_LOG).removeHandler(conditions)


def _published(runtime: AgentRuntime) -> AgentSnapshot:
    """What the agent last decided on and published (an empty reading before its first)."""
    return runtime.telemetry.snapshot or AgentSnapshot(timestamp=0.0)


def _script(args: argparse.Namespace, ib: IbDemoNode, runtime: AgentRuntime, conditions: ConditionWrites) -> int:
    agent = runtime.agent
    urls = Urls.of(runtime)
    if not first_cycle(agent):
        return 3
    everything_up = len(ib.fabric.ports)
    if not wait_for(lambda: sum(p.up for p in _published(runtime).rdma) == everything_up, 15):
        say(f"the agent did not read all {everything_up} ports up in 15 s; see the log lines above")
        return 3
    snapshot = _published(runtime)
    gpu_index = {gpu.pci_bus_id: gpu.index for gpu in snapshot.gpus}
    say(f"\n1. Healthy start: read {len(snapshot.gpus)} GPUs and {len(snapshot.rdma)} InfiniBand/RoCE ports, "
        f"every port up; verdict = {agent.verdict.action.value}")
    for p in snapshot.rdma:
        layer = "InfiniBand" if p.link_layer == "InfiniBand" else "RoCE"
        beside = (", ".join(f"GPU {gpu_index.get(g, '?')} ({g})" for g in p.gpus) if p.gpus
                  else "storage, no GPU behind its switch")
        say(f"   {p.name:<9} {p.netdev:<14} {layer:<11} {p.rate_text:<19}  {p.state}, {p.phys_state}  {beside}")
    say("   the port-down rule judges only a port it has seen up (an unused port is never down): "
        "the agent has now seen all of these up")
    urls.say_served()

    port = ib.port_beside(args.gpu)
    name = f"{port.device}/1"
    demo_rule = agent.classifier.policy.rule(CODE)
    say(f"\n2. Fault: the cable of {name} ({port.netdev}, GPU {args.gpu}'s rail) is pulled: its sysfs now reads "
        f"state {DOWN}, phys_state {POLLING}, and link_downed counts the drop")
    say(f"   {CODE}'s rule in the demo's policy file: {demo_rule.words()}; by default: {row(CODE).rule.words()} "
        f"(a link back sooner is only a link_downed step, and after a boot the subnet manager brings the "
        f"ports up)")
    started = time.monotonic()
    logged = ib.pull_cable(port.device)
    say(f"   the driver logs: {logged}  (informational, action none: counted in "
        f"healthagent_mlx5_events_total, no finding)")
    detected = wait_for(lambda: any(f.code == CODE and f.subject == name for f in agent.verdict.findings), 15)
    elapsed = time.monotonic() - started
    if not detected:
        say(f"   the agent did not report {name} down within 15 s")
        return 3
    verdict = agent.verdict
    say(f"   detected {elapsed:.1f} s after the cable was pulled (ports are read every "
        f"{runtime.settings.rdma_interval_seconds:g} s); verdict = {verdict.action.value}")
    say_findings(verdict)

    say("\n3. What the agent would write to Kubernetes (dry-run; log lines above show each write)")
    networking = vocabulary(runtime.settings.condition_vocabulary).network_type
    if wait_for(lambda: getattr(conditions.latest.get(networking), "reason", "") == CODE, 10):
        written = conditions.latest[networking]
        say(f"   condition {written.type}={written.status}, reason {written.reason}: the node's networking "
            f"condition, which InfiniBand and RoCE ports share with EFA (NetworkingReady in the eks "
            f"vocabulary, the one Karpenter's and EKS's node repair act on)")
        say(f"      message: {written.message}")
    else:
        say(f"   no {networking} condition for {CODE} within 10 s; see the log lines above")
    take_out(agent, no_execute=agent.verdict.action.needs_node_action)

    say("\n4. What Prometheus scrapes from the agent now")
    device = f'device="{port.device}"'
    wait_for(lambda: any(c.device == port.device and c.event == UNPLUGGED
                         for c in _published(runtime).adapter_counts), 10)  # the kernel log's line counted

    def keep(line: str) -> bool:  # the port's own lines, its adapter's events, the findings and action on
        if line.startswith(PORT_FAMILIES):
            return device in line
        return line.startswith(("healthagent_findings", "healthagent_node_action")) and not line.endswith(" 0.0")

    say_scrape(runtime, urls, keep)
    if args.keep_running:
        keep_running(runtime, urls)
    return 0
