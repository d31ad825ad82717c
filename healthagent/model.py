"""The records every layer shares.

Sources produce observations (``GpuSample``, ``XidEvent``; ``EfaSample``, ``RdmaPort``,
``PcieAerSample`` from ``model_fabric`` and ``AdapterEvent`` from ``model_adapter``, re-exported here) bundled in a ``Collection``; policy turns observations into
``Finding``s and one ``Verdict``; effects and telemetry read the verdict and the latest collection. Everything here is a frozen dataclass so a
record can be handed between the loop, the exporter's snapshot and the policy without copies or
locks: nobody can mutate what someone else is reading.

Counters that a GPU or driver does not support are ``None`` (NVML's ``NOT_SUPPORTED`` is normal on
MIG and older parts); ``0`` always means "supported and zero".
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from healthagent.model_adapter import AdapterCount, AdapterEvent
from healthagent.model_fabric import EfaSample, PcieAerSample, RdmaPort  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from healthagent.stage_history import StageHistory


class Action(str, enum.Enum):
    """What must happen to a node, ordered from mild to severe (a stable contract)."""

    NONE = "none"
    MONITOR = "monitor"
    RESTART_APP = "restart_app"
    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    REPLACE_NODE = "replace_node"

    @property
    def severity(self) -> int:
        return _ACTION_ORDER.index(self)

    @property
    def needs_node_action(self) -> bool:
        """True for actions that take the node out of the job (exit code 2 of ``check``)."""
        return self.severity >= Action.REBOOT_NODE.severity

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse an action name; raises ValueError naming the valid choices."""
        try:
            return cls(text.strip().lower())
        except ValueError:
            choices = ", ".join(a.value for a in cls)
            raise ValueError(f"unknown action {text!r}; use one of: {choices}") from None

    @staticmethod
    def most_severe(actions: "list[Action] | tuple[Action, ...]") -> "Action":
        return max(actions, key=lambda a: a.severity, default=Action.NONE)


_ACTION_ORDER = list(Action)


_PCI_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?$"
)


def canonical_pci_bus_id(raw: str) -> str | None:
    """Normalise any PCI id form to the lower-case ``dddd:bb:dd.f`` used everywhere.

    NVML says ``00000000:53:00.0`` (8-digit domain), the kernel's XID line says
    ``PCI:0000:53:00`` (no function), sysfs says ``0000:53:00.0``. A kernel-log XID finds its GPU
    only if all three agree, so this is the single place that decides the form. Returns None for
    text that is not a PCI id (callers count that as a parse error, they never guess).
    """
    text = raw.strip()
    if text[:4].upper() == "PCI:":
        text = text[4:]
    m = _PCI_RE.match(text)
    if not m:
        return None
    domain = int(m.group("domain") or "0", 16)
    if domain > 0xFFFF:
        return None
    return "{:04x}:{:02x}:{:02x}.{}".format(
        domain, int(m.group("bus"), 16), int(m.group("dev"), 16), m.group("fn") or "0"
    )


