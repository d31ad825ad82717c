"""NVML's XID events: an event set waited on by a background thread, and what NVML's errors mean.

Split from the NVML source (``sources/nvml.py``) because it is a job of its own: a thread that
must never miss an event between collections, rebuilds its event set when a GPU is lost or the
inventory changes, backs off on repeated failures, and hands ``XidEvent``s over through a
callback. ``describe_nvml_error`` and the GPU identity are shared with the source.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import pynvml

from healthagent.common import ErrorTally
from healthagent.model import XidEvent, canonical_pci_bus_id

log = logging.getLogger("healthagent.sources.nvml")  # one logger name for the whole NVML source

EVENT_WAIT_MS = 500
EVENT_QUEUE_MAX = 10_000
EVENT_BACKOFF_MAX_SECONDS = 30.0

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

    def __init__(self, tally: ErrorTally, deliver: Callable[[XidEvent], None],
                 clock: Callable[[], float] = time.time) -> None:
        self._tally = tally
        self._clock = clock  # stamps each event as it arrives (the agent's decision clock)
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
                line=f"nvml event: Xid {xid} on {where}", timestamp=self._clock(), source="nvml",
                kind="xid", gpu_index=gpu.index if gpu else None, uuid=gpu.uuid if gpu else "",
                gpu_instance=_instance(data.gpuInstanceId), compute_instance=_instance(data.computeInstanceId),
            ))
        elif data.eventType & ECC_EVENTS:
            kind = "double-bit" if data.eventType & pynvml.nvmlEventTypeDoubleBitEccError else "single-bit"
            log.warning("source=nvml event=ecc kind=%s gpu=%s uuid=%s pci_bus_id=%s", kind,
                        gpu.index if gpu else "-", gpu.uuid if gpu else "-", gpu.pci_bus_id if gpu else "-")
