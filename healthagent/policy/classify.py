"""Observations -> findings -> verdict: the classifier the agent loop and ``check`` call.

``Classifier.observe(collection)`` returns an ``Assessment`` (the verdict and what the loop must
count from this observation) and is pure in the sense that matters: no I/O, no clock reads (only
``collection.timestamp`` and the samples' timestamps), so every decision can be replayed in a
test. Its memory (open findings, XID incidents, counter histories) is exported with
``export_state`` and saved by the agent in the same atomic write as the kernel-log cursor, so a
restart neither forgets an open finding nor counts an XID twice.

The order of one observation:
0. an operator clear the node shows with a new token (``Collection.operator_clear``) forgets the
   findings that were open when the operator cleared, once per token (the token is part of the
   saved state). The clear names the verdict it acted on (``operator_clear_as_of``, a
   ``Verdict.observation``): whatever was observed after it is a new fault and stays;
1. a new boot id (a reboot) closes every finding below replace_node;
2. a new UUID at a known PCI id (the GPU was physically replaced) closes that GPU's findings;
3. XIDs join incidents (those of an earlier boot are only counted), ConnectX adapter events their
   adapter's finding (``adapters.py``); GPU, EFA and RDMA port samples run their rules; the
   inventory is counted;
4. the open findings, expired where their window passed, are the verdict, with the subsystems the
   collection could not see (``Verdict.unobserved``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from healthagent.model import INIT_FAILED, AdapterEvent, Collection, GpuSample, Verdict, XidEvent
from healthagent.policy.adapters import AdapterJudge
from healthagent.policy.book import FindingBook, Signal, as_text
from healthagent.policy.catalog import Catalog
from healthagent.policy.counters import finite
from healthagent.policy.incidents import XidIncidents
from healthagent.policy.inventory import MAX_KNOWN, inventory, unobserved
from healthagent.policy.mlx5_catalog import load_mlx5_catalog
from healthagent.policy.rules_efa import EfaRules, EfaTrack, efa_key
from healthagent.policy.rules_gpu import GpuRules, GpuTrack, gpu_key
from healthagent.policy.rules_pcie import PcieJudge
from healthagent.policy.rules_rdma import RdmaJudge
from healthagent.policy.settings import Policy

log = logging.getLogger(__name__)

STATE_VERSION = 1
MAX_TRACKS = 256  # GPUs / EFA ports remembered; far above any real node, a bound for garbage input

__all__ = ["Assessment", "Classifier", "classify_event"]


@dataclass(frozen=True)
class Assessment:
    """What one observation concluded."""

    verdict: Verdict
    # The XIDs that count (a second reporter's copy of one fault, within xid_dedupe_seconds, is
    # left out; an event that pairs in part carries only the repeats that count): what
    # healthagent_xid_errors_total adds.
    counted_xids: tuple[XidEvent, ...] = ()
    # XIDs logged during an earlier boot (a kernel-log file's history): counted, never judged.
    earlier_boot_xids: tuple[XidEvent, ...] = ()
    cleared: int = 0  # findings an operator's clear closed in this observation
    # This boot's ConnectX adapter events, judged, with their RDMA device where it is known: what
    # healthagent_mlx5_events_total adds (an earlier boot's are history, never counted).
    adapter_events: tuple[AdapterEvent, ...] = ()


class Classifier:
    """The node's fault policy with its memory. One instance per agent; not thread-safe (the
    loop is its only caller)."""

    def __init__(self, policy: Policy, catalog: Catalog) -> None:
        self.policy = policy
        self.catalog = catalog
        self.mlx5_catalog = load_mlx5_catalog(policy.mlx5_actions)
        self.gpu_rules = GpuRules(policy)
        self.efa_rules = EfaRules(policy)
        self.restore_errors = 0
        self.internal_errors = 0
        self.earlier_boot_total = 0  # XIDs from earlier boots seen since start (logged, not judged)
        self.observation = 0  # observations since the state began (saved): names a verdict
        self._folded_earlier: dict[str, int] = {}  # folds of the bounds a reset replaced
        self._reset()

    def _reset(self) -> None:
        if hasattr(self, "incidents"):  # a new boot or GPU set: keep the fold counts cumulative
            self._folded_earlier = self.names_folded()
        self.book = FindingBook(self.policy)
        self.incidents = XidIncidents(self.policy, self.catalog)
        self.gpus: dict[str, GpuTrack] = {}
        self.efa: dict[str, EfaTrack] = {}
        self.rdma = RdmaJudge(self.policy)
        self.pcie = PcieJudge(self.policy)
        self.adapters = AdapterJudge(self.policy, self.mlx5_catalog)
        self.known_gpus: dict[str, str] = {}  # PCI id -> "GPU 3 (0000:a8:00.0)", seen since the last clear
        self.known_efa: dict[str, str] = {}
        self.boot_id = ""
        self.clear_token: str | None = ""  # the last operator clear acted on (None: unknown)
        self.now = 0.0
        self.inventory_time: float | None = None

    def names_folded(self) -> dict[str, int]:
        """Names the bound on untrusted names folded since start, by source (``bounded_names``)."""
        totals = dict(self._folded_earlier)
        for bound in (self.adapters.bound, self.incidents.unmatched, self.incidents.switches, self.incidents.numbers):
            totals[bound.source] = totals.get(bound.source, 0) + bound.folded
        return {source: count for source, count in totals.items() if count}

    # -- observe ----------------------------------------------------------------------------------

    def observe(self, collection: Collection) -> Assessment:
        now = float(collection.timestamp) if finite(collection.timestamp) else self.now
        self.now = now
        self.observation += 1
        self.book.observation = self.observation
        self.book.boot_time = _boot_time(collection.boot_time, now)
        cleared = 0
        token = collection.operator_clear
        if token and self.clear_token is None:  # the saved token was unreadable: never clear twice
            log.warning("operator clear token=%s adopted without clearing (the saved token was unreadable)",
                        token)
            self.clear_token = token
        elif token and token != self.clear_token:
            cleared = self.clear(now, f"operator clear {token}", collection.operator_clear_as_of)
            self.clear_token = token
        self._guard("boot", self._check_boot, collection)
        self._guard("replaced", self._check_replaced, collection.gpus)
        counted: list[XidEvent] = []
        earlier = tuple(x for x in collection.xids if x.previous_boot)
        if earlier:
            self.earlier_boot_total += len(earlier)
            log.info("xids_from_earlier_boots=%d total=%d not judged (logged before this boot)",
                     len(earlier), self.earlier_boot_total)
        current = tuple(x for x in collection.xids if not x.previous_boot and x.kind != INIT_FAILED)
        failed_init = tuple(x for x in collection.xids if not x.previous_boot and x.kind == INIT_FAILED)
        arranged = self._guard("xids", self.incidents.arrange, current, collection.gpus, now) or []
        for event, t, where in arranged:  # one by one: a bad event must not take its batch with it
            try:
                taken = self.incidents.take(event, t, where, self.book)
                if taken:
                    counted.append(event if taken == event.repeats else replace(event, repeats=taken))
            except Exception:
                self._internal("xid")
        self._guard("xids", self.incidents.describe, self.book)
        adapters: list[AdapterEvent] = []
        for event, t in self._guard("mlx5", self.adapters.arrange, collection, now) or []:
            try:
                self.adapters.take(event, t, collection.boot_id, self.book)
                adapters.append(event)
            except Exception:
                self._internal("mlx5")
        for gpu in collection.gpus:
            self._guard("gpu", self._apply, self.gpu_rules.evaluate(gpu, self._gpu_track(gpu), now), now)
        if failed_init:  # judged against the GPUs the GPU sources list (rules_gpu.init_failures)
            self._guard("gpu", self._apply, self.gpu_rules.init_failures(failed_init, collection), now)
        for sample in collection.efa:
            self._guard("efa", self._apply, self.efa_rules.evaluate(sample, self._efa_track(sample), now), now)
        self._guard("rdma", self._apply, self.rdma.evaluate(collection, now), now)
        self._guard("pcie", self._apply, self.pcie.evaluate(collection, now), now)
        if self._inventory_is_new(collection, now):
            self._guard("inventory", self._apply, inventory(collection, self.known_gpus, self.known_efa), now)
        blind = self._guard("unobserved", unobserved, collection) or ()
        verdict = Verdict.of(self.book.findings(now), now, unobserved=blind, observation=self.observation,
                             clear_token=self.clear_token or "")
        return Assessment(verdict, tuple(counted), earlier, cleared, tuple(adapters))

    def _apply(self, signals: Iterable[Signal], now: float) -> None:
        for signal in signals:
            self.book.apply(signal, now)

    def _guard(self, stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A bug in one rule must not blind the others: count it, log the first few, go on."""
        try:
            return fn(*args)
        except Exception:
            self._internal(stage)
            return None

    def _internal(self, stage: str) -> None:
        """Count a rule's bug; log the first few (with the traceback being handled)."""
        self.internal_errors += 1
        if self.internal_errors <= 3 or self.internal_errors % 1000 == 0:
            log.exception("policy stage=%s failed errors=%d", stage, self.internal_errors)

    def _check_boot(self, collection: Collection) -> None:
        boot_id = collection.boot_id or ""
        if boot_id and self.boot_id and boot_id != self.boot_id:
            closed = self.book.on_reboot()
            for track in self.gpus.values():
                track.thermal_since = track.power_since = None
            log.info("boot_id changed old=%s new=%s findings_closed=%d", self.boot_id, boot_id, closed)
        if boot_id:
            self.boot_id = boot_id

    def _check_replaced(self, gpus: tuple[GpuSample, ...]) -> None:
        for gpu in gpus:
            if not gpu.pci_bus_id or not gpu.uuid:
                continue
            track = self.gpus.get(gpu.pci_bus_id)
            if track is not None and track.uuid and track.uuid != gpu.uuid:
                closed = self.book.on_gpu_replaced(gpu.pci_bus_id)
                self.gpus[gpu.pci_bus_id] = GpuTrack(uuid=gpu.uuid)
                log.info("gpu replaced pci=%s old_uuid=%s new_uuid=%s findings_closed=%d",
                         gpu.pci_bus_id, track.uuid, gpu.uuid, closed)
            self.book.fill_uuid(gpu.pci_bus_id, gpu.uuid)
            if gpu.reset and not gpu.lost:
                closed = self.book.on_gpu_reset(gpu.pci_bus_id)
                log.info("gpu reset pci=%s uuid=%s seen=%r findings_closed=%d", gpu.pci_bus_id, gpu.uuid,
                         gpu.reset, closed)

    def _gpu_track(self, gpu: GpuSample) -> GpuTrack:
        key = gpu_key(gpu)
        track = self.gpus.get(key)
        if track is None:
            if len(self.gpus) >= MAX_TRACKS:
                self.gpus.pop(next(iter(self.gpus)))
            track = self.gpus[key] = GpuTrack(uuid=gpu.uuid)
        elif gpu.uuid and not track.uuid:
            track.uuid = gpu.uuid
        return track

    def _efa_track(self, sample: Any) -> EfaTrack:
        key = efa_key(sample)
        track = self.efa.get(key)
        if track is None:
            if len(self.efa) >= MAX_TRACKS:
                self.efa.pop(next(iter(self.efa)))
            track = self.efa[key] = EfaTrack()
        return track

    def _inventory_is_new(self, collection: Collection, now: float) -> bool:
        """Count the inventory once per new set of samples, not once per kernel-log wake-up."""
        times = [s.timestamp for s in (*collection.gpus, *collection.efa) if finite(s.timestamp)]
        t = max(times) if times and max(times) > 0 else now
        if t == self.inventory_time:
            return False
        self.inventory_time = t
        return True

    # -- operator ---------------------------------------------------------------------------------

    def clear(self, now: float, reason: str, as_of: int | None = None) -> int:
        """Close every finding open at observation ``as_of`` (None: every open finding), replace-class
        too. Conditions that are still true (a sticky hardware flag) stay quiet until they change;
        new XIDs start new incidents, and XIDs observed after ``as_of`` that joined a cleared
        incident become one; the inventory is learned again."""
        if as_of is not None and as_of >= self.observation:
            as_of = None  # a cut-off from another numbering (state lost): everything seen is older
        closed = self.book.clear(now, as_of, self.incidents.reopen)
        self.incidents.describe(self.book)
        self.known_gpus.clear()
        self.known_efa.clear()
        self.rdma.forget_devices()
        self.adapters.forget()
        log.info("findings cleared by operator count=%d reason=%s", closed, " ".join(str(reason).split()) or "-")
        return closed

    # -- state ------------------------------------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "observation": self.observation,
            "boot_id": self.boot_id,
            "clear_token": self.clear_token,
            "now": self.now,
            "inventory_time": self.inventory_time,
            "book": self.book.to_dict(),
            "incidents": self.incidents.to_dict(),
            "gpus": {k: t.to_dict() for k, t in self.gpus.items()},
            "efa": {k: t.to_dict() for k, t in self.efa.items()},
            "rdma": self.rdma.to_dict(),
            "pcie": self.pcie.to_dict(),
            "adapters": self.adapters.to_dict(),
            "known_gpus": dict(self.known_gpus),
            "known_efa": dict(self.known_efa),
        }

    def restore_state(self, d: Any) -> None:
        """Load what ``export_state`` wrote, part by part. ``{}`` is a clean start. A part that
        cannot be read (a wrong type, garbage, a field an older or newer agent wrote differently)
        is counted, logged once and left at its clean default while the others are kept: an open
        finding is not lost because the counter history beside it is garbage. Unknown keys are
        ignored. Never raises.

        A part read wrongly must not act: a boot id or a GPU UUID of the wrong type is dropped,
        never turned into text (a "changed" boot id would close every reboot finding, a "new"
        UUID would close that GPU's findings); a clear token of the wrong type is unknown, and the
        next token seen is adopted without clearing (a clear applied twice wipes real faults).
        """
        self._reset()
        if not d:
            return
        if not isinstance(d, dict):
            self._restore_failed([f"state is {type(d).__name__}, not a mapping"])
            return
        problems: list[str] = []
        if d.get("version") != STATE_VERSION:  # another agent's: read what this one understands
            problems.append(f"version {d.get('version')!r}, this agent writes {STATE_VERSION}"[:120])

        def part(name: str, read: Callable[[Any], Any], default: Any) -> Any:
            if name not in d:
                return default
            try:
                return read(d[name])
            except Exception as exc:  # garbage of any shape: this part starts clean
                problems.append(f"{name}: {exc!r}"[:120])
                return default

        self.observation = max(self.observation, part("observation", _count, 0))
        self.boot_id = part("boot_id", as_text, "")
        # None (saved as unknown, or unreadable): the next token seen is adopted, never applied
        self.clear_token = part("clear_token", lambda v: None if v is None else as_text(v), None)
        if "clear_token" not in d:
            self.clear_token = ""
        self.now = part("now", _number, 0.0)
        self.inventory_time = part("inventory_time", lambda v: None if v is None else _number(v), None)
        self.book = part("book", lambda v: FindingBook.from_dict(self.policy, _mapping(v), problems),
                         FindingBook(self.policy))
        part("incidents", lambda v: self.incidents.load(_mapping(v)), None)
        self.gpus = part("gpus", lambda v: _tracks(v, GpuTrack.from_dict, problems), {})
        self.efa = part("efa", lambda v: _tracks(v, EfaTrack.from_dict, problems), {})
        part("rdma", lambda v: self.rdma.load(v, problems), None)
        part("pcie", lambda v: self.pcie.load(v, problems), None)
        part("adapters", lambda v: self.adapters.load(v, problems), None)
        self.known_gpus = part("known_gpus", _words, {})
        self.known_efa = part("known_efa", _words, {})
        if problems:
            self._restore_failed(problems)

    def _restore_failed(self, problems: list[str]) -> None:
        self.restore_errors += len(problems)
        log.warning("classifier state partly unreadable, those parts start clean count=%d first=%s",
                    len(problems), "; ".join(problems[:3]))


