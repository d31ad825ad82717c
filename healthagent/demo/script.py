"""``healthagent demo``: the real agent on the bundled demo node through a scripted fault.

Nothing here is a mock of the agent: the demo builds a p5.48xlarge-shaped host root (32 EFA
devices in a sysfs tree, a /dev/kmsg-format log, an 8 x H100 NVML scenario served by the stub
``libnvidia-ml.so.1`` compiled from C), starts the same ``AgentRuntime`` that ``healthagent run``
starts, with Kubernetes in dry-run, and then appends a real-format XID record to the kernel log.
What the demo prints is read back from the running agent: its verdict and its ``/metrics``.
``--fabric ib`` runs the same agent on an InfiniBand node instead (``ib_script.py``;
``command.py`` picks the script); the helpers here (starting the agent, printing findings, the taint steps, the scrape, ``--keep-running``)
serve both scripts.

Putting the stub in NVML's place is the demo's own step (``stub_setup``), taken here before the
agent is built; the agent itself never compiles or swaps a library.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import shlex
import signal
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from healthagent.config import Settings, load_settings
from healthagent.demo.node import DemoNode, build_demo_root
from healthagent.demo.stub_nvml import SCENARIO_ENV, StubBuildError
from healthagent.demo.stub_setup import stub_nvml_env, use_stub_nvml
from healthagent.model import Action, Verdict
from healthagent.training.access import job_token
from healthagent.wiring import AgentRuntime

if TYPE_CHECKING:
    from healthagent.agent import Agent

POLL_SECONDS = 0.02
DEMO_GRACE_SECONDS = 3.0  # NoSchedule -> NoExecute for replace_node and reboot_node; 120 s on a real node
# The effects pass over the node by themselves this often in the demo (5 s on a real node), so the
# NoExecute step lands within half a second of its grace rather than up to 5 s after it.
DEMO_EFFECTS_PASS_SECONDS = 0.5
DEMO_JOB = "demo-job"


def say(text: str = "") -> None:
    print(text, flush=True)


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` (the agent's state) until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL_SECONDS)
    return False


def metrics_excerpt(url: str, keep: Callable[[str], bool]) -> list[str]:
    """The sample lines of one scrape of ``url`` that ``keep`` picks."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return [line for line in text.splitlines() if not line.startswith("#") and keep(line)]


def run_efa_demo(args: argparse.Namespace, tmp: Path) -> int:
    """The p5.48xlarge-shaped node's script, with its host root under ``tmp``."""
    node = build_demo_root(tmp / "host")
    say("healthagent demo: a p5.48xlarge-shaped node (8 x H100 answered by the stub NVML library "
        f"the demo builds, {len(node.efa_devices)} EFA devices), Kubernetes in dry-run")
    with running_agent(node, demo_settings(node, tmp, args.listen)) as runtime:
        return _script(args, node, runtime)


@contextlib.contextmanager
def running_agent(node: DemoNode, settings: Settings,
                  effects_wrap: Callable[[Any], Any] | None = None) -> Iterator[AgentRuntime]:
    """The ``AgentRuntime`` that ``healthagent run`` starts, on ``node`` with the stub in NVML's
    place and the effects passing over the node every ``DEMO_EFFECTS_PASS_SECONDS``; stopped on
    exit. ``effects_wrap``: a demo's layer around the node's effects (``--dra``)."""
    use_stub_nvml(node.scenario)
    runtime = AgentRuntime(settings, effects_wrap=effects_wrap)
    if runtime.agent.effects_worker is not None:
        runtime.agent.effects_worker.retry_seconds = DEMO_EFFECTS_PASS_SECONDS
    runtime.start()
    try:
        yield runtime
    finally:
        runtime.stop()


def demo_settings(node: DemoNode, workdir: Path, listen: str = "127.0.0.1:0", **overrides: object) -> Settings:
    """The agent's settings for the demo node (docs/reference/metrics.md counts the series they give);
    ``overrides``: settings of a variant of the demo (the InfiniBand node's name and policy file)."""
    return load_settings(env={}, flags={
        "host_root": str(node.root), "kube": "dry-run", "listen": listen,
        "state_file": str(workdir / "state.json"), "node_name": "demo-p5-node",
        "expected_gpus": 8, "expected_efa_devices": len(node.efa_devices),
        "nvml_interval_seconds": 1, "efa_interval_seconds": 1, "log_level": "WARNING",
        "replace_noexecute_grace_seconds": DEMO_GRACE_SECONDS,
        # The intake on a free port of its own, closed as on a cluster: this run's random
        # training key opens it (printed as a job token with --keep-running).
        "training_token": secrets.token_hex(16),
        **overrides,
    })


