"""What every source shares: the protocol the loop drives (the error tally is ``common.ErrorTally``).

A source never raises on bad data. It reads what it can, counts what it could not by kind
(``parse``, ``unreadable``, ``timeout`` ...), logs one line per problem (rate-limited by the
tally so a flood of garbage cannot flood the log), and reports its health with the observations.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Mapping, Protocol

from healthagent.common import ErrorTally
from healthagent.model import AdapterEvent, EfaSample, GpuSample, PcieAerSample, RdmaPort, SourceHealth, XidEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceResult:
    """What one ``collect`` call returns."""

    health: SourceHealth
    gpus: tuple[GpuSample, ...] = ()
    xids: tuple[XidEvent, ...] = ()
    efa: tuple[EfaSample, ...] = ()
    rdma: tuple[RdmaPort, ...] = ()
    adapter_events: tuple[AdapterEvent, ...] = ()  # mlx5 (ConnectX) lines of the kernel log
    aer: tuple[PcieAerSample, ...] = ()  # PCIe AER statistics (sources/pcie_aer.py)


class Source(Protocol):
    """A thing the agent reads. ``collect`` is called by the loop; it must not block for long
    (every external read has a timeout) and must not raise."""

    name: str

    def collect(self, now: float) -> SourceResult: ...

    def close(self) -> None: ...


class Cursor(Protocol):
    """Where an event source stopped reading, in the shape the state file keeps."""

    def to_dict(self) -> dict: ...


class EventSource(Source, Protocol):
    """A source the loop reads every cycle (the kernel log) whose read position is saved with the
    decision in one atomic write, so a restart neither loses nor repeats what it reported."""

    @property
    def cursor(self) -> Cursor: ...

    @property
    def backlog(self) -> bool:
        """The last ``collect`` stopped at its budget with more to read: read again at once."""
        ...


class XidEventQueue(Protocol):
    """XID events a driver thread queued (NVML's event thread); the loop drains them every cycle
    without a driver call, so a wedged driver cannot hold the loop here."""

    def take_events(self) -> list[XidEvent]: ...


class _Call:
    """One ``collect`` running on its own worker thread, and what it returned or raised."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.started = time.monotonic()
        self.done = threading.Event()
        self.result: SourceResult | None = None
        self.error: BaseException | None = None
        self.close_after = False  # close() came while this call was stuck: close when it returns


class DeadlineSource:
    """A source whose ``collect`` cannot hold the loop longer than ``timeout_seconds``.

    Why: NVML calls into the driver, and a wedged driver (the classic state after XID 79) blocks
    the calling thread for good. On the loop thread that would stop the kernel-log reading, the
    verdict and the effects, and after a minute ``/healthz`` fails and the kubelet restarts the pod
    into the same hang. So the call runs on a dedicated daemon worker thread and the loop waits at
    most the deadline:

    - an answer within the deadline is returned as it is (an exception is raised again here, so
      the loop's handling is unchanged);
    - past the deadline the source is reported down (``detail`` "collect hung for N s") and the
      error kind ``hung`` is counted once per episode;
    - while that call is still stuck, later calls answer at once the same way and start no other
      worker: one stuck thread per source at most, never a pile-up;
    - when the stuck call returns, the next ``collect`` starts a fresh one (normal service).

    ``close`` never blocks on a stuck worker: the wrapped source is closed by that worker when its
    call returns. What only the wrapped source has (NVML's ``take_events``, its ``tally``) is read
    on ``source`` by whoever holds it by its own type; this wrapper is a ``Source`` and nothing
    more, so a caller can never reach the driver through it by accident.
    """

    def __init__(self, source: Source, timeout_seconds: float) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be greater than 0, got {timeout_seconds!r}")
        self.source: Source = source
        self.name: str = source.name
        self.timeout_seconds = float(timeout_seconds)
        self._tally = ErrorTally(source.name)
        self._lock = threading.Lock()
        self._call: _Call | None = None
        self._in_episode = False
        self._last_errors: Mapping[str, int] = {}
        self._closed = False

    @property
    def stuck(self) -> bool:
        """True while a call that overran its deadline has not returned."""
        with self._lock:
            return self._in_episode and self._call is not None and not self._call.done.is_set()

    def collect(self, now: float) -> SourceResult:
        with self._lock:
            call = self._call
            stuck = call is not None and not call.done.is_set() and self._in_episode
            if not stuck and (call is None or call.done.is_set()):
                call = self._call = _Call(now)
                threading.Thread(target=self._work, args=(call,), daemon=True,
                                 name=f"healthagent-{self.name}-collect").start()
        assert call is not None
        if stuck or not call.done.wait(self.timeout_seconds):
            return self._hung(call)
        return self._answer(call)

    def close(self) -> None:
        """Close the wrapped source now, or, while a call is stuck in it, when that call returns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            call = self._call
            if call is not None and not call.done.is_set():
                call.close_after = True
                log.warning("source=%s close deferred: a collect has been stuck for %.0f s",
                            self.name, time.monotonic() - call.started)
                return
        self.source.close()

    def _work(self, call: _Call) -> None:
        try:
            call.result = self.source.collect(call.now)
        except BaseException as exc:  # handed to the caller, who decides (the loop logs it)
            call.error = exc
        finally:
            with self._lock:
                call.done.set()
                if call.result is not None:
                    self._last_errors = dict(call.result.health.errors)
                close = call.close_after
                if self._in_episode:
                    self._in_episode = False
                    log.warning("source=%s collect returned after hanging for %.1f s",
                                self.name, time.monotonic() - call.started)
        if close:
            try:
                self.source.close()
            except Exception:
                log.exception("source=%s deferred close failed", self.name)

    def _answer(self, call: _Call) -> SourceResult:
        if call.error is not None:
            raise call.error
        result = call.result
        assert result is not None
        with self._lock:
            self._last_errors = dict(result.health.errors)
            hung = self._tally.snapshot()
        if not hung:
            return result
        return replace(result, health=replace(result.health, errors={**result.health.errors, **hung}))

    def _hung(self, call: _Call) -> SourceResult:
        with self._lock:
            finished = call.done.is_set()
            first = not finished and not self._in_episode
            if first:
                self._in_episode = True
        if finished:  # it returned just as the deadline passed
            return self._answer(call)
        waited = time.monotonic() - call.started
        if first:
            self._tally.count("hung", f"collect did not return within {self.timeout_seconds:g} s; "
                                      "reporting the source down until it does")
        with self._lock:
            errors = {**self._last_errors, **self._tally.snapshot()}
        health = SourceHealth(source=self.name, up=False, detail=f"collect hung for {waited:.0f} s",
                              errors=errors)
        return SourceResult(health=health)


def host_path(host_root: str, path: str) -> str:
    """Join an absolute host path under the host root (node_exporter's ``--path.rootfs``)."""
    return os.path.join(host_root, path.lstrip("/"))


def read_boot_id(host_root: str) -> str:
    """The host's boot id; it tells a reboot (reboot-class taints clear) from an agent restart."""
    try:
        with open(host_path(host_root, "/proc/sys/kernel/random/boot_id"), encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""