def _boot_time(value: float | None, now: float) -> float | None:
    """The node's boot time as the rules' graces measure from it; None (no grace) when it is not
    a time at or before this observation: a boot in the future would silence a signal for as
    long as it is ahead."""
    return float(value) if finite(value) and value <= now else None  # type: ignore[operator]


def _number(value: Any) -> float:
    if not finite(value):
        raise TypeError(f"{value!r} is not a finite number")
    return float(value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{value!r} is not a count")
    return value


def _mapping(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{type(value).__name__} is not a mapping")
    return value


def _tracks(raw: Any, read: Callable[[dict[str, Any]], Any], problems: list[str]) -> dict[str, Any]:
    """Device histories, each read on its own (a bad one is dropped and learned again). A track
    whose UUID is not text is dropped: the GPU-replaced check compares UUIDs."""
    tracks: dict[str, Any] = {}
    for key, value in list(_mapping(raw).items())[:MAX_TRACKS]:
        try:
            as_text(_mapping(value).get("uuid", ""))
            tracks[str(key)] = read(value)
        except Exception as exc:  # this device's history starts clean
            problems.append(f"track {str(key)[:40]}: {exc!r}"[:120])
    return tracks


def _words(d: dict[str, Any]) -> dict[str, str]:
    if not isinstance(d, dict):
        raise ValueError("known devices must be a mapping")
    return {str(k): str(v) for k, v in list(d.items())[:MAX_KNOWN]}


def classify_event(event: XidEvent, catalog: Catalog) -> dict[str, Any]:
    """One kernel-log event as ``healthagent classify`` prints it."""
    entry, action, _ = catalog.decide(event)
    number_key = "sxid" if event.kind == "sxid" else "xid"
    return {number_key: entry.xid, "pci_bus_id": event.pci_bus_id, "name": entry.name,
            "action": action.value, "line": event.line}