def natural_key(name: str) -> tuple:
    """Sort key that puts ``rdmap79s0`` before ``rdmap113s0`` (numbers by value, so PCI bus
    order), as a person reads device names. Shared by the EFA source and ``check``'s report."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


# NVIDIA's catalog: XID 79 = GPU_HAS_FALLEN_OFF_THE_BUS. The kernel logs "fallen off the bus"
# without an XID number; sources report it as ``XidEvent(kind="fallen_off_bus", xid=79)`` and
# policy counts it under this XID.
FALLEN_OFF_BUS_XID = 79
# The driver logs "RmInitAdapter failed" when it cannot initialise a GPU; sources report it as
# ``XidEvent(kind=INIT_FAILED, xid=0)`` and policy judges it against the GPUs NVML lists.
INIT_FAILED = "init_failed"


@dataclass(frozen=True)
class EccCounts:
    """ECC error counts of one GPU. None = not supported / ECC disabled."""

    volatile_corrected: int | None = None
    volatile_uncorrected: int | None = None
    aggregate_corrected: int | None = None
    aggregate_uncorrected: int | None = None


@dataclass(frozen=True)
class RemapState:
    """Row remapping (Ampere+): counts and the two flags that matter.

    ``pending`` means a remap is waiting for a GPU reset; ``failure`` means a remap could not be
    done (the bank is out of spare rows): NVIDIA's guidance is that the GPU must be replaced.
    """

    correctable: int | None = None
    uncorrectable: int | None = None
    pending: bool | None = None
    failure: bool | None = None


@dataclass(frozen=True)
class RetiredPages:
    """Dynamic page retirement (pre-Ampere; still reported on some parts)."""

    single_bit: int | None = None
    double_bit: int | None = None
    pending: bool | None = None


@dataclass(frozen=True)
class GpuSample:
    """Everything read about one GPU in one collection.

    ``lost`` is set when NVML answered GPU_IS_LOST (or the GPU vanished from the count); then the
    other fields are whatever was known before and must not be trusted.
    """

    index: int
    uuid: str
    pci_bus_id: str  # canonical dddd:bb:dd.f
    name: str = ""
    driver_version: str = ""
    source: str = "nvml"
    lost: bool = False
    ecc: EccCounts = field(default_factory=EccCounts)
    remap: RemapState = field(default_factory=RemapState)
    retired_pages: RetiredPages = field(default_factory=RetiredPages)
    # Active clock-event (throttle) reasons by name, e.g. ("hw_thermal_slowdown",).
    throttle_reasons: tuple[str, ...] = ()
    # Summed over links, by counter name: replay, recovery, crc_flit, crc_data.
    nvlink_errors: Mapping[str, int] = field(default_factory=dict)
    pcie_replay: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    timestamp: float = 0.0
    # What NVML showed since the last read that only a reset of this GPU (or a driver reload)
    # does, in words; "" when nothing did (``sources/nvml.py`` ``reset_seen``).
    reset: str = ""


@dataclass(frozen=True)
class XidEvent:
    """One XID (or NVSwitch SXid, fallen-off-the-bus, failed-initialisation) report, from the
    kernel log, NVML or dcgm-exporter.

    ``kind`` is "xid", "sxid", "fallen_off_bus" or "init_failed" (the driver could not initialise
    the GPU: ``RmInitAdapter failed``; ``xid`` is 0, it is no XID). ``pci_bus_id`` is canonical or
    "" when the source did not say (NVML events carry the device instead). ``seq``/``boot_id``
    identify a /dev/kmsg record so a restart neither repeats nor skips it. ``repeats`` is how many
    identical reports (same kind, XID and GPU) this one stands for: a source folds a flood of one
    XID into a few events and keeps the count here, so counting never costs one event per line.
    """

    xid: int
    pci_bus_id: str
    message: str
    line: str
    timestamp: float
    source: str = "kmsg"
    kind: str = "xid"
    gpu_index: int | None = None
    uuid: str = ""
    pid: int | None = None
    process_name: str = ""
    gpu_instance: int | None = None
    compute_instance: int | None = None
    seq: int | None = None
    boot_id: str = ""
    # Logged during an earlier boot (a kernel-log *file* line stamped before this boot began): the
    # classifier counts it as history and never opens a finding from it, because that boot's
    # faults were dealt with by the reboot (or the repair) that followed.
    previous_boot: bool = False
    repeats: int = 1


@dataclass(frozen=True)
class SourceHealth:
    """How one source did in its last collection; exported as source_up/source_errors_total."""

    source: str
    up: bool
    detail: str = ""
    # Cumulative error counts by kind ("parse", "unreadable", "timeout", "http_5xx", "lost", ...).
    errors: Mapping[str, int] = field(default_factory=dict)
    duration_seconds: float = 0.0
    # Parts this source knows are there but could not see (an EFA device whose sysfs answers
    # EACCES or EIO, a GPU dcgm-exporter lists without any health field): *unobserved*, which is
    # neither missing nor healthy, and never leads to a node action.
    unobserved: tuple[str, ...] = ()


@dataclass(frozen=True)
class Collection:
    """What the sources saw in one cycle (or, for event sources, since the last cycle)."""

    timestamp: float
    gpus: tuple[GpuSample, ...] = ()
    xids: tuple[XidEvent, ...] = ()
    efa: tuple[EfaSample, ...] = ()
    rdma: tuple[RdmaPort, ...] = ()
    adapter_events: tuple[AdapterEvent, ...] = ()  # mlx5 (ConnectX) kernel-log events
    aer: tuple[PcieAerSample, ...] = ()  # PCIe AER statistics of the GPUs' and NICs' functions
    health: tuple[SourceHealth, ...] = ()
    boot_id: str = ""
    # When the node booted, on the clock of ``timestamp`` (the decision clock: its epoch, the
    # moment the monotonic clock read zero). A rule's ``after_boot_grace`` is measured from it;
    # None = unknown, and no grace applies.
    boot_time: float | None = None
    # Inventory the node is expected to have (from config or the instance type); None = unknown.
    expected_gpus: int | None = None
    expected_efa_devices: int | None = None
    # A fact about the node object, read by the loop from the node watch's cache: an operator's
    # clear not handled yet (the ``healthagent.io/clear`` token; "taint-removed-<time>" when the
    # agent wrote it there because its taint was removed by hand). Policy closes the open findings
    # once per new token.
    operator_clear: str = ""
    # The verdict the node showed when the loop saw that clear (``Verdict.observation``): policy
    # closes only what was open then, so a fault observed after the operator cleared is a new
    # finding, never wiped with the old. None = unknown (every open finding is closed).
    operator_clear_as_of: int | None = None


@dataclass(frozen=True)
class Finding:
    """One thing wrong, with a stable code, the action it demands and evidence in plain words.

    ``key`` identifies the finding across cycles (code + subject + ``id``) so hysteresis, Events
    and state can tell "the same incident, still open" from "a new one". ``id`` is an integer the
    classifier gives each finding it opens (a counter kept in its state), so two findings never
    share a key, whatever their times.
    """

    code: str
    action: Action
    summary: str
    evidence: str
    next_steps: str
    gpu_index: int | None = None
    pci_bus_id: str = ""
    uuid: str = ""
    fabric_device: str = ""
    xids: tuple[int, ...] = ()
    count: int = 1
    first_seen: float = 0.0
    last_seen: float = 0.0
    id: int = 0

    @property
    def subject(self) -> str:
        if self.pci_bus_id:
            return self.pci_bus_id
        if self.fabric_device:
            return self.fabric_device
        return "node"

    @property
    def key(self) -> str:
        return f"{self.code}/{self.subject}/{self.id}"


@dataclass(frozen=True)
class Verdict:
    """The node's verdict: the most severe open finding decides the action."""

    action: Action
    findings: tuple[Finding, ...]
    timestamp: float
    # Subsystems this verdict could not see, so "no finding" there means "unknown", not "healthy":
    # "gpu" (no GPU source up while GPUs are expected or a GPU source is configured), "efa" (the
    # EFA source is down), "kernel_log" (the kernel-log source is down). Sorted, no repeats.
    unobserved: tuple[str, ...] = ()
    # The classifier's observation that produced this verdict (a count that only grows, kept in
    # the state file): an operator's clear names the verdict it acted on by this number, not by a
    # time, so a wall clock stepped back or forward cannot move what the clear covers.
    observation: int = 0
    # The last operator clear policy applied (the ``healthagent.io/clear`` token): the effects
    # carry out a clear they see on the node only with a verdict that already accounts for it,
    # so what it closes is policy's decision alone.
    clear_token: str = ""

    @classmethod
    def of(cls, findings: "tuple[Finding, ...] | list[Finding]", timestamp: float,
           unobserved: "tuple[str, ...] | list[str]" = (), observation: int = 0,
           clear_token: str = "") -> "Verdict":
        ordered = tuple(sorted(findings, key=lambda f: (-f.action.severity, f.code, f.subject)))
        action = ordered[0].action if ordered else Action.NONE
        return cls(action=action, findings=ordered, timestamp=timestamp,
                   unobserved=tuple(sorted(set(unobserved))), observation=observation, clear_token=clear_token)

    @property
    def exit_code(self) -> int:
        """``check``'s exit code: 0 healthy, 1 degraded, 2 node action required."""
        if self.action.needs_node_action:
            return 2
        if self.action.severity >= Action.MONITOR.severity:
            return 1
        return 0


