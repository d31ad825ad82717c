"""NVML source: GPU inventory and health counters through the official bindings (``pynvml``), and
XID events from an NVML event set on a background thread (``sources/nvml_events.py``).

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
(queue full), ``callback_error`` (``on_event`` raised), ``inconsistent`` (the count or the
identities changed twice during one walk: no GPU is judged gone from it), ``exception`` (a bug;
collect still returned).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

import pynvml

from healthagent.model import (
    THROTTLE_REASONS,
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
from healthagent.sources.nvml_events import (
    _ABSENT,
    _NVML_GONE,
    EVENT_QUEUE_MAX,
    GpuIdentity,
    XidEventThread,
    _text,
    describe_nvml_error,
)

log = logging.getLogger(__name__)

INIT_RETRY_SECONDS = 60.0
CLOSE_JOIN_SECONDS = 5.0
MAX_REMEMBERED_GPUS = 256

NVLINK_COUNTERS: tuple[tuple[str, int], ...] = (
    ("replay", pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    ("recovery", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
    ("crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    ("crc_data", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
)

class _GpuLost(Exception):
    """Internal: a call answered GPU_IS_LOST; the GPU's sample becomes a lost sample."""


class NvmlSource:
    """GPU inventory and health through ``pynvml``; XID events through an event-set thread."""

    name = "nvml"

    def __init__(self, expected_gpus: int | None = None, on_event: Callable[[], None] | None = None,
                 init_retry_seconds: float = INIT_RETRY_SECONDS, clock: Callable[[], float] = time.time) -> None:
        """``clock`` stamps XID events as they arrive: the agent's decision clock
        (``healthagent/clock.py``), the one its kernel-log records are stamped on, so one XID
        reported by both pairs up whatever the wall clock does."""
        self.expected_gpus = expected_gpus
        self.clock = clock
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
        self._unreadable: list[str] = []  # this collection's GPUs NVML counts but we could not read
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
        enumerated, consistent = self._walk(count, now)
        if not consistent:  # the count changed under the walk (a GPU left or came): walk once more
            count = self._count_or(count)
            enumerated, consistent = self._walk(count, now)
        if not consistent:
            self.tally.count("inconsistent", f"the GPU count or identities changed twice during one walk ({count} GPUs)")
        # Which GPU left is judged only from a walk that agrees with itself: a walk torn by a
        # change mixes indexes from before and after it and would name the wrong GPU.
        vanished = self._vanished(enumerated, now) if consistent else []
        enumerated = [self._with_reset(s, now, consistent) for s in enumerated]
        if consistent:  # a torn walk may have named a lost GPU by another's index: no loss judged from it
            self._note_losses(enumerated, vanished)
        self._remember(enumerated)
        samples = enumerated + vanished
        alive = tuple(GpuIdentity(s.index, s.uuid, s.pci_bus_id) for s in enumerated if not s.lost)
        if self._events is None:
            self._events = XidEventThread(self.tally, self._deliver, self.clock)
            self._events.start(alive)
        else:
            self._events.update(alive)
        result = self._result(True, self._detail(count, samples), tuple(samples))
        if self._unreadable:
            # NVML counts these GPUs but would not let us read them (NO_PERMISSION, an unknown
            # error): they are there, so never GPU_MISSING, and unobserved, so never healthy.
            result = replace(result, health=replace(result.health, unobserved=tuple(self._unreadable)))
        return result

    def _walk(self, count: int, now: float) -> tuple[list[GpuSample], bool]:
        """Read GPUs 0..count-1; consistent when the count after the walk is the count before
        it and no UUID appears twice (NVML renumbers the GPUs after one that leaves)."""
        self._unreadable = []
        enumerated = [s for s in (self._read_gpu(index, now) for index in range(count)) if s is not None]
        uuids = [s.uuid for s in enumerated if s.uuid]
        return enumerated, self._count_or(-1) == count and len(uuids) == len(set(uuids))

    def _count_or(self, fallback: int) -> int:
        try:
            return int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError:
            return fallback

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
                # Neither lost nor readable (the error is counted): keep last cycle's picture, or,
                # without one, name the GPU unobserved (counted by NVML, not missing).
                last = self._last_at_index.get(index)
                if last is None:
                    self._unreadable.append(f"GPU {index}")
                return last
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

    # -- a GPU reset ---------------------------------------------------------------------------------

    def _with_reset(self, sample: GpuSample, now: float, consistent: bool) -> GpuSample:
        """``sample`` with ``reset`` set when NVML shows that its GPU was reset since the last read,
        and cleared otherwise: only a sample read in this walk (not last cycle's kept for a GPU
        whose identity could not be read now), from a walk that agrees with itself, can show one."""
        fresh = sample.timestamp == now and consistent
        if sample.lost or not sample.uuid or not fresh:
            return replace(sample, reset="") if sample.reset else sample
        why = reset_seen(self._last_good.get(sample.uuid), sample, sample.uuid in self._lost_now)
        if why:
            log.info("source=nvml gpu=%d uuid=%s reset seen: %s", sample.index, sample.uuid, why)
        return replace(sample, reset=why) if why != sample.reset else sample

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


def reset_seen(before: GpuSample | None, after: GpuSample, was_lost: bool) -> str:
    """What in two reads of one GPU (same UUID) says it was reset in between; "" when nothing does.

    NVML keeps no reset counter, so the agent reads the marks a reset leaves (``nvidia-smi -r``
    re-initialises the GPU as a driver load does):

    - a volatile ECC count went down: NVML's volatile counts are "reset each time the driver
      loads" (``nvmlEccCounterType_t``) and only grow otherwise. The agent holds NVML open, which
      keeps the driver's state of the GPU loaded as persistence mode does, so nothing but a reset
      or a reload starts them again;
    - the row-remap pending flag cleared: ``nvmlDeviceGetRemappedRows`` reports a remap as pending
      until "a reset ... actually remap[s] the row" (NVIDIA's GPU memory error management guide:
      the remap happens at the next GPU reset);
    - the GPU answered again, with its UUID, after NVML reported it lost (``GPU_IS_LOST``) or
      left the device count: a lost GPU comes back only through a reset or a driver reload.

    A reset that leaves none of these (volatile counts at zero before it, no remap pending, the
    GPU never seen lost) is not seen: its findings end as they would without it."""
    if after.lost or before is None or before.uuid != after.uuid:
        return ""
    if was_lost:
        return "the GPU answers again after NVML reported it lost"
    for name, old, new in (("uncorrected", before.ecc.volatile_uncorrected, after.ecc.volatile_uncorrected),
                           ("corrected", before.ecc.volatile_corrected, after.ecc.volatile_corrected)):
        if old is not None and new is not None and new < old:
            return f"the volatile {name} ECC count went from {old} to {new}"
    if before.remap.pending and after.remap.pending is False:
        return "the row remap that was pending is applied"
    return ""


def _raise(exc: BaseException) -> Any:
    """Re-raise inside ``NvmlSource._call`` so one place classifies every NVML error."""
    raise exc
