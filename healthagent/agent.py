"""The loop: schedule sources, feed policy, publish the snapshot, hand the verdict to effects.

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

Kubernetes writes run on their own thread (``effects/worker.py``): the loop only submits the
verdict and reads the worker's last status, so an API server that is slow or down never delays
detection. The parts are built elsewhere (``wiring.py``) and handed in by constructor argument;
this module holds the loop's state (the one place with mutable state that lives across cycles).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from healthagent import __version__
from healthagent.config import Settings
from healthagent.model import (
    AdapterCount,
    AdapterEvent,
    AgentSnapshot,
    Collection,
    EfaSample,
    GpuSample,
    KubeStatus,
    RdmaPort,
    SourceHealth,
    Verdict,
    XidCount,
    XidEvent,
)
from healthagent.effects.stage import NodeSide, stage_of
from healthagent.stage_history import StageHistory, started
from healthagent.sources.base import EventSource, Source, SourceResult, XidEventQueue
from healthagent.sources.kernel_log.wake import DataWaiter, Doorbell

if TYPE_CHECKING:  # types only: the loop imports none of these parts, it is handed them
    from healthagent.effects.state import StateStore
    from healthagent.effects.worker import EffectsWorker
    from healthagent.policy.classify import Classifier
    from healthagent.telemetry.metrics import Telemetry
    from healthagent.telemetry.server import AgentServer
    from healthagent.training.intake import TrainingIntake

log = logging.getLogger(__name__)

# The longest single sleep: a ``stop`` set without ringing the wake is seen within this.
IDLE_SLICE_SECONDS = 1.0


@dataclass
class Scheduled:
    """A periodic source and when it is next due."""

    source: Source
    interval: float
    next_due: float = 0.0
    last: SourceResult | None = None


def enrich_xid(event: XidEvent, gpus: tuple[GpuSample, ...]) -> XidEvent:
    """Attach GPU index/UUID to a kernel-log XID by its canonical PCI id (every source and the kernel log agree on that form)."""
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
            xid=event.xid, count=(old.count if old else 0) + max(1, event.repeats), gpu_index=event.gpu_index,
            uuid=event.uuid, pci_bus_id=event.pci_bus_id, kind=event.kind,
        )

    def snapshot(self) -> tuple[XidCount, ...]:
        return tuple(self.counts.values())


@dataclass
class AdapterTally:
    """Cumulative mlx5 (ConnectX) events by (device, PCI id, event): the data behind
    ``healthagent_mlx5_events_total``; a folded flood adds its full count."""

    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def add(self, events: Sequence[AdapterEvent]) -> None:
        for event in events:
            key = (event.device, event.pci_bus_id, event.event)
            self.counts[key] = self.counts.get(key, 0) + max(1, event.repeats)

    def snapshot(self) -> tuple[AdapterCount, ...]:
        return tuple(AdapterCount(event=e, count=n, pci_bus_id=pci, device=d) for (d, pci, e), n in self.counts.items())


LOGGED_XIDS = 12  # distinct XIDs a log line names; the rest are counted, never listed


def xid_summary(events: Sequence[XidEvent]) -> str:
    """``13x49999,94``: each XID once with its count (repeats included), in XID order (the real ones
    are small numbers), so a flood of a million XIDs logs one short line, not a million numbers."""
    counts: Counter[tuple[int, str]] = Counter()
    for event in events:
        name = "init_failed" if event.kind == "init_failed" else str(event.xid)
        counts[(event.xid, name)] += max(1, event.repeats)
    shown = sorted(counts)[:LOGGED_XIDS]
    text = ",".join(name if counts[key] == 1 else f"{name}x{counts[key]}" for key in shown for name in (key[1],))
    rest = len(counts) - len(shown)
    return f"{text},+{rest} more" if rest > 0 else text


def _findings_signature(verdict: Verdict | None) -> frozenset:
    """What the state file must hold before effects act: which findings are open, at which action
    (the effects' Events and taints key on exactly these)."""
    return frozenset((f.key, f.action) for f in verdict.findings) if verdict is not None else frozenset()


class Agent:
    """The loop over parts it is handed: sources, classifier, state store, effects worker, exporter.

    ``event_sources`` are read every cycle and hold the one read position the state file keeps
    (the kernel log); ``sources`` are the periodic ones; ``nvml`` is the queue NVML's event thread
    fills. ``boot_id``, ``boot_time`` and the expected inventory are facts about the node, read
    by the wiring.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        sources: list[Scheduled],
        event_sources: Sequence[EventSource],
        classifier: Classifier,
        state: StateStore,
        nvml: XidEventQueue | None = None,
        effects_worker: EffectsWorker | None = None,
        telemetry: Telemetry | None = None,
        intake: TrainingIntake | None = None,
        boot_id: str = "",
        boot_time: float | None = None,
        expected_gpus: int | None = None,
        expected_efa_devices: int | None = None,
        wake: Doorbell | None = None,
        data_waiter: Callable[[], DataWaiter | None] | None = None,
        clock: Callable[[], float] = time.time,
        wall: Callable[[], float] | None = None,
        node_clear: Callable[[], str] | None = None,
    ) -> None:
        """``clock`` is the decision clock: every time policy and effects measure a duration on
        (``clock.DecisionClock`` in ``healthagent run``: it never jumps). ``wall`` is wall time,
        for what people read (the exporter's last-collection time); None: ``clock`` is both.
        ``node_clear`` reads an operator's clear not handled yet from the node watch's cache (a
        fact about the node, handed to policy in the ``Collection``); None: no node to read.
        ``boot_time``: the node's boot on ``clock`` (None: unknown, so no rule's grace after the
        boot applies)."""
        if len(event_sources) > 1:
            raise ValueError("one event source (the kernel log): the state file keeps one cursor")
        self.settings = settings
        self.scheduled = sources
        self.event_sources = list(event_sources)  # collected every cycle (kernel log)
        self.nvml = nvml  # its take_events() is drained every cycle
        self.classifier = classifier
        self.state = state
        self.effects_worker = effects_worker
        self.telemetry = telemetry
        self.intake = intake
        self.clock = clock
        self.wall = wall or clock
        self.node_clear = node_clear or (lambda: "")
        self.boot_id = boot_id
        self.boot_time = boot_time
        self.expected_gpus = expected_gpus
        self.expected_efa_devices = expected_efa_devices
        self.wake = wake or Doorbell()
        # The kernel log's waiter (``KmsgSource.data_waiter``): wakes the loop when it has data.
        self.data_waiter = data_waiter or (lambda: None)
        self.xids = XidTally()
        self.adapters = AdapterTally()  # mlx5 (ConnectX) events: healthagent_mlx5_events_total
        self.verdict: Verdict | None = None
        self.cycles = 0
        self.state_saves = 0  # times the loop saved the cursor + classifier state
        self._saved_findings: frozenset | None = None  # (key, action) of the open findings last saved
        self._saved_at: float | None = None  # loop clock of that save
        self._health: dict[str, SourceHealth] = {}
        self._source_errors: dict[str, Mapping[str, int]] = {}  # each source's own cumulative tally
        self._raised: Counter[str] = Counter()  # collect() calls that raised, by source (cumulative)
        self.loop_errors: Counter[str] = Counter()  # cycle / persist failures the loop survived
        self.server: AgentServer | None = None  # what ``run`` heartbeats (its refusals are exported)
        self._no_effects = KubeStatus(mode=settings.kube)
        self.stage: StageHistory = started(self.clock(), self.wall())  # the remediation pipeline

    @property
    def kube_status(self) -> KubeStatus:
        """What the effects last reported (the worker's status), or the mode alone without effects."""
        return self.effects_worker.status if self.effects_worker is not None else self._no_effects

    # -- one cycle -------------------------------------------------------------------------------

    def cycle(self) -> Verdict:
        """Read what is due, decide, persist, hand off. Never raises for a source's sake."""
        now = self.clock()
        new_xids: list[XidEvent] = []
        adapter_events: list[AdapterEvent] = []
        for source in self.event_sources:
            result = self._collect(source, now)
            new_xids.extend(result.xids)
            adapter_events.extend(result.adapter_events)
        if self.nvml is not None:
            new_xids.extend(self.nvml.take_events())
        fresh_periodic = False
        for item in self.scheduled:
            if item.next_due > now + item.interval:
                # A clock that went back (an injected one; the decision clock never does): a due
                # time further ahead than one interval cannot be, so it is now, rather than the
                # GPU and EFA sources sleeping for as long as the clock jumped.
                item.next_due = now
            if now >= item.next_due:
                item.last = self._collect(item.source, now)
                item.next_due = now + item.interval
                new_xids.extend(item.last.xids)
                fresh_periodic = True
        gpus = self._latest_gpus()
        efa = tuple(s for item in self.scheduled if item.last for s in item.last.efa)
        rdma = tuple(p for item in self.scheduled if item.last for p in item.last.rdma)
        aer = tuple(a for item in self.scheduled if item.last for a in item.last.aer)
        enriched = tuple(enrich_xid(x, gpus) for x in new_xids)
        operator_clear = self.node_clear()  # a fact about the node object, from the watch's cache
        cleared = bool(operator_clear) and operator_clear != self.classifier.clear_token
        new_events = bool(enriched or adapter_events)
        if self.verdict is None or new_events or fresh_periodic or cleared:
            collection = Collection(
                timestamp=now, gpus=gpus, xids=enriched, efa=efa, rdma=rdma, aer=aer, adapter_events=tuple(adapter_events),
                health=tuple(self._health.values()), boot_id=self.boot_id, boot_time=self.boot_time,
                expected_gpus=self.expected_gpus,
                expected_efa_devices=self.expected_efa_devices, operator_clear=operator_clear,
                # what the node showed when the operator cleared: the verdict published before
                operator_clear_as_of=self.verdict.observation if self.verdict is not None else None,
            )
            assessment = self.classifier.observe(collection)
            verdict = assessment.verdict
            if cleared:
                log.warning("operator_clear token=%s findings_cleared=%d", operator_clear, assessment.cleared)
            # The classifier drops the copies of one XID that several sources report (kmsg + NVML
            # event + dcgm), so the counter counts what it counted, once.
            for event in assessment.counted_xids:
                self.xids.add(event)
            self.adapters.add(assessment.adapter_events)
            if enriched:
                log.info("xids=%s verdict=%s", xid_summary(enriched), verdict.action.value)
            if adapter_events:
                log.info("mlx5_events=%s verdict=%s", ",".join(sorted({e.event for e in adapter_events})),
                         verdict.action.value)
            findings = _findings_signature(verdict)
            if new_events or cleared or findings != self._saved_findings:
                self._persist(now, findings)  # before effects act: the SIGKILL contract
            self._set_verdict(verdict)
        if self._saved_at is None or not 0 <= now - self._saved_at < self.settings.state_save_interval_seconds:
            self._persist(now, _findings_signature(self.verdict))  # counter histories, cursor over noise
        self.cycles += 1
        self._publish(now, gpus, efa, rdma)
        return self.verdict

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
        try:
            for source in self.event_sources:
                self.state.put("kmsg_cursor", source.cursor.to_dict())
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
            self.intake.note_fault(self.wall())  # compared with the ranks' wall-clock reports
        if self.effects_worker is not None:
            self.effects_worker.submit(verdict, tuple(self._health.values()))

    def _publish(self, now: float, gpus: tuple[GpuSample, ...], efa: tuple[EfaSample, ...],
                 rdma: tuple[RdmaPort, ...] = ()) -> None:
        kube = self.kube_status
        stage, reason = stage_of(self.verdict, kube.taint_effect, kube.budget_blocked,
                                 NodeSide(kube.taint_action, kube.disruptive, kube.engine), self.stage, now,
                                 self.settings.replace_noexecute_grace_seconds, taints=kube.mode != "off")
        self.stage = self.stage.advance(stage, reason, now, self.wall())
        if self.telemetry is None:
            return
        self.telemetry.publish(AgentSnapshot(
            timestamp=self.wall(), gpus=gpus, efa=efa, rdma=rdma, xid_counts=self.xids.snapshot(), stage=self.stage,
            adapter_counts=self.adapters.snapshot(),
            health=tuple(self._health.values()), verdict=self.verdict, kube=kube,
            ready=self.ready, expected_gpus=self.expected_gpus,
            expected_efa_devices=self.expected_efa_devices,
            internal_errors=self.internal_errors(), names_folded=self.classifier.names_folded(),
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
        return self.kube_status.reachable

    # -- the loop ----------------------------------------------------------------------------------

    def next_wait(self) -> float:
        """Seconds until a periodic source is due (at most ``settings.idle_seconds``: the liveness
        probe wants a cycle within its heartbeat timeout, whatever the source intervals); at most the
        kernel-log poll interval when the kernel log has no waiter to wake the loop."""
        now = self.clock()
        if any(source.backlog for source in self.event_sources):
            return 0.0  # the kernel log has more to read now: waiting would only delay it
        idle = self.settings.idle_seconds
        due = min((item.next_due for item in self.scheduled), default=now + idle)
        longest = idle if self.data_waiter() is not None else self.settings.kmsg_poll_seconds
        return max(0.0, min(due - now, longest))

    def idle(self, stop: threading.Event) -> None:
        """Sleep until the next cycle is due: the kernel log has data, the wake rang (NVML's event
        thread, a stop request), a periodic source is due, or ``stop`` was set."""
        deadline = time.monotonic() + self.next_wait()
        while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            waiter = self.data_waiter()
            if waiter is None:
                self.wake.wait(left)  # polled: next_wait was at most kmsg_poll_seconds
                return
            try:
                if waiter.wait(min(left, IDLE_SLICE_SECONDS), self.wake):
                    return
            except (OSError, ValueError):  # a bug the loop survives: it polls this turn instead
                self.loop_errors["cycle"] += 1
                log.exception("waiting for the kernel log failed; polling it this time")
                self.wake.wait(min(left, self.settings.kmsg_poll_seconds))
                return

    def start_effects(self) -> None:
        """Start the effects thread (``run`` does; a caller driving ``cycle`` by hand may)."""
        if self.effects_worker is not None:
            self.effects_worker.start()

    def run(self, stop: threading.Event, server: AgentServer | None = None, owns_process: bool = False) -> None:
        """Cycle until ``stop`` is set; then let the write in flight finish and save state.

        ``owns_process``: the agent is the whole process (``healthagent run``), so after its first
        cycle it freezes what is alive (``freeze_warm_objects``, a process-wide act); the demo and
        the tests, which run it inside another process, leave the garbage collector alone."""
        self.start_effects()
        self.server = server
        log.info("agent started version=%s node=%s kube=%s host_root=%s", __version__,
                 self.settings.node_name or "-", self.settings.kube, self.settings.host_root)
        frozen = not owns_process
        while not stop.is_set():
            try:
                self.cycle()
            except Exception:  # the loop outlives any bug in one cycle; the metric shows it
                self.loop_errors["cycle"] += 1
                log.exception("cycle failed")
            if not frozen and self.cycles:
                frozen = True
                freeze_warm_objects()
            if server is not None:
                server.heartbeat(self.clock())
                server.set_ready(self.ready)
            self.idle(stop)
            self.wake.clear()
        self.shutdown()

    def shutdown(self, grace_seconds: float = 10.0) -> None:
        """Let the effects' write in flight finish, save the state one last time, close sources."""
        if self.effects_worker is not None:
            self.effects_worker.stop(grace_seconds)
        self._persist()
        for item in self.scheduled:
            _close(item.source)
        for source in self.event_sources:
            _close(source)
        log.info("agent stopped")


def freeze_warm_objects() -> None:
    """Take every object alive after the first cycle (imported modules, the catalogs, the first
    snapshot's caches) out of the cyclic garbage collector's full collections (``gc.freeze``).

    Why: a full collection walks every tracked object, about 35,000 in a warm agent, and took
    10-15 ms on a 2-vCPU node every few minutes, landing inside a cycle or a scrape's render (the
    render's p99 went from under 8 ms to 20 ms). What is frozen lives as long as the process; an
    object among them that dies later is still freed by reference counting, only a reference
    cycle among them would stay (the agent makes none at start-up that it later drops)."""
    gc.freeze()


def _close(source: Source) -> None:
    """Close one source; a failing close is logged and never stops the others from closing."""
    try:
        source.close()
    except Exception:
        log.exception("source=%s close failed", source.name)