@dataclass(frozen=True)
class XidCount:
    """Cumulative XIDs seen by this agent for one (GPU, XID); exported as a counter."""

    xid: int
    count: int
    gpu_index: int | None = None
    uuid: str = ""
    pci_bus_id: str = ""
    kind: str = "xid"


# Clock-event ("throttle") reason bits by the names the metrics and policy use. The bits are
# NVML's nvmlClocksThrottleReason* values, which DCGM's throttle-reasons field carries too
# (tests/sources/test_nvml.py checks them against the bindings).
THROTTLE_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)
KNOWN_THROTTLE_REASONS: tuple[str, ...] = tuple(name for name, _ in THROTTLE_REASONS)

# EFA hw_counters files that are not counters (``lifespan`` is a cache setting in ms): read, never
# exported as a counter.
EFA_NOT_COUNTERS = frozenset({"lifespan"})


# Kubernetes error kinds (the effects' and the node watch's tallies) that describe the API
# server's condition, not a fault of the agent or its setup: unreachable or overloaded, the node
# gone, another writer winning every retry, a watch window that moved on. They are exported as
# healthagent_kube_api_errors_total (and show in healthagent_kube_reachable); every other kind (a
# 403 from RBAC or the admission policy, a 422, a bug) is an internal error someone must fix.
API_CONDITION_KINDS: tuple[str, ...] = (
    "unavailable", "node_not_found", "conflicts_exhausted", "budget_count_failed",
    "watch_unavailable", "watch_expired", "watch_node_missing", "watch_rejected_404",
)


