"""Wiring: every part of the agent built from ``Settings`` and joined by constructor arguments.

Why one place: the loop (``agent.py``), the sources, policy, effects and telemetry never look
each other up or probe what another object happens to have; this module decides which parts a
setting asks for, reads the facts about the node they need (boot id, expected inventory, the state
saved by the previous run), and hands each part exactly what it uses. ``check`` uses the same
builders for its one collection, so what ``check`` reads is what ``run`` reads.

Heavy or cluster-only imports (``kubernetes``, ``pynvml`` through the NVML source) stay inside
the builders that need them, so ``check`` starts fast on a bare node image. Nothing here compiles
or loads a stub library: NVML is whatever ``libnvidia-ml.so.1`` the dynamic loader finds (the demo
and the tests arrange the stub themselves, ``healthagent/demo/stub_setup.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from healthagent import __version__
from healthagent.agent import Agent, Scheduled
from healthagent.clock import STATE_KEY as CLOCK_STATE_KEY
from healthagent.clock import DecisionClock, fresh_epoch, restore_epoch, saved_epoch
from healthagent.config import ConfigError, Settings, read_yaml
from healthagent.effects.kube import NodeEffects
from healthagent.effects.state import StateStore
from healthagent.effects.worker import EffectsWorker
from healthagent.policy.catalog import load_catalog
from healthagent.policy.classify import Classifier
from healthagent.policy.debounce_file import reading_intervals
from healthagent.policy.settings import load_policy
from healthagent.policy.scope import ScopePolicy
from healthagent.dra.effects import with_dra
from healthagent.sources.base import DeadlineSource, Source, read_boot_id
from healthagent.sources.dcgm import DcgmSource
from healthagent.sources.efa import EfaSource
from healthagent.sources.instance import resolve_expected
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.source import KmsgSource
from healthagent.sources.kernel_log.wake import Doorbell
from healthagent.sources.pcie_aer import PcieAerSource
from healthagent.sources.rdma import RdmaSource
from healthagent.telemetry.metrics import Telemetry
from healthagent.telemetry.server import AgentServer, ListenError
from healthagent.training.access import IntakeAccess
from healthagent.training.intake import TrainingIntake

if TYPE_CHECKING:  # types only: the NVML source loads pynvml, which only its builder needs
    from healthagent.sources.nvml import NvmlSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sources:
    """The sources the settings ask for: periodic ones (each under its deadline), the kernel log
    (read every cycle) and NVML itself, whose XID queue the loop drains (``None`` when off)."""

    scheduled: list[Scheduled]
    kernel_log: KmsgSource
    nvml: NvmlSource | None

    def all(self) -> list[Source]:
        """Every source the loop collects (periodic first), for a one-off collection or closing."""
        return [item.source for item in self.scheduled] + [self.kernel_log]


def expected_inventory(settings: Settings) -> tuple[int | None, int | None]:
    """(GPUs, EFA devices) the node must have: each configured value, else the instance type's
    (``sources/instance.py``); None where neither says."""
    return resolve_expected(settings.host_root, settings.expected_gpus, settings.expected_efa_devices,
                            efa_from_table=settings.efa_expected_from_instance_type)


def build_sources(settings: Settings, on_event: Callable[[], None] | None = None,
                  kmsg_cursor: KmsgCursor | None = None, clock: DecisionClock | None = None) -> Sources:
    """The sources the settings ask for. ``on_event``: called by NVML's event thread when an XID
    arrives (wakes the loop); ``kmsg_cursor``: where the previous run stopped reading; ``clock``:
    the decision clock that NVML's events and the kernel log's records are stamped on (None: each
    source's own, for a one-off collection)."""
    # Periodic sources run under a deadline (DeadlineSource): a wedged driver or filesystem must
    # never hold the loop, which also reads the kernel log and drives the effects.
    deadline = settings.source_timeout_seconds
    scheduled: list[Scheduled] = []
    nvml = None
    if settings.nvml:
        # deferred: with NVML off (--no-nvml, a node without GPUs) pynvml is never loaded
        from healthagent.sources.nvml import NvmlSource

        nvml = NvmlSource(expected_gpus=expected_inventory(settings)[0], on_event=on_event,
                          clock=clock or time.time)
        # The loop drains nvml.take_events() itself (a queue, never a driver call).
        scheduled.append(Scheduled(DeadlineSource(nvml, deadline), settings.nvml_interval_seconds))
    scheduled.append(Scheduled(DeadlineSource(EfaSource(settings.host_root), deadline),
                               settings.efa_interval_seconds))
    scheduled.append(Scheduled(DeadlineSource(RdmaSource(settings.host_root), deadline),
                               settings.rdma_interval_seconds))
    # PCIe AER statistics are sysfs files like the RDMA ports' and read on their schedule.
    scheduled.append(Scheduled(DeadlineSource(PcieAerSource(settings.host_root), deadline),
                               settings.rdma_interval_seconds))
    if settings.dcgm_url:
        dcgm = DcgmSource(settings.dcgm_url, settings.dcgm_timeout_seconds)
        scheduled.append(Scheduled(DeadlineSource(dcgm, max(deadline, 2 * settings.dcgm_timeout_seconds)),
                                   settings.dcgm_interval_seconds))
    kmsg = KmsgSource(settings.host_root, settings.kernel_log, cursor=kmsg_cursor,
                      max_records_per_cycle=settings.kmsg_max_records_per_cycle,
                      epoch=clock.epoch if clock is not None else None)
    return Sources(scheduled=scheduled, kernel_log=kmsg, nvml=nvml)


def build_classifier(settings: Settings) -> Classifier:
    """The classifier with the catalog and the operator's policy file (if any) merged in."""
    policy = load_policy(settings.policy_file, reading_intervals(settings))
    return Classifier(policy, load_catalog(policy))


def build_effects(settings: Settings, state: StateStore, scope: ScopePolicy | None = None) -> NodeEffects | None:
    """NodeEffects for the configured Kubernetes mode; None when kube=off (no effects at all).
    ``scope`` is the loaded policy's (the runtime passes its classifier's); None reads the file."""
    if settings.kube == "off":
        return None
    # One rule for every mode that writes or shows writes (in-cluster, kubeconfig, dry-run): the
    # node is the one named, never a guess from the hostname, which in a pod is the pod's name.
    if not settings.node_name:
        raise ConfigError(f"node_name: kube={settings.kube} acts on one node and must be told which; "
                          "set NODE_NAME from the downward API (spec.nodeName) or pass --node-name "
                          "(--kube off needs none)")
    if settings.kube == "dry-run":
        return NodeEffects(settings, None, state)
    api_client = kube_api_client(settings)
    if scope is None:
        scope = load_policy(settings.policy_file, reading_intervals(settings)).scope
    return with_dra(scope, settings, NodeEffects(settings, api_client, state), api_client)


def kube_api_client(settings: Settings) -> Any:
    """The ``kubernetes`` ApiClient for kube=in-cluster or kubeconfig; a setup the client cannot
    use is a ConfigError (one line naming the setting and the fix), never a traceback."""
    # deferred: the kubernetes client takes a third of a second to load; only a cluster mode needs it
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    if settings.kube == "kubeconfig":
        path = settings.kubeconfig or ""
        # Read it first: the client answers a missing file, a file of another shape or broken
        # YAML with a misleading message or a TypeError.
        # kubectl and the client accept a key given twice (the last wins): so does this first read.
        data = read_yaml(path, "kubeconfig", "--kubeconfig PATH", ConfigError, unique_keys=False,
                         max_bytes=16 * 1024 * 1024)
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


def listen_error_words(exc: ListenError) -> str:
    """The one line for a listener that could not bind: the address that failed (the other
    listener is fine) and the flag that moves it."""
    setting = exc.setting
    flag = "--listen" if setting == "listen" else "--training-listen"
    off = ", or --training-intake off for no intake" if setting == "training_listen" else ""
    return (f"{setting}: cannot listen on {exc.address} ({exc.strerror or exc}); "
            f"give {flag} a free port on an address of this host, e.g. {flag} 0.0.0.0:PORT "
            f"(port 0 picks a free one){off}")


class AgentRuntime:
    """Everything ``healthagent run`` starts, built from ``settings``, with start/stop so the
    command, the demo and the tests hold the same object."""

    def __init__(self, settings: Settings, clock: Callable[[], float] | None = None,
                 wall: Callable[[], float] | None = None, effects_wrap: Callable[[Any], Any] | None = None) -> None:
        """``clock``: the decision clock (default: ``DecisionClock`` over this boot's epoch, kept
        in the state file); ``wall``: wall time for what people read (default ``time.time``, or
        ``clock`` itself when a caller hands one clock); ``effects_wrap``: wraps the effects
        before they start (``demo --dra`` puts its dry-run DRA layer around the node's)."""
        self.settings = settings
        self.stop_event = threading.Event()
        self.state = StateStore(settings.state_file)
        self.state.load()
        wake = Doorbell()  # NVML's event thread and a stop request wake the loop through it
        boot_id = read_boot_id(settings.host_root)
        decision_clock = DecisionClock(restore_epoch(self.state.get(CLOCK_STATE_KEY), boot_id, fresh_epoch()))
        self.state.put(CLOCK_STATE_KEY, saved_epoch(boot_id, decision_clock.epoch))
        if clock is None:
            clock, wall = decision_clock, wall or time.time
        cursor = KmsgCursor.from_dict(self.state.get("kmsg_cursor") or {})
        sources = build_sources(settings, on_event=wake.set, kmsg_cursor=cursor,
                                clock=decision_clock if clock is decision_clock else None)
        classifier = build_classifier(settings)
        classifier.restore_state(self.state.get("classifier") or {})
        self.telemetry = Telemetry(__version__)
        self.intake = TrainingIntake(settings.training_max_jobs, settings.training_job_idle_seconds)
        self.telemetry.registry.register(self.intake)
        host, port = settings.listen_address()
        # Two listeners: the agent's own port (metrics, probes) and the training intake's.
        intake_listen = None if settings.training_intake == "off" else settings.training_listen_address()
        self.server = AgentServer(self.telemetry, self.intake, host, port, intake_listen=intake_listen,
                                  access=IntakeAccess(settings.training_intake, settings.training_token))
        # What the node must have: the settings, else the instance type's row (sources/instance.py).
        expected_gpus, expected_efa_devices = expected_inventory(settings)
        log.info("expected inventory gpus=%s efa_devices=%s", expected_gpus, expected_efa_devices)
        effects = build_effects(settings, self.state, classifier.policy.scope)
        if effects is not None and effects_wrap is not None:
            effects = effects_wrap(effects)
        worker = None
        if effects is not None:
            # A changed status (a write landed, the API server gone) wakes the loop, which
            # publishes it to /metrics at once.
            worker = EffectsWorker(effects, boot_id, clock, wall=wall or clock, on_status=wake.set)
            # The node watch wakes the worker when an operator or another controller changes what
            # the effects own, and the loop, which hands an operator's clear to policy: a clear
            # applies at once, not on the next retry.
            effects.on_change = _both(worker.wake, wake.set)
        self.agent = Agent(
            settings, sources=sources.scheduled, event_sources=[sources.kernel_log], nvml=sources.nvml,
            classifier=classifier, state=self.state, effects_worker=worker, telemetry=self.telemetry,
            intake=self.intake, boot_id=boot_id, expected_gpus=expected_gpus,
            # the decision clock's epoch is the moment its monotonic clock read zero: the boot
            boot_time=decision_clock.epoch if clock is decision_clock else None,
            expected_efa_devices=expected_efa_devices, wake=wake, clock=clock, wall=wall,
            data_waiter=sources.kernel_log.data_waiter,  # the kernel log wakes the loop when written
            node_clear=effects.pending_clear if effects is not None else None,
        )
        self._thread: threading.Thread | None = None

    def start(self, owns_process: bool = False) -> None:
        """Serve HTTP and run the loop on a background thread (``owns_process``: see ``Agent.run``)."""
        try:
            self.server.start()
        except ListenError as exc:  # port in use, address not on this host, name that does not resolve
            raise ConfigError(listen_error_words(exc)) from None
        self._thread = threading.Thread(target=self.agent.run, args=(self.stop_event, self.server, owns_process),
                                        name="healthagent-loop", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to stop (safe from a signal handler): it finishes its cycle, then stops."""
        self.stop_event.set()
        self.agent.wake.set()

    def stop(self, grace_seconds: float = 10.0) -> None:
        """Stop the loop (the write in flight finishes, state is saved), then the HTTP server."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(grace_seconds)
        self.server.stop()


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    """One callback that calls two (the node watch wakes the effects worker and the loop)."""
    def call() -> None:
        first()
        second()
    return call
