"""NVML source: GPU inventory and health counters through the official bindings (``pynvml``), and
XID events from an NVML event set on a background thread.

What NVML says is an observation, never an exception:
- ``NOT_SUPPORTED`` (or a call the installed driver lacks) for a field is normal (MIG, older
  parts, Hopper's retired pages): the field is None and nothing is counted.
- ``GPU_IS_LOST`` on any call makes the GPU's sample ``lost=True`` with the identity of its last
  good read, so policy sees GPU_LOST; a GPU that vanishes from the device count is reported the
  same way. Both are counted (``lost``, ``vanished``) once per episode.
- No library / no driver (a node without NVIDIA's driver, a pod without it mounted) makes the source
  report ``up=False`` "unavailable: ..." and retry at most every ``INIT_RETRY_SECONDS``; collect
  returns at once in between, so the agent goes on with its other sources.

The XID thread waits in ``nvmlEventSetWait_v2`` with a short timeout so ``close`` stops it within
half a second; it never touches the loop's data except through the bounded queue that
``take_events`` drains, and it wakes the loop through ``on_event``.

Error kinds counted in ``SourceHealth.errors``: ``unavailable`` (init failed), ``nvml_error`` (a
call failed for another reason than the above), ``lost``, ``vanished``, ``parse`` (unreadable PCI
id), ``event_gpu_lost`` / ``event_error`` (the event set had to be rebuilt), ``events_dropped``
(queue full), ``callback_error`` (``on_event`` raised), ``exception`` (a bug; collect still returned).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

import pynvml

from healthagent.model import (
    EccCounts,
    GpuSample,
    RemapState,
    RetiredPages,
    SourceHealth,
    XidEvent,
    canonical_pci_bus_id,
)
from healthagent.common import ErrorTally
from healthagent.sources.base import SourceResult

log = logging.getLogger(__name__)

INIT_RETRY_SECONDS = 60.0
EVENT_WAIT_MS = 500
EVENT_QUEUE_MAX = 10_000
EVENT_BACKOFF_MAX_SECONDS = 30.0
CLOSE_JOIN_SECONDS = 5.0
MAX_REMEMBERED_GPUS = 256

# Clock-event ("throttle") reason bits by the names the metrics and policy use.
THROTTLE_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", pynvml.nvmlClocksThrottleReasonGpuIdle),
    ("applications_clocks_setting", pynvml.nvmlClocksThrottleReasonApplicationsClocksSetting),
    ("sw_power_cap", pynvml.nvmlClocksThrottleReasonSwPowerCap),
    ("hw_slowdown", pynvml.nvmlClocksThrottleReasonHwSlowdown),
    ("sync_boost", pynvml.nvmlClocksThrottleReasonSyncBoost),
    ("sw_thermal_slowdown", pynvml.nvmlClocksThrottleReasonSwThermalSlowdown),
    ("hw_thermal_slowdown", pynvml.nvmlClocksThrottleReasonHwThermalSlowdown),
    ("hw_power_brake_slowdown", pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown),
    ("display_clock_setting", pynvml.nvmlClocksThrottleReasonDisplayClockSetting),
)
KNOWN_THROTTLE_REASONS: tuple[str, ...] = tuple(name for name, _ in THROTTLE_REASONS)

NVLINK_COUNTERS: tuple[tuple[str, int], ...] = (
    ("replay", pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    ("recovery", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
    ("crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    ("crc_data", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
)

# XID critical errors are what we are here for; DBE/SBE events are registered where supported so
# an ECC event is logged the moment it happens (the counters carry it into policy; the driver also
# logs a DBE as XID 48, which arrives as an XID event).
XID_EVENT = pynvml.nvmlEventTypeXidCriticalError
ECC_EVENTS = pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
WANTED_EVENTS = XID_EVENT | ECC_EVENTS
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId when the event is not from a MIG instance

_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
_NVML_GONE = (pynvml.NVML_ERROR_UNINITIALIZED, pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
              pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
_PLAIN_WORDS = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        "libnvidia-ml.so.1 not found (no NVIDIA driver on this node, or not mounted into the pod)",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        "NVML and the kernel driver differ in version (driver upgraded without a reboot?)",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA devices",
}


def describe_nvml_error(exc: pynvml.NVMLError) -> str:
    """One line for an NVML error that works even when the library itself is missing."""
    code = getattr(exc, "value", None)
    if code in _PLAIN_WORDS:
        return f"{_PLAIN_WORDS[code]} [{type(exc).__name__}]"
    try:
        text = str(exc)
    except Exception:  # str() calls into the library, which may be the thing that is broken
        text = ""
    return f"{type(exc).__name__} (code {code}){': ' + text if text else ''}"


class _GpuLost(Exception):
    """Internal: a call answered GPU_IS_LOST; the GPU's sample becomes a lost sample."""


