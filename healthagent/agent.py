"""The loop: schedule sources, feed policy, hand the verdict to effects, publish the snapshot.

This is the only module that wires sources, policy, effects and telemetry together (ARCHITECTURE.md).

Shape of one cycle (``Agent.cycle``):
  1. read what is due: the kernel log and NVML's XID queue every time (they are cheap and are where
     a fault shows first), NVML/EFA/dcgm counters on their intervals;
  2. give the classifier everything (policy is pure: it gets the timestamp, never reads a clock);
  3. save the state file (kernel-log cursor + classifier state in ONE atomic write, so a SIGKILL
     between deciding and acting either re-reads the same records or restores the same finding:
     nothing is lost, nothing is counted twice) whenever the decision moved: new XIDs were handed
     to policy, the open findings or their actions changed, or an operator clear was applied.
     When only counter histories moved, or the cursor passed lines without an XID, the file is
     saved at most every ``state_save_interval_seconds`` (a restart then re-reads those lines and
     loses at most that much counter history; it cannot lose a finding); on shutdown always;
  4. hand the verdict to the effects worker and publish the snapshot for /metrics.

Kubernetes writes run on their own thread (``EffectsWorker``): an API server that is slow or down
must never delay detection, and the worker always works on the newest verdict (coalescing), so a
burst of forty XIDs costs one reconcile, not forty.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from healthagent import __version__
from healthagent.config import ConfigError, Settings, read_yaml
from healthagent.model import (
    AgentSnapshot,
    Collection,
    EfaSample,
    GpuSample,
    KubeStatus,
    SourceHealth,
    Verdict,
    XidCount,
    XidEvent,
)
from healthagent.sources.base import DeadlineSource, Source, SourceResult, read_boot_id

log = logging.getLogger(__name__)


@dataclass
class Scheduled:
    """A periodic source and when it is next due."""

    source: Source
    interval: float
    next_due: float = 0.0
    last: SourceResult | None = None


def enrich_xid(event: XidEvent, gpus: tuple[GpuSample, ...]) -> XidEvent:
    """Attach GPU index/UUID to a kernel-log XID by its canonical PCI id (the ARCHITECTURE contract)."""
    if event.gpu_index is not None and event.uuid:
        return event
    for gpu in gpus:
        if event.pci_bus_id and gpu.pci_bus_id == event.pci_bus_id:
            return replace(event, gpu_index=gpu.index, uuid=gpu.uuid)
        if event.uuid and gpu.uuid == event.uuid:
            return replace(event, gpu_index=gpu.index, pci_bus_id=gpu.pci_bus_id)
    return event


@dataclass
class XidTally:
    """Cumulative XIDs by (GPU, XID, kind): the data behind ``healthagent_xid_errors_total``."""

    counts: dict[tuple, XidCount] = field(default_factory=dict)

    def add(self, event: XidEvent) -> None:
        key = (event.gpu_index, event.uuid, event.pci_bus_id, event.xid, event.kind)
        old = self.counts.get(key)
        self.counts[key] = XidCount(
            xid=event.xid, count=(old.count if old else 0) + 1, gpu_index=event.gpu_index,
            uuid=event.uuid, pci_bus_id=event.pci_bus_id, kind=event.kind,
        )

    def snapshot(self) -> tuple[XidCount, ...]:
        return tuple(self.counts.values())


class EffectsWorker:
    """Runs ``NodeEffects.reconcile`` on its own thread with the newest verdict.

    Reconciles when the verdict changes and every ``retry_seconds`` anyway, which both retries
    pending writes after an API outage and moves replace_node from NoSchedule to NoExecute when its
    grace has passed. ``stop`` lets the write in flight finish (SIGTERM contract).
    """

    def __init__(self, effects, boot_id: str, clock: Callable[[], float], retry_seconds: float = 5.0,
                 on_status: Callable[[KubeStatus], None] | None = None) -> None:
        self._effects = effects
        self._boot_id = boot_id
        self._clock = clock
        self._retry = retry_seconds
        self._on_status = on_status
        self._verdict: Verdict | None = None
        self._health: tuple[SourceHealth, ...] = ()
        self._changed = threading.Event()
        # The node watch wakes this worker when an operator or another controller changes what the
        # effects own: a clear applies at once, not on the next retry.
        if hasattr(effects, "on_change"):
            effects.on_change = self._changed.set
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="healthagent-effects", daemon=True)
        self.status = KubeStatus()
        self.reconciles = 0
        self.failures: Counter = Counter()  # exceptions that escaped NodeEffects, by step

    def start(self) -> None:
        self._thread.start()

    def submit(self, verdict: Verdict, health: "tuple[SourceHealth, ...]" = ()) -> None:
        """Hand over the newest verdict (and the sources' health, whose detail explains an
        ``Unknown`` condition); wakes the worker only when the verdict means something new."""
        with self._lock:
            changed = self._verdict is None or _verdict_signature(self._verdict) != _verdict_signature(verdict)
            self._verdict = verdict
            self._health = tuple(health)
        if changed:
            self._changed.set()

    def _run(self) -> None:
        try:
            self._set_status(self._effects.startup(self._clock(), self._boot_id))
        except Exception:  # the worker must survive anything the API or a bug throws
            self.failures["startup_raised"] += 1
            log.exception("effects startup failed; will retry on the next reconcile")
        while not self._stopping.is_set():
            self._changed.wait(self._retry)
            self._changed.clear()
            with self._lock:
                verdict, health = self._verdict, self._health
            if verdict is None:
                continue
            try:
                self._set_status(self._effects.reconcile(verdict, self._clock(), self._boot_id,
                                                          health=health))
                self.reconciles += 1
            except Exception:
                self.failures["reconcile_raised"] += 1
                log.exception("effects reconcile failed; desired state kept, retrying")

    def _set_status(self, status: KubeStatus) -> None:
        self.status = status
        if self._on_status:
            self._on_status(status)

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self._changed.set()
        if self._thread.ident is not None:  # started (an agent built but never run has nothing to join)
            self._thread.join(timeout)
        close = getattr(self._effects, "close", None)
        if close is not None:
            close()  # ends the node watch thread and its open request

    def errors(self) -> dict[str, int]:
        """Cumulative failures of the effects side by kind: NodeEffects' own tally (API refusals,
        conflicts given up, budget counts that failed, internal errors, watch problems), Events
        dropped from a full outbox, and exceptions that escaped to this worker."""
        counts = dict(self._effects.errors)
        counts["events_dropped"] = self._effects.ledger.dropped
        counts.update(self.failures)
        return counts


def _findings_signature(verdict: Verdict | None) -> frozenset:
    """What the state file must hold before effects act: which findings are open, at which action
    (the effects' Events and taints key on exactly these)."""
    return frozenset((f.key, f.action) for f in verdict.findings) if verdict is not None else frozenset()


def _verdict_signature(verdict: Verdict) -> tuple:
    return (verdict.action, verdict.unobserved,
            tuple((f.key, f.action, f.count) for f in verdict.findings))


class Agent:
    """Owns the sources, the classifier, the state store, the effects worker and the exporter."""

    def __init__(
        self,
        settings: Settings,
        *,
        sources: list[Scheduled],
        event_sources: list[Source],
        nvml=None,
        classifier,
        state,
        effects=None,
        telemetry=None,
        intake=None,
        wake: threading.Event | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.scheduled = sources
        self.event_sources = event_sources  # collected every cycle (kernel log)
        self.nvml = nvml  # its take_events() is drained every cycle
        self.classifier = classifier
        self.state = state
        self.telemetry = telemetry
        self.intake = intake
        self.clock = clock
        self.boot_id = read_boot_id(settings.host_root)
        # What the node must have: the settings, else the instance type's row (sources/instance.py).
        self.expected_gpus, self.expected_efa_devices = expected_inventory(settings)
        log.info("expected inventory gpus=%s efa_devices=%s", self.expected_gpus, self.expected_efa_devices)
        self.wake = wake or threading.Event()
        self.xids = XidTally()
        self.verdict: Verdict | None = None
        self.cycles = 0
        self.state_saves = 0  # times the loop saved the cursor + classifier state
        self._saved_findings: frozenset | None = None  # (key, action) of the open findings last saved
        self._saved_at: float | None = None  # loop clock of that save
        self._health: dict[str, SourceHealth] = {}
        self._source_errors: dict[str, Mapping[str, int]] = {}  # each source's own cumulative tally
        self._raised: Counter = Counter()  # collect() calls that raised, by source (cumulative)
        self.loop_errors: Counter = Counter()  # cycle / persist failures the loop survived
        self.server = None  # the AgentServer ``run`` heartbeats (its refusals are exported)
        self._kube_status = KubeStatus(mode=settings.kube)
        self.effects_worker = (
            EffectsWorker(effects, self.boot_id, clock, on_status=self._on_kube_status) if effects else None
        )

    # -- one cycle -------------------------------------------------------------------------------

    def cycle(self) -> Verdict:
        """Read what is due, decide, persist, hand off. Never raises for a source's sake."""
        now = self.clock()
        new_xids: list[XidEvent] = []
        for source in self.event_sources:
            result = self._collect(source, now)
            new_xids.extend(result.xids)
        if self.nvml is not None:
            new_xids.extend(self.nvml.take_events())
        fresh_periodic = False
        for item in self.scheduled:
            if now >= item.next_due:
                item.last = self._collect(item.source, now)
                item.next_due = now + item.interval
                new_xids.extend(item.last.xids)
                fresh_periodic = True
        gpus = self._latest_gpus()
        efa = tuple(s for item in self.scheduled if item.last for s in item.last.efa)
        enriched = tuple(enrich_xid(x, gpus) for x in new_xids)
        cleared = self._apply_operator_clear(now)
        if self.verdict is None or enriched or fresh_periodic or cleared:
            collection = Collection(
                timestamp=now, gpus=gpus, xids=enriched, efa=efa,
                health=tuple(self._health.values()), boot_id=self.boot_id,
                expected_gpus=self.expected_gpus,
                expected_efa_devices=self.expected_efa_devices,
            )
            verdict = self.classifier.observe(collection)
            # The classifier drops the copies of one XID that several sources report (kmsg + NVML
            # event + dcgm), so the counter counts what it counted, once.
            for event in self.classifier.counted_xids:
                self.xids.add(event)
            if enriched:
                log.info("xids=%s verdict=%s", ",".join(str(x.xid) for x in enriched), verdict.action.value)
            findings = _findings_signature(verdict)
            if enriched or cleared or findings != self._saved_findings:
                self._persist(now, findings)  # before effects act: the SIGKILL contract
            self._set_verdict(verdict)
        if self._saved_at is None or not 0 <= now - self._saved_at < self.settings.state_save_interval_seconds:
            self._persist(now, _findings_signature(self.verdict))  # counter histories, cursor over noise
        self.cycles += 1
        self._publish(now, gpus, efa)
        return self.verdict

    def _apply_operator_clear(self, now: float) -> bool:
        """An operator cleared the node (``healthagent.io/clear`` annotation, or the agent's taint
        removed by hand): forget every open finding, once per token. The token is saved with the
        classifier state in the same atomic write, so a restart never clears twice."""
        token = self._kube_status.clear_token
        if not token or token == self.state.get("clear_handled"):
            return False
        cleared = self.classifier.clear(now, f"operator clear {token}")
        self.state.put("clear_handled", token)
        log.warning("operator_clear token=%s findings_cleared=%d", token, cleared)
        return True

    def _collect(self, source: Source, now: float) -> SourceResult:
        started = time.monotonic()
        try:
            result = source.collect(now)
            self._source_errors[source.name] = result.health.errors
        except Exception as exc:  # a source bug must not stop the others
            self._raised[source.name] += 1
            log.exception("source=%s collect raised", source.name)
            result = SourceResult(health=SourceHealth(source=source.name, up=False, detail=repr(exc)))
        elapsed = time.monotonic() - started
        # source_errors_total is cumulative: the source's own tally (as last reported, also when it
        # raised this time) plus the loop's count of raised collects, never a reset to 1.
        errors = dict(self._source_errors.get(source.name, {}))
        if self._raised[source.name]:
            errors["exception"] = errors.get("exception", 0) + self._raised[source.name]
        self._health[source.name] = replace(result.health, duration_seconds=elapsed, errors=errors)
        if self.telemetry is not None:
            self.telemetry.observe_collect(source.name, elapsed)
        return result

    def _latest_gpus(self) -> tuple[GpuSample, ...]:
        """NVML is authoritative; dcgm fills in only when NVML has nothing (no library in the pod)."""
        by_source: dict[str, tuple[GpuSample, ...]] = {}
        for item in self.scheduled:
            if item.last and item.last.gpus:
                by_source[item.source.name] = item.last.gpus
        return by_source.get("nvml") or by_source.get("dcgm") or ()

    def _persist(self, now: float | None = None, findings: frozenset | None = None) -> None:
        """Save the kernel-log cursor and the classifier state in one atomic write (and note what
        was saved, so ``cycle`` can tell when the decision moved again)."""
        cursor = None
        for source in self.event_sources:
            if hasattr(source, "cursor"):
                cursor = source.cursor.to_dict()
        try:
            if cursor is not None:
                self.state.put("kmsg_cursor", cursor)
            self.state.put("classifier", self.classifier.export_state())
            self.state.put("boot_id", self.boot_id)
            if self.state.flush():
                self.state_saves += 1
                self._saved_findings = findings  # else the next decision tries again
        except Exception:
            self.loop_errors["persist"] += 1
            log.exception("state save failed; the node object remains the record")
        self._saved_at = now  # a failing save is retried after the interval, not every cycle

    def _set_verdict(self, verdict: Verdict) -> None:
        previous = self.verdict
        self.verdict = verdict
        if previous is None or previous.action != verdict.action:
            log.info("verdict action=%s findings=%s", verdict.action.value,
                     ",".join(f"{f.code}:{f.subject}" for f in verdict.findings) or "-")
        if self.intake is not None and verdict.action.needs_node_action and (
                previous is None or not previous.action.needs_node_action):
            self.intake.note_fault(verdict.timestamp)
        if self.effects_worker is not None:
            self.effects_worker.submit(verdict, tuple(self._health.values()))

    def _on_kube_status(self, status: KubeStatus) -> None:
        self._kube_status = status

    def _publish(self, now: float, gpus: tuple[GpuSample, ...], efa: tuple[EfaSample, ...]) -> None:
        if self.telemetry is None:
            return
        self.telemetry.publish(AgentSnapshot(
            timestamp=now, gpus=gpus, efa=efa, xid_counts=self.xids.snapshot(),
            health=tuple(self._health.values()), verdict=self.verdict, kube=self._kube_status,
            ready=self.ready, expected_gpus=self.expected_gpus,
            expected_efa_devices=self.expected_efa_devices,
            internal_errors=self.internal_errors(),
        ))

    def internal_errors(self) -> dict[tuple[str, str], int]:
        """Failures the agent survives but must show, cumulative by (component, kind): the state
        file's tally (an unwritable file silently loses restart safety), the effects' tally, the
        classifier's internal/restore errors, the HTTP server's refusals and the loop's own."""
        counts: dict[tuple[str, str], int] = {}
        parts: list[tuple[str, Mapping[str, int]]] = [
            ("state", self.state.errors),
            ("policy", {"internal": self.classifier.internal_errors,
                        "restore": self.classifier.restore_errors}),
            ("loop", self.loop_errors),
        ]
        if self.effects_worker is not None:
            parts.append(("kube", self.effects_worker.errors()))
        if self.server is not None:
            parts.append(("http", self.server.errors))
        for component, tally in parts:
            for kind, value in tally.items():
                if value:
                    counts[(component, kind)] = int(value)
        return counts

    @property
    def ready(self) -> bool:
        """Ready once a cycle ran and Kubernetes was reached (or we are not writing to it)."""
        if self.cycles == 0:
            return False
        if self.settings.kube in ("dry-run", "off") or self.effects_worker is None:
            return True
        return self._kube_status.reachable

    # -- the loop ----------------------------------------------------------------------------------

    def next_wait(self) -> float:
        now = self.clock()
        due = min((item.next_due for item in self.scheduled), default=now + 1.0)
        return max(0.0, min(due - now, self.settings.kmsg_poll_seconds))

    def start_effects(self) -> None:
        if self.effects_worker is not None:
            self.effects_worker.start()

    def run(self, stop: threading.Event, server=None) -> None:
        """Cycle until ``stop`` is set; then let the write in flight finish and save state."""
        self.start_effects()
        self.server = server
        log.info("agent started version=%s node=%s kube=%s host_root=%s", __version__,
                 self.settings.node_name or "-", self.settings.kube, self.settings.host_root)
        while not stop.is_set():
            try:
                self.cycle()
            except Exception:  # the loop outlives any bug in one cycle; the metric shows it
                self.loop_errors["cycle"] += 1
                log.exception("cycle failed")
            if server is not None:
                server.heartbeat(self.clock())
                server.set_ready(self.ready)
            if stop.wait(0) or self.wake.wait(self.next_wait()):
                self.wake.clear()
        self.shutdown()

    def shutdown(self, grace_seconds: float = 10.0) -> None:
        if self.effects_worker is not None:
            self.effects_worker.stop(grace_seconds)
        self._persist()
        for item in self.scheduled:
            _close(item.source)
        for source in self.event_sources:
            _close(source)
        log.info("agent stopped")


def _close(source: Source) -> None:
    try:
        source.close()
    except Exception:
        log.exception("source=%s close failed", getattr(source, "name", "?"))


# -- assembly -------------------------------------------------------------------------------------

DEMO_SCENARIO_FILE = "nvml-scenario.json"


def activate_stub_nvml_if_demo(host_root: str) -> str | None:
    """A demo host root carries its NVML scenario; then NVML is the stub library, said loudly.

    Real nodes never have ``nvml-scenario.json`` at their root, so this cannot shadow a real
    driver; ``HEALTHAGENT_STUB_NVML_SCENARIO`` set by hand does the same for tests.
    """
    import os

    scenario = os.environ.get("HEALTHAGENT_STUB_NVML_SCENARIO") or ""
    demo_file = os.path.join(host_root, DEMO_SCENARIO_FILE)
    if not scenario and os.path.isfile(demo_file):
        scenario = demo_file
    if not scenario:
        return None
    from pathlib import Path

    from healthagent.demo import stub_nvml

    os.environ["HEALTHAGENT_STUB_NVML_SCENARIO"] = scenario
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "healthagent"
    lib = stub_nvml.build_stub(cache)
    stub_nvml.preload_stub(lib)
    log.warning("NVML is the stub library %s with scenario %s (demo/test host root)", lib, scenario)
    return scenario


def expected_inventory(settings: Settings) -> tuple[int | None, int | None]:
    """(GPUs, EFA devices) the node must have: each configured value, else the instance type's
    (``sources/instance.py``); None where neither says."""
    from healthagent.sources.instance import resolve_expected

    return resolve_expected(settings.host_root, settings.expected_gpus, settings.expected_efa_devices,
                            efa_from_table=settings.efa_expected_from_instance_type)


def build_sources(settings: Settings, on_event: Callable[[], None] | None = None, kmsg_cursor=None):
    """The sources the settings ask for: (scheduled periodic sources, event sources, nvml)."""
    from healthagent.sources.efa import EfaSource
    from healthagent.sources.kmsg import KmsgSource

    # Periodic sources run under a deadline (DeadlineSource): a wedged driver or filesystem must
    # never hold the loop, which also reads the kernel log and drives the effects.
    deadline = settings.source_timeout_seconds
    scheduled: list[Scheduled] = []
    nvml = None
    if settings.nvml:
        activate_stub_nvml_if_demo(settings.host_root)
        from healthagent.sources.nvml import NvmlSource

        nvml = NvmlSource(expected_gpus=expected_inventory(settings)[0], on_event=on_event)
        # The loop drains nvml.take_events() itself (a queue, never a driver call).
        scheduled.append(Scheduled(DeadlineSource(nvml, deadline), settings.nvml_interval_seconds))
    scheduled.append(Scheduled(DeadlineSource(EfaSource(settings.host_root), deadline),
                               settings.efa_interval_seconds))
    if settings.dcgm_url:
        from healthagent.sources.dcgm import DcgmSource

        dcgm = DcgmSource(settings.dcgm_url, settings.dcgm_timeout_seconds)
        scheduled.append(Scheduled(DeadlineSource(dcgm, max(deadline, 2 * settings.dcgm_timeout_seconds)),
                                   settings.dcgm_interval_seconds))
    kmsg = KmsgSource(settings.host_root, settings.kernel_log, cursor=kmsg_cursor,
                      max_records_per_cycle=settings.kmsg_max_records_per_cycle)
    return scheduled, [kmsg], nvml


def build_classifier(settings: Settings):
    from healthagent.policy.catalog import load_catalog
    from healthagent.policy.classify import Classifier
    from healthagent.policy.settings import load_policy

    policy = load_policy(settings.policy_file)
    return Classifier(policy, load_catalog(policy))


def build_effects(settings: Settings, state):
    """NodeEffects for the configured Kubernetes mode; None when kube=off (no effects at all)."""
    if settings.kube == "off":
        return None
    from healthagent.effects.kube import NodeEffects

    if settings.kube == "dry-run":
        return NodeEffects(settings, None, state)
    if not settings.node_name:
        raise ConfigError("node_name: the agent must know its own node; set NODE_NAME from the "
                          "downward API (spec.nodeName) or pass --node-name")
    return NodeEffects(settings, kube_api_client(settings), state)


def kube_api_client(settings: Settings):
    """The ``kubernetes`` ApiClient for kube=in-cluster or kubeconfig; a setup the client cannot
    use is a ConfigError (one line naming the setting and the fix), never a traceback."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    if settings.kube == "kubeconfig":
        path = settings.kubeconfig or ""
        # Read it first: the client answers a missing file, a file of another shape or broken
        # YAML with a misleading message or a TypeError.
        data = read_yaml(path, "kubeconfig", "--kubeconfig PATH", ConfigError)
        if not isinstance(data, dict):
            raise ConfigError(f"kubeconfig: {path!r} is not a kubeconfig (a mapping with clusters, "
                              "users and contexts); fix --kubeconfig PATH")
        try:
            config.load_kube_config(config_file=path, client_configuration=configuration)
        except ConfigException as exc:
            raise ConfigError(f"kubeconfig: {path!r} cannot be used ({exc}); fix the file or "
                              "--kubeconfig PATH") from None
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException as exc:
            raise ConfigError(f"kube: in-cluster access needs the pod's service account and "
                              f"KUBERNETES_SERVICE_HOST ({exc}); outside a cluster use --kube "
                              "kubeconfig --kubeconfig PATH, --kube dry-run or --kube off") from None
    return client.ApiClient(configuration)


class AgentRuntime:
    """Everything ``healthagent run`` starts, with start/stop so the demo and tests can hold it."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        from healthagent.effects.state import StateStore
        from healthagent.sources.kmsg import KmsgCursor
        from healthagent.telemetry.metrics import Telemetry
        from healthagent.telemetry.server import AgentServer
        from healthagent.telemetry.training import TrainingIntake

        self.settings = settings
        self.stop_event = threading.Event()
        self.state = StateStore(settings.state_file)
        self.state.load()
        wake = threading.Event()
        cursor = KmsgCursor.from_dict(self.state.get("kmsg_cursor") or {})
        scheduled, event_sources, nvml = build_sources(settings, on_event=wake.set, kmsg_cursor=cursor)
        classifier = build_classifier(settings)
        classifier.restore_state(self.state.get("classifier") or {})
        self.telemetry = Telemetry(__version__)
        self.intake = TrainingIntake(settings.training_max_jobs, settings.training_job_idle_seconds)
        self.telemetry.registry.register(self.intake)
        host, port = settings.listen_address()
        self.server = AgentServer(self.telemetry, self.intake, host, port,
                                  training_token=settings.training_token)
        self.agent = Agent(
            settings, sources=scheduled, event_sources=event_sources, nvml=nvml,
            classifier=classifier, state=self.state, effects=build_effects(settings, self.state),
            telemetry=self.telemetry, intake=self.intake, wake=wake, clock=clock,
        )
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve HTTP and run the loop on a background thread."""
        try:
            self.server.start()
        except OSError as exc:  # port in use, address not on this host, name that does not resolve
            raise ConfigError(f"listen: cannot listen on {self.settings.listen} "
                              f"({exc.strerror or exc}); choose a free port or an address of this "
                              "host, e.g. --listen 0.0.0.0:9410") from None
        self._thread = threading.Thread(target=self.agent.run, args=(self.stop_event, self.server),
                                        name="healthagent-loop", daemon=True)
        self._thread.start()

    def stop(self, grace_seconds: float = 10.0) -> None:
        self.stop_event.set()
        self.agent.wake.set()
        if self._thread is not None:
            self._thread.join(grace_seconds)
        self.server.stop()


def run_agent(settings: Settings) -> int:
    """``healthagent run``: start, wait for SIGTERM/SIGINT, finish the write in flight, exit 0."""
    import signal

    runtime = AgentRuntime(settings)

    def _stop(signum, _frame) -> None:
        log.info("signal=%d stopping", signum)
        runtime.stop_event.set()
        runtime.agent.wake.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    runtime.start()
    while not runtime.stop_event.wait(1.0):
        pass
    runtime.stop()
    return 0