def check_command(node: DemoNode) -> str:
    """``check`` on the prepared root, with the environment that makes its NVML the stub (the
    production command never sets that up itself); without a C compiler, NVML stays off."""
    try:
        env = stub_nvml_env(node.scenario, base={})
    except StubBuildError as exc:
        return f"healthagent check --host-root {shlex.quote(str(node.root))} --no-nvml  ({exc})"
    prefix = " ".join(f"{key}={shlex.quote(env[key])}" for key in ("LD_LIBRARY_PATH", SCENARIO_ENV))
    return f"{prefix} healthagent check --host-root {shlex.quote(str(node.root))}"


def no_execute_words(seconds: float) -> str:
    """What the demo says when NoExecute lands ``seconds`` after it saw NoSchedule: the number it
    measured and why it is not exactly the grace, so the words agree with what happened (on a
    busy machine the effects' pass comes late, and the demo says so instead of contradicting the
    grace it announced)."""
    expected = DEMO_GRACE_SECONDS + DEMO_EFFECTS_PASS_SECONDS
    why = (f"the {DEMO_GRACE_SECONDS:g} s grace, then the effects' next pass" if seconds <= expected + 1 else
           f"the {DEMO_GRACE_SECONDS:g} s grace, then an effects' pass that came late on this busy machine")
    return (f"taint NoExecute now, {seconds:.1f} s after the demo saw NoSchedule ({why}): the job's pods "
            "are evicted and it re-rendezvous without this node")


def _script(args: argparse.Namespace, node: DemoNode, runtime: AgentRuntime) -> int:
    agent = runtime.agent
    urls = Urls.of(runtime)
    if not first_cycle(agent):
        return 3
    snapshot_gpus = agent._latest_gpus()
    efa_devices = sorted({s.device for item in agent.scheduled if item.last for s in item.last.efa})
    say(f"\n1. Healthy start: read {len(snapshot_gpus)} GPUs and {len(efa_devices)} EFA devices; "
        f"verdict = {agent.verdict.action.value}")
    for gpu in snapshot_gpus:
        say(f"   GPU {gpu.index}  {gpu.pci_bus_id}  {gpu.name}  {gpu.temperature_c} C  {gpu.power_w} W")
    urls.say_served()

    pci = node.gpu_pci_bus_ids[args.gpu]
    say(f"\n2. Fault: the driver logs XID {args.xid} on GPU {args.gpu} ({pci}) in the kernel log")
    started = time.monotonic()
    node.inject_xid(args.gpu, args.xid)
    detected = wait_for(lambda: any(args.xid in f.xids for f in agent.verdict.findings), 10)
    elapsed = time.monotonic() - started
    if not detected:
        say("   the agent did not report the XID within 10 s")
        return 3
    verdict = agent.verdict
    say(f"   detected in {elapsed * 1000:.0f} ms; verdict = {verdict.action.value}")
    say_findings(verdict)

    say("\n3. What the agent would write to Kubernetes (dry-run; log lines above show each write)")
    take_out(agent, no_execute=agent.verdict.action is Action.REPLACE_NODE)

    say("\n4. What Prometheus scrapes from the agent now")
    prefixes = ("healthagent_xid_errors_total", "healthagent_node_action", "healthagent_findings",
                "healthagent_gpu_up{gpu=\"%d\"" % args.gpu)
    say_scrape(runtime, urls, lambda line: line.startswith(prefixes) and not line.endswith(" 0.0"))
    if args.keep_running:
        keep_running(runtime, urls)
    return 0


@dataclass(frozen=True)
class Urls:
    """Where the demo agent serves: its own port (``/metrics``) and the training intake's."""

    metrics: str
    intake: str

    @classmethod
    def of(cls, runtime: AgentRuntime) -> Urls:
        return cls(f"http://127.0.0.1:{runtime.server.port}/metrics",
                   f"http://127.0.0.1:{runtime.server.intake_port}/v1/training")

    def say_served(self) -> None:
        say(f"   metrics: {self.metrics} and the training intake: {self.intake}, each on a port of "
            f"its own (served while the demo runs; add --keep-running to keep them up)")