@dataclass(frozen=True)
class KubeStatus:
    """What the effects layer did and could do; exported as action metrics."""

    mode: str = "dry-run"  # in-cluster | kubeconfig | dry-run | off
    reachable: bool = False
    taint_effect: str = ""  # "" | "NoSchedule" | "NoExecute": the agent's taint now on the node
    budget_blocked: bool = False  # held at NoSchedule: the budget has no slot for the disruptive step
    budget_blocked_total: int = 0
    # Cumulative API writes by (kind, result): kind node|node_status|event, result ok|conflict|error.
    writes: Mapping[tuple[str, str], int] = field(default_factory=dict)
    pending_writes: int = 0  # desired state not yet applied (API down)
    # An operator's clear the effects see on the node and wait for policy to account for (the
    # token; "" when none). Informational: the loop reads the clear from the node itself.
    clear_pending: str = ""
    # The watch on the agent's own node is live (its copy of the node is as fresh as a read).
    # False in dry-run and while the watch is down (the effects then read the node on a timer).
    watching: bool = False
    # Cumulative API conditions by kind (unreachable, node gone, contention, watch window moved
    # on): the API server's state, not the agent's faults. Exported as
    # healthagent_kube_api_errors_total.
    api_errors: Mapping[str, int] = field(default_factory=dict)
    # The remediation pipeline as the node shows it (``effects/stage.py``): the agent's taint
    # value, whether a disruptive step is on, and which engine has the node ("" = none).
    taint_action: str = ""
    disruptive: bool = False
    engine: str = ""
    # The budget as this agent last read it: its scope ("" = the fleet's), limit and slots held;
    # None until a look (dry-run never looks).
    budget_scope: str = ""
    budget_limit: int | None = None
    budget_slots_held: int | None = None
    # Condition types of the agent's that another writer holds now (the agent leaves them alone).
    conditions_owned_elsewhere: int = 0
    # Decision-clock time of the next step the effects take by themselves (a grace's end, a held
    # node's next look at the budget); None: none. The effects worker wakes then.
    due_at: float | None = None
    # Per-GPU quarantine through DRA (``healthagent/dra``): (device path, uuid, pci_bus_id, stage =
    # the DeviceTaintRule's effect now) per quarantined GPU, and why GPU-scope findings act on the
    # node instead (dra_not_served, gpu_not_published, too_many_gpus).
    gpu_quarantines: tuple[tuple[str, str, str, str], ...] = ()
    dra_fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True)
class AgentSnapshot:
    """The state the exporter renders. The loop replaces it atomically after each cycle, so a
    scrape reads one consistent picture and does no I/O."""

    timestamp: float
    gpus: tuple[GpuSample, ...] = ()
    efa: tuple[EfaSample, ...] = ()
    rdma: tuple[RdmaPort, ...] = ()
    xid_counts: tuple[XidCount, ...] = ()
    adapter_counts: tuple[AdapterCount, ...] = ()
    health: tuple[SourceHealth, ...] = ()
    verdict: Verdict | None = None
    kube: KubeStatus = field(default_factory=KubeStatus)
    ready: bool = False
    # Inventory the node must have (Settings.expected_gpus / expected_efa_devices); None = unknown.
    expected_gpus: int | None = None
    expected_efa_devices: int | None = None
    # Failures the agent survived, cumulative by (component, kind): component state | kube |
    # policy | http | loop. Exported as healthagent_internal_errors_total.
    internal_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)
    names_folded: Mapping[str, int] = field(default_factory=dict)  # by source (bounded_names)
    # The remediation stage and its history (``stage_history.py``); None before the loop's first.
    stage: "StageHistory | None" = None