@dataclass(frozen=True)
class GpuIdentity:
    """Who a GPU is: what an XID event needs to name its GPU."""

    index: int
    uuid: str
    pci_bus_id: str


def _handle_key(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def _instance(value: int) -> int | None:
    return None if value == NO_INSTANCE else int(value)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class XidEventThread:
    """Waits on an NVML event set and turns each XID critical error into an ``XidEvent``.

    The first event set is built in the caller's thread (``start``), so events that happen after
    the first collection returns are never missed. A GPU lost while waiting, or a changed inventory
    (``update``), makes the thread build a fresh set over the GPUs that still answer. Repeated
    failures back off exponentially up to ``EVENT_BACKOFF_MAX_SECONDS``; every failure is counted.
    """

    def __init__(self, tally: ErrorTally, deliver: Callable[[XidEvent], None]) -> None:
        self._tally = tally
        self._deliver = deliver
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._wanted: tuple[GpuIdentity, ...] = ()
        self._built_for: tuple[GpuIdentity, ...] | None = None
        self._event_set = None
        self._registered: dict[int | None, GpuIdentity] = {}
        self._thread = threading.Thread(target=self._run, name="healthagent-nvml-events", daemon=True)
        self._built = threading.Condition()
        self.sets_built = 0

    def start(self, gpus: tuple[GpuIdentity, ...]) -> None:
        self._wanted = gpus
        try:
            self._rebuild()
        except Exception as exc:  # the thread retries; start must not fail the collection
            self._tally.count("event_error", f"building the event set raised {exc!r}")
        self._thread.start()

    def update(self, gpus: tuple[GpuIdentity, ...]) -> None:
        """The inventory the collector saw; when it changes, the thread builds a fresh set."""
        with self._lock:
            self._wanted = gpus

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_built(self, count: int, timeout: float) -> bool:
        """Block until ``count`` event sets have been built (tests and benchmarks sync on this)."""
        with self._built:
            return self._built.wait_for(lambda: self.sets_built >= count, timeout)

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._free()

    # -- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                failures = self._step(failures)
            except Exception as exc:  # the thread must survive anything the bindings throw
                failures += 1
                self._tally.count("event_error", f"event thread: {exc!r}")
                self._free()
                self._stop.wait(self._backoff(failures))
        self._free()

    def _step(self, failures: int) -> int:
        """One wait (or one rebuild); returns the count of consecutive failures."""
        with self._lock:
            wanted = self._wanted
        if self._event_set is None or wanted != self._built_for:
            if not self._rebuild():
                self._stop.wait(self._backoff(failures + 1))
                return failures + 1
        try:
            data = pynvml.nvmlEventSetWait_v2(self._event_set, EVENT_WAIT_MS)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return 0
            kind = "event_gpu_lost" if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST else "event_error"
            self._tally.count(kind, f"nvmlEventSetWait_v2: {describe_nvml_error(exc)}; rebuilding the event set")
            self._free()
            if failures > 0:  # the first failure rebuilds at once: the other GPUs keep reporting
                self._stop.wait(self._backoff(failures))
            return failures + 1
        self._handle(data)
        return 0

    @staticmethod
    def _backoff(failures: int) -> float:
        return min(0.5 * 2 ** max(failures - 1, 0), EVENT_BACKOFF_MAX_SECONDS)

    def _rebuild(self) -> bool:
        """Create a set and register every GPU that answers now; False if no set could be made.

        The set enumerates the GPUs itself (identity read from each handle) rather than trusting the
        collector's list, which may be a cycle old: indices shift when a GPU leaves the count.
        """
        self._free()
        try:
            event_set = pynvml.nvmlEventSetCreate()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self._tally.count("event_error", f"building the event set: {describe_nvml_error(exc)}")
            return False
        registered: dict[int | None, GpuIdentity] = {}
        answered: list[GpuIdentity] = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                gpu = GpuIdentity(index, _text(pynvml.nvmlDeviceGetUUID(handle)),
                                  canonical_pci_bus_id(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId)) or "")
                answered.append(gpu)
                types = pynvml.nvmlDeviceGetSupportedEventTypes(handle) & WANTED_EVENTS
                if types:
                    pynvml.nvmlDeviceRegisterEvents(handle, types, event_set)
                    registered[_handle_key(handle)] = gpu
                if not types & XID_EVENT:
                    log.warning("source=nvml gpu=%d uuid=%s xid_events=unsupported; XIDs come from the "
                                "kernel log only", gpu.index, gpu.uuid)
            except pynvml.NVMLError as exc:
                if exc.value in _ABSENT:
                    log.warning("source=nvml gpu=%d events=unsupported; XIDs come from the kernel log only", index)
                elif exc.value not in (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    # lost or gone since the count: the collector reports those GPUs
                    self._tally.count("event_error", f"registering gpu={index}: {describe_nvml_error(exc)}")
        self._event_set = event_set
        self._registered = registered
        self._built_for = tuple(answered)  # compared with the collector's view of the live GPUs
        with self._built:
            self.sets_built += 1
            self._built.notify_all()
        return True

    def _free(self) -> None:
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError:
                pass  # freeing after a lost GPU or shutdown may fail; the set is gone either way
            self._event_set = None
            self._registered = {}

    def _identify(self, device: Any) -> GpuIdentity | None:
        known = self._registered.get(_handle_key(device))
        if known is not None:
            return known
        try:
            pci = pynvml.nvmlDeviceGetPciInfo(device)
            return GpuIdentity(pynvml.nvmlDeviceGetIndex(device), _text(pynvml.nvmlDeviceGetUUID(device)),
                               canonical_pci_bus_id(_text(pci.busId)) or "")
        except pynvml.NVMLError:
            return None

    def _handle(self, data: Any) -> None:
        gpu = self._identify(data.device)
        where = f"GPU {gpu.index} ({gpu.pci_bus_id}, {gpu.uuid})" if gpu else "an unknown GPU"
        if data.eventType & XID_EVENT:
            xid = int(data.eventData)
            self._deliver(XidEvent(
                xid=xid, pci_bus_id=gpu.pci_bus_id if gpu else "",
                message=f"NVML XID critical error event: Xid {xid}",
                line=f"nvml event: Xid {xid} on {where}", timestamp=time.time(), source="nvml",
                kind="xid", gpu_index=gpu.index if gpu else None, uuid=gpu.uuid if gpu else "",
                gpu_instance=_instance(data.gpuInstanceId), compute_instance=_instance(data.computeInstanceId),
            ))
        elif data.eventType & ECC_EVENTS:
            kind = "double-bit" if data.eventType & pynvml.nvmlEventTypeDoubleBitEccError else "single-bit"
            log.warning("source=nvml event=ecc kind=%s gpu=%s uuid=%s pci_bus_id=%s", kind,
                        gpu.index if gpu else "-", gpu.uuid if gpu else "-", gpu.pci_bus_id if gpu else "-")


class NvmlSource:
    """GPU inventory and health through ``pynvml``; XID events through an event-set thread."""

    name = "nvml"

    def __init__(self, expected_gpus: int | None = None, on_event: Callable[[], None] | None = None,
                 init_retry_seconds: float = INIT_RETRY_SECONDS) -> None:
        self.expected_gpus = expected_gpus
        self.on_event = on_event
        self.init_retry_seconds = init_retry_seconds
        self.tally = ErrorTally(self.name)
        self._initialized = False
        self._next_init_at = 0.0  # monotonic; 0 = try on the first collect
        self._unavailable = "unavailable: not initialised yet"
        self._driver_version = ""
        self._use_event_reasons = True  # nvmlDeviceGetCurrentClocksEventReasons (driver 535+)
        self._events: XidEventThread | None = None
        self._queue: list[XidEvent] = []
        self._queue_lock = threading.Lock()
        # Last good sample by UUID (identity of lost/vanished GPUs) and last sample by index.
        self._last_good: OrderedDict[str, GpuSample] = OrderedDict()
        self._last_at_index: dict[int, GpuSample] = {}
        self._lost_now: set[str] = set()

    # -- the Source protocol -----------------------------------------------------------------------

    def collect(self, now: float) -> SourceResult:
        """Read every GPU. Never raises; a broken library is a down source, a lost GPU a sample."""
        try:
            return self._collect(now)
        except Exception as exc:  # a bug or a binding surprise must not take the loop down
            log.exception("source=nvml collect failed")
            self.tally.count("exception", repr(exc))
            return self._result(False, f"collect failed: {exc!r}")

    def take_events(self) -> list[XidEvent]:
        """Drain the XID events the thread queued since the last call (the loop calls it every cycle)."""
        with self._queue_lock:
            events, self._queue = self._queue, []
        return events

    def close(self) -> None:
        """Stop the event thread (within about one wait timeout) and shut NVML down."""
        self._teardown()

    @property
    def event_thread(self) -> XidEventThread | None:
        """The XID event thread once NVML is up (None before the first successful collect)."""
        return self._events

    # -- collection --------------------------------------------------------------------------------

    def _result(self, up: bool, detail: str, gpus: tuple[GpuSample, ...] = ()) -> SourceResult:
        return SourceResult(health=SourceHealth(source=self.name, up=up, detail=detail,
                                                errors=self.tally.snapshot()), gpus=gpus)

    def _collect(self, now: float) -> SourceResult:
        if not self._initialized and not self._init():
            return self._result(False, self._unavailable)
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            detail = f"nvmlDeviceGetCount: {describe_nvml_error(exc)}"
            self.tally.count("nvml_error", detail)
            if exc.value in _NVML_GONE:  # driver unloaded/reloaded under us: start over next cycle
                self._teardown()
                self._next_init_at = 0.0
            return self._result(False, detail)
        enumerated = [s for s in (self._read_gpu(index, now) for index in range(count)) if s is not None]
        vanished = self._vanished(enumerated, now)
        self._note_losses(enumerated, vanished)
        self._remember(enumerated)
        samples = enumerated + vanished
        alive = tuple(GpuIdentity(s.index, s.uuid, s.pci_bus_id) for s in enumerated if not s.lost)
        if self._events is None:
            self._events = XidEventThread(self.tally, self._deliver)
            self._events.start(alive)
        else:
            self._events.update(alive)
        return self._result(True, self._detail(count, samples), tuple(samples))

    def _init(self) -> bool:
        mono = time.monotonic()
        if mono < self._next_init_at:
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._unavailable = f"unavailable: {describe_nvml_error(exc)}"
            self._next_init_at = mono + self.init_retry_seconds
            self.tally.count("unavailable", f"{self._unavailable}; retrying in {self.init_retry_seconds:.0f} s")
            return False
        self._initialized = True
        try:
            self._driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as exc:
            self.tally.count("nvml_error", f"nvmlSystemGetDriverVersion: {describe_nvml_error(exc)}")
        log.info("source=nvml initialised driver_version=%s", self._driver_version or "-")
        return True

    def _teardown(self) -> None:
        if self._events is not None:
            self._events.stop(CLOSE_JOIN_SECONDS)
            self._events = None
        if self._initialized:
            self._initialized = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.warning("source=nvml shutdown error=%s", describe_nvml_error(exc))

    def _read_gpu(self, index: int, now: float) -> GpuSample | None:
        identity: dict[str, str] = {}
        try:
            handle = self._call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)
            uuid = self._call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle) if handle is not None else None
            if uuid:
                identity["uuid"] = _text(uuid)
                identity["name"] = _text(self._call("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle) or "")
                pci = self._call("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle)
                if pci is not None:
                    pci_text = _text(pci.busId)
                    identity["pci_bus_id"] = canonical_pci_bus_id(pci_text) or ""
                    if not identity["pci_bus_id"]:
                        self.tally.count("parse", f"gpu={index} unreadable PCI bus id {pci_text!r}")
            if "pci_bus_id" not in identity:
                # Neither lost nor readable (the error is counted): keep last cycle's picture.
                return self._last_at_index.get(index)
            return self._read_health(index, handle, identity, now)
        except _GpuLost as lost:
            log.debug("source=nvml gpu=%d lost during %s", index, lost)
            return self._lost_sample(index, identity, now)

    def _read_health(self, index: int, handle: Any, identity: dict[str, str], now: float) -> GpuSample:
        ecc = EccCounts(
            volatile_corrected=self._ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
            volatile_uncorrected=self._ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
            aggregate_corrected=self._ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC),
            aggregate_uncorrected=self._ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                            pynvml.NVML_AGGREGATE_ECC),
        )
        rows = self._call("nvmlDeviceGetRemappedRows", pynvml.nvmlDeviceGetRemappedRows, handle)
        remap = RemapState(rows[0], rows[1], bool(rows[2]), bool(rows[3])) if rows is not None else RemapState()
        single = self._call("nvmlDeviceGetRetiredPages", pynvml.nvmlDeviceGetRetiredPages, handle,
                            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        double = self._call("nvmlDeviceGetRetiredPages", pynvml.nvmlDeviceGetRetiredPages, handle,
                            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pending = self._call("nvmlDeviceGetRetiredPagesPendingStatus",
                             pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        retired = RetiredPages(
            single_bit=len(single) if single is not None else None,
            double_bit=len(double) if double is not None else None,
            pending=(pending == pynvml.NVML_FEATURE_ENABLED) if pending is not None else None,
        )
        reasons = self._clock_event_reasons(handle)
        temperature = self._call("nvmlDeviceGetTemperature", pynvml.nvmlDeviceGetTemperature, handle,
                                 pynvml.NVML_TEMPERATURE_GPU)
        milliwatts = self._call("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, handle)
        return GpuSample(
            index=index, uuid=identity["uuid"], pci_bus_id=identity["pci_bus_id"], name=identity["name"],
            driver_version=self._driver_version, source=self.name, lost=False, ecc=ecc, remap=remap,
            retired_pages=retired,
            throttle_reasons=tuple(name for name, bit in THROTTLE_REASONS if reasons is not None and reasons & bit),
            nvlink_errors=self._nvlink_errors(handle),
            pcie_replay=self._call("nvmlDeviceGetPcieReplayCounter", pynvml.nvmlDeviceGetPcieReplayCounter, handle),
            temperature_c=float(temperature) if temperature is not None else None,
            power_w=milliwatts / 1000.0 if milliwatts is not None else None,
            timestamp=now,
        )

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML call: its value; None when absent (NOT_SUPPORTED) or failed (counted)."""
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            if exc.value in _ABSENT:
                return None
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost(what) from None
            self.tally.count("nvml_error", f"{what}: {describe_nvml_error(exc)}")
            return None

    def _ecc(self, handle: Any, error_type: int, counter_type: int) -> int | None:
        return self._call("nvmlDeviceGetTotalEccErrors", pynvml.nvmlDeviceGetTotalEccErrors, handle,
                          error_type, counter_type)

    def _clock_event_reasons(self, handle: Any) -> int | None:
        """Clock-event reasons; drivers (and bindings) before 535 only have the "throttle reasons" name."""
        event_reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if self._use_event_reasons and event_reasons is not None:
            try:
                return event_reasons(handle)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    return self._call("nvmlDeviceGetCurrentClocksEventReasons", _raise, exc)
                self._use_event_reasons = False
        return self._call("nvmlDeviceGetCurrentClocksThrottleReasons",
                          pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)

    def _nvlink_errors(self, handle: Any) -> dict[str, int]:
        """Error counters summed over the active links, by name; {} when the GPU has no NVLink."""
        totals: dict[str, int] = {}
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                    break  # past the device's last link
                self._call("nvmlDeviceGetNvLinkState", _raise, exc)
                continue
            if active != pynvml.NVML_FEATURE_ENABLED:
                continue
            for name, counter in NVLINK_COUNTERS:
                value = self._call("nvmlDeviceGetNvLinkErrorCounter", pynvml.nvmlDeviceGetNvLinkErrorCounter,
                                   handle, link, counter)
                if value is not None:
                    totals[name] = totals.get(name, 0) + int(value)
        return totals

    # -- lost and vanished GPUs --------------------------------------------------------------------

    def _lost_sample(self, index: int, identity: dict[str, str], now: float) -> GpuSample:
        uuid = identity.get("uuid", "")
        base = self._last_good.get(uuid) if uuid else None
        if base is None:
            previous = self._last_at_index.get(index)
            if previous is not None and (not uuid or previous.uuid == uuid):
                base = previous
        if base is None:
            base = GpuSample(index=index, uuid=uuid, pci_bus_id=identity.get("pci_bus_id", ""),
                             name=identity.get("name", ""), driver_version=self._driver_version)
        return replace(base, index=index, lost=True, timestamp=now)

    def _vanished(self, enumerated: list[GpuSample], now: float) -> list[GpuSample]:
        """Lost samples for GPUs seen before that the driver no longer enumerates at all."""
        seen = {s.uuid for s in enumerated}
        return [replace(s, lost=True, timestamp=now) for uuid, s in self._last_good.items() if uuid not in seen]

    def _note_losses(self, enumerated: list[GpuSample], vanished: list[GpuSample]) -> None:
        """Count each GPU once when it becomes lost (``lost``) or leaves the count (``vanished``)."""
        lost_now: set[str] = set()
        for kind, samples in (("lost", [s for s in enumerated if s.lost]), ("vanished", vanished)):
            for s in samples:
                key = s.uuid or f"index:{s.index}"
                lost_now.add(key)
                if key not in self._lost_now:
                    self.tally.count(kind, f"gpu={s.index} uuid={s.uuid or '-'} pci_bus_id={s.pci_bus_id or '-'}")
        self._lost_now = lost_now

    def _remember(self, samples: list[GpuSample]) -> None:
        for s in samples:
            if not s.lost and s.uuid:
                self._last_good[s.uuid] = s
                self._last_good.move_to_end(s.uuid)
            self._last_at_index[s.index] = s
        while len(self._last_good) > MAX_REMEMBERED_GPUS:
            self._last_good.popitem(last=False)

    def _detail(self, count: int, samples: list[GpuSample]) -> str:
        lost = sorted({s.index for s in samples if s.lost})
        parts = [f"driver {self._driver_version or '?'}", f"{count} GPUs"]
        if self.expected_gpus is not None and count < self.expected_gpus:
            parts.append(f"{self.expected_gpus} expected")
        if lost:
            parts.append("lost: " + ",".join(str(i) for i in lost))
        return "; ".join(parts)

    # -- events ------------------------------------------------------------------------------------

    def _deliver(self, event: XidEvent) -> None:
        """Called on the event thread: queue the event (bounded) and wake the loop."""
        with self._queue_lock:
            full = len(self._queue) >= EVENT_QUEUE_MAX
            if not full:
                self._queue.append(event)
        if full:  # keep the oldest: the first XID of a burst names the root cause
            self.tally.count("events_dropped", f"XID queue full ({EVENT_QUEUE_MAX}); dropped xid={event.xid}")
        log.info("source=nvml xid=%d gpu=%s pci_bus_id=%s uuid=%s", event.xid,
                 event.gpu_index if event.gpu_index is not None else "-", event.pci_bus_id or "-", event.uuid or "-")
        if self.on_event is not None:
            try:
                self.on_event()
            except Exception as exc:
                self.tally.count("callback_error", f"on_event raised {exc!r}")


def _raise(exc: BaseException) -> Any:
    """Re-raise inside ``NvmlSource._call`` so one place classifies every NVML error."""
    raise exc