def first_cycle(agent: Agent) -> bool:
    """Wait for the agent's first decision; False (said) when it does not come."""
    if wait_for(lambda: agent.verdict is not None and agent.cycles > 0, 15):
        return True
    say("the agent did not complete a cycle in 15 s; see the log lines above")
    return False


def say_findings(verdict: Verdict) -> None:
    """Each finding with its action, why, what was seen and what to do next."""
    for f in verdict.findings:
        where = f"GPU {f.gpu_index} {f.pci_bus_id}" if f.gpu_index is not None else f.subject
        say(f"   [{f.code}] {where}: {f.action.value}")
        say(f"      why:  {f.summary}")
        say(f"      seen: {f.evidence}")
        say(f"      next: {f.next_steps}")


def take_out(agent: Agent, no_execute: bool) -> None:
    """Say the taint steps as the effects take them: NoSchedule, then (``no_execute``: the action
    evicts) NoExecute once the grace has passed; then the taint as it stands."""
    def taint_is(effect: str) -> Callable[[], bool]:
        return lambda: agent.kube_status.taint_effect == effect

    if agent.verdict.action.needs_node_action and wait_for(taint_is("NoSchedule"), 10):
        tainted = time.monotonic()
        say("   taint NoSchedule now: no new pods land here; the job keeps running so it can checkpoint")
        if no_execute:
            say(f"   NoExecute follows once the grace has passed: {DEMO_GRACE_SECONDS:g} s after the "
                f"NoSchedule taint in the demo (120 s by default), at the effects' next pass "
                f"(every {DEMO_EFFECTS_PASS_SECONDS:g} s in the demo)")
            waited = DEMO_GRACE_SECONDS + 15
            if wait_for(taint_is("NoExecute"), waited):
                say("   " + no_execute_words(time.monotonic() - tainted))
            else:
                say(f"   no NoExecute within {waited:g} s of NoSchedule; see the log lines above")
    kube = agent.kube_status
    say(f"   taint effect now: {kube.taint_effect or 'none'}; budget holding it back: {kube.budget_blocked}")


def say_scrape(runtime: AgentRuntime, urls: Urls, keep: Callable[[str], bool]) -> None:
    """The lines ``keep`` picks from a scrape taken once /metrics serves the agent's verdict."""
    agent = runtime.agent

    def published() -> bool:  # /metrics serves this verdict and what the effects last reported
        snapshot = runtime.telemetry.snapshot
        return snapshot is not None and snapshot.verdict is agent.verdict and snapshot.kube == agent.kube_status

    wait_for(published, 10)
    for line in metrics_excerpt(urls.metrics, keep):
        say(f"   {line}")


def keep_running(runtime: AgentRuntime, urls: Urls) -> None:
    """``--keep-running``: serve both ports until Ctrl-C or SIGTERM, with a job token to try the intake."""
    token = job_token(runtime.settings.training_token, DEMO_JOB)
    # Ctrl-C and SIGTERM end the wait below whatever this process inherited: a shell starts a
    # background job with SIGINT ignored, and Python then keeps it ignored. The handler only
    # notes the signal, so one that lands while the lines below are still printing (a busy
    # machine can deliver it before the wait starts) ends the demo the same clean way. A plain
    # list, not a threading.Event: setting an Event from a handler can deadlock on its lock.
    signals_received: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda received, _frame: signals_received.append(received))
    say(f"\nserving {urls.metrics} and {urls.intake} until Ctrl-C; report a training step with "
        f"this run's token for job {DEMO_JOB!r}:")
    say(f"   curl -s -H 'Authorization: Bearer {token}' -H 'Content-Type: application/json' "
        f"{urls.intake} -d '{{\"type\":\"step\",\"job\":\"{DEMO_JOB}\",\"rank\":0,"
        f"\"world_size\":8,\"step\":1,\"tokens\":4096,\"samples\":8,\"step_seconds\":1.5}}'")
    while not signals_received:
        time.sleep(0.5)  # a signal cuts the sleep short and runs the handler at once
