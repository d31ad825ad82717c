"""The Prometheus exporter: the loop publishes a snapshot, a scrape renders it.

``Telemetry`` owns its own ``CollectorRegistry`` (no default-registry globals, so tests and the
demo can run several agents in one process). The loop calls ``publish(snapshot)`` once per cycle,
which swaps one reference (atomic under the GIL); a scrape renders whatever snapshot is current, so
it does no I/O, takes no lock shared with the loop, and always sees one consistent picture.

The demo node (8 GPUs, 32 EFA devices with ~36 counters each) renders about 1,500 samples, and
prometheus_client's encoders spend 10-20 us on each (OpenMetrics, which Prometheus negotiates,
more than text 0.0.4). The loop publishes a new snapshot every cycle, but its GPU and EFA samples
change only when NVML or EFA collect again (every 10 s; the loop hands over the very same sample
objects until then), and when EFA does collect only the traffic counters move: a few families of
the ~40. So encoding is cached at two levels (``telemetry/encode_cache.py``), both with
prometheus_client's own encoders:

- a snapshot *part* (GPUs, XIDs, EFA, the rest) whose input is the same object (or equal) reuses
  its bytes whole;
- within a part that changed, each *family* whose input (its samples, or for EFA the values it is
  built from) is equal to last time reuses its bytes, and only the families that changed are built
  and encoded again.

The live registry (collect-duration histogram, build info, training intake) is encoded on every
scrape. The concatenation is byte-identical to encoding the whole registry at once, because both
encoders write each family on its own (tests compare the two).

One more saving, with the same bytes: the OpenMetrics encoder that Prometheus 2.x negotiates
(``escaping=underscores``) runs a Python loop over every character of every sample's name to
replace characters outside ``[a-zA-Z0-9_]``, about 40% of its time here. For families whose
names and label names are already in that set (all of ours), its ``allow-utf-8`` escaping writes
the very same bytes without the loop, so those are encoded with it (``plain_names_encoder``); any
other family, and any other encoder, is encoded exactly as negotiated.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from healthagent.bounded_names import FOLDED_NUMBER, OVERFLOW
from healthagent.model import (
    API_CONDITION_KINDS,
    EFA_NOT_COUNTERS,
    KNOWN_THROTTLE_REASONS,
    Action,
    AgentSnapshot,
    EfaSample,
    GpuSample,
)
from healthagent.telemetry import spec as names
from healthagent.telemetry.pipeline_metrics import pipeline_families
from healthagent.telemetry.mlx5_metrics import mlx5_families
from healthagent.telemetry.rdma_metrics import rdma_families, rdma_family_inputs
from healthagent.telemetry.encode_cache import (
    OPENMETRICS_EOF,
    FamilyInput,
    PartEncoder,
    SnapshotPart,
    encode_families,
    plain_names_encoder,
)

# 1 ms (a kernel-log read) .. 5 s (a dcgm-exporter scrape at its timeout), roughly x2.5 steps.
COLLECT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_SPECS = names.by_name(names.HEALTH)
_UNSAFE = re.compile(r"[^a-z0-9_]+")




class TelemetryRegistry(CollectorRegistry):
    """The agent's registry: everything registered into it, then the snapshot's families.

    ``collect()`` yields both, so anything that reads a registry (``generate_latest``, tests)
    sees every metric; ``collect_live()`` yields only what changes between snapshots (histogram,
    build info, the training intake), which lets ``Telemetry.exposition`` encode the large,
    unchanging snapshot part once per snapshot.
    """

    def __init__(self, snapshot_collector: "SnapshotCollector") -> None:
        super().__init__(auto_describe=False)
        self.snapshot_collector = snapshot_collector

    def collect(self) -> Iterator[Metric]:
        yield from super().collect()
        yield from self.snapshot_collector.collect()

    def collect_live(self) -> Iterator[Metric]:
        yield from super().collect()


class Telemetry:
    """What the loop talks to: ``observe_collect``, ``publish``; ``registry`` is what is scraped."""

    def __init__(self, version: str) -> None:
        self._snapshot: AgentSnapshot | None = None
        self._collector = SnapshotCollector(lambda: self._snapshot)
        self.registry = TelemetryRegistry(self._collector)
        self._collect_duration = Histogram(
            names.COLLECT_DURATION.full_name, names.COLLECT_DURATION.help,
            list(names.COLLECT_DURATION.labels), buckets=COLLECT_BUCKETS, registry=self.registry,
        )
        self.registry.register(_BuildInfo(version))
        self._parts = PartEncoder()

    def observe_collect(self, source: str, seconds: float) -> None:
        """Record how long one collection of ``source`` took (a real histogram)."""
        self._collect_duration.labels(source).observe(max(0.0, float(seconds)))

    def publish(self, snapshot: AgentSnapshot) -> None:
        """Make ``snapshot`` what scrapes render from now on (one reference swap)."""
        self._snapshot = snapshot

    @property
    def snapshot(self) -> AgentSnapshot | None:
        return self._snapshot

    def exposition(self, encoder: Callable, content_type: str) -> bytes:
        """The whole registry encoded with a prometheus_client encoder (from ``choose_encoder``).

        Same bytes as ``encoder(self.registry)``, but each part of the snapshot is encoded again
        only when its input changed (see the module docstring).
        """
        plain = plain_names_encoder(encoder)
        live = encode_families(encoder, plain, tuple(self.registry.collect_live()))
        snapshot = self._snapshot
        if snapshot is None:
            return live
        eof = live.endswith(OPENMETRICS_EOF)  # OpenMetrics: one # EOF, at the very end
        if eof:
            live = live[: -len(OPENMETRICS_EOF)]
        body = [live] + [self._parts.encode(part, snapshot, encoder, plain, content_type) for part in SNAPSHOT_PARTS]
        if eof:
            body.append(OPENMETRICS_EOF)
        return b"".join(body)



class _BuildInfo:
    def __init__(self, version: str) -> None:
        self._version = version

    def collect(self) -> Iterator[Metric]:
        info = names.BUILD_INFO.family()
        info.add_metric([self._version], 1.0)
        yield info


class SnapshotCollector:
    """Renders every health metric from the current snapshot (nothing before the first one).

    Families are cached per snapshot object: snapshots are immutable, so the families built for
    one stay right until the loop publishes the next.
    """

    def __init__(self, current: Callable[[], AgentSnapshot | None]) -> None:
        self._current = current
        self._lock = threading.Lock()
        self._cached_for: AgentSnapshot | None = None
        self._cached: tuple[Metric, ...] = ()

    def collect(self) -> Iterator[Metric]:
        snapshot = self._current()
        if snapshot is not None:
            yield from self.families(snapshot)

    def families(self, snapshot: AgentSnapshot) -> tuple[Metric, ...]:
        with self._lock:
            if self._cached_for is snapshot:
                return self._cached
        families = tuple(render_snapshot(snapshot))
        with self._lock:
            self._cached_for, self._cached = snapshot, families
        return families


def render_snapshot(snapshot: AgentSnapshot) -> Iterator[Metric]:
    """Every health family for one snapshot, in a stable order. Pure: no I/O, no clock."""
    for part in SNAPSHOT_PARTS:
        yield from part.render(snapshot)


def _other_families(snapshot: AgentSnapshot) -> Iterator[Metric]:
    yield from _verdict_families(snapshot)
    yield from _kube_families(snapshot)
    yield from pipeline_families(snapshot, _family)
    yield from _source_families(snapshot)
    yield from _internal_error_families(snapshot)
    yield from _folded_names_families(snapshot)


# In exposition order. The big parts (GPUs, EFA) change only when their source collects again.
SNAPSHOT_PARTS: tuple[SnapshotPart, ...] = (
    SnapshotPart("gpu", lambda s: (s.gpus, s.expected_gpus),
                 lambda s: _gpu_families(s.gpus, s.expected_gpus)),
    SnapshotPart("xid", lambda s: s.xid_counts, lambda s: _xid_families(s)),
    # EFA is most of the samples: its families are keyed by the values they are built from, so an
    # unchanged family is neither built nor encoded.
    SnapshotPart("efa", lambda s: (s.efa, s.expected_efa_devices),
                 lambda s: _efa_families(s.efa, s.expected_efa_devices),
                 inputs=lambda s: _efa_family_inputs(s.efa, s.expected_efa_devices)),
    # InfiniBand/RoCE ports (telemetry/rdma_metrics.py), keyed per family like EFA.
    SnapshotPart("rdma", lambda s: s.rdma, lambda s: rdma_families(s.rdma),
                 inputs=lambda s: rdma_family_inputs(s.rdma)),
    # ConnectX (mlx5) kernel-log events (telemetry/mlx5_metrics.py): only on a node with RDMA ports.
    SnapshotPart("mlx5", lambda s: (s.adapter_counts, bool(s.rdma)), lambda s: mlx5_families(s)),
    # Everything else is small and its timestamp changes every cycle: reused per snapshot only.
    SnapshotPart("other", lambda s: s, lambda s: _other_families(s), compare_equal=False),
)


def _folded_names_families(snapshot: AgentSnapshot) -> Iterator[Metric]:
    """``names_folded_total`` from the classifier's bounds (``bounded_names``); nothing until a
    name was folded."""
    folded = snapshot.names_folded
    if folded:
        family = _family("names_folded_total")
        for source in sorted(folded):
            family.add_metric([source], float(folded[source]))
        yield family


def _family(name: str) -> Metric:
    return _SPECS[name].family()


def _value(family: Metric, labels: list[str], value: float | int | bool | None) -> None:
    """Add a sample unless the value is unknown (None: not supported on this GPU/driver)."""
    if value is not None:
        family.add_metric(labels, float(value))


def _gpu_families(gpus: tuple[GpuSample, ...], expected: int | None) -> Iterator[Metric]:
    fam = {name: _family(name) for name in (
        "gpu_info", "gpu_up", "gpu_ecc_errors_total", "gpu_remapped_rows", "gpu_row_remap_pending",
        "gpu_row_remap_failure", "gpu_retired_pages", "gpu_retired_pages_pending",
        "nvlink_errors_total", "gpu_pcie_replay_total", "gpu_throttle_reasons",
        "gpu_temperature_celsius", "gpu_power_watts", "gpus_expected")}
    for gpu in gpus:
        index = str(gpu.index)
        fam["gpu_info"].add_metric([index, gpu.uuid, gpu.pci_bus_id, gpu.name, gpu.driver_version], 1.0)
        fam["gpu_up"].add_metric([index, gpu.uuid, gpu.pci_bus_id], 0.0 if gpu.lost else 1.0)
        if gpu.lost:
            continue  # NVML's other answers for a lost GPU are stale; up=0 says what is known
        g = [index, gpu.uuid]
        ecc = gpu.ecc
        for kind, scope, value in (
                ("corrected", "volatile", ecc.volatile_corrected),
                ("uncorrected", "volatile", ecc.volatile_uncorrected),
                ("corrected", "aggregate", ecc.aggregate_corrected),
                ("uncorrected", "aggregate", ecc.aggregate_uncorrected)):
            _value(fam["gpu_ecc_errors_total"], g + [kind, scope], value)
        _value(fam["gpu_remapped_rows"], g + ["correctable"], gpu.remap.correctable)
        _value(fam["gpu_remapped_rows"], g + ["uncorrectable"], gpu.remap.uncorrectable)
        _value(fam["gpu_row_remap_pending"], g, gpu.remap.pending)
        _value(fam["gpu_row_remap_failure"], g, gpu.remap.failure)
        _value(fam["gpu_retired_pages"], g + ["single_bit"], gpu.retired_pages.single_bit)
        _value(fam["gpu_retired_pages"], g + ["double_bit"], gpu.retired_pages.double_bit)
        _value(fam["gpu_retired_pages_pending"], g, gpu.retired_pages.pending)
        for link_counter in sorted(gpu.nvlink_errors):
            _value(fam["nvlink_errors_total"], g + [link_counter], gpu.nvlink_errors[link_counter])
        _value(fam["gpu_pcie_replay_total"], g, gpu.pcie_replay)
        active = set(gpu.throttle_reasons)
        for reason in KNOWN_THROTTLE_REASONS:
            fam["gpu_throttle_reasons"].add_metric(g + [reason], 1.0 if reason in active else 0.0)
        for reason in sorted(active.difference(KNOWN_THROTTLE_REASONS)):
            fam["gpu_throttle_reasons"].add_metric(g + [reason], 1.0)  # a bit NVML added later
        _value(fam["gpu_temperature_celsius"], g, gpu.temperature_c)
        _value(fam["gpu_power_watts"], g, gpu.power_w)
    _value(fam["gpus_expected"], [], expected)
    yield from fam.values()


def _xid_families(snapshot: AgentSnapshot) -> Iterator[Metric]:
    """XIDs as counters by (GPU, XID); NVSwitch SXids by (switch, SXid).

    Several tallies can share one label set (an XID whose GPU is unknown keeps only gpu="" and
    uuid=""), so values are summed per label set: a duplicate series would break the scrape.
    """
    xids: Counter = Counter()
    sxids: Counter = Counter()
    for count in snapshot.xid_counts:
        number = OVERFLOW if count.xid == FOLDED_NUMBER else str(count.xid)  # (bounded_names)
        if count.kind == "sxid":
            sxids[(count.pci_bus_id, number)] += count.count
        else:  # "xid" and "fallen_off_bus" (counted under its XID number): never drop a fault
            gpu = "" if count.gpu_index is None else str(count.gpu_index)
            xids[(gpu, count.uuid, number)] += count.count
    yield _counter_family("xid_errors_total", xids)
    yield _counter_family("sxid_errors_total", sxids)


def _counter_family(name: str, values: Counter) -> Metric:
    family = _family(name)
    for labels in sorted(values):
        family.add_metric(list(labels), float(values[labels]))
    return family


@lru_cache(maxsize=4096)
def efa_family_name(counter: str) -> str | None:
    """``healthagent_efa_<counter>_total`` for a driver counter file name; None for non-counters."""
    base = _UNSAFE.sub("_", counter.strip().lower()).strip("_")
    if base.endswith("_total"):
        base = base[: -len("_total")]
    if not base or base in EFA_NOT_COUNTERS:
        return None
    return f"{names.PREFIX}efa_{base}_total"


@dataclass(frozen=True)
class _EfaCounterColumn:
    """One EFA counter family's content: the driver's file name (for the help) and its samples."""

    counter: str
    samples: tuple[tuple[tuple[str, str], int], ...]  # ((device, port), value), sorted by device


def _efa_columns(samples: tuple[EfaSample, ...]) -> tuple[dict[str, _EfaCounterColumn],
                                                          tuple[tuple[tuple[str, str], float], ...]]:
    """EFA samples pivoted to one column per counter family, plus the port-up samples.

    Different devices may expose different counter sets (driver versions differ); a family holds
    the devices that have its counter.
    """
    rows: dict[str, tuple[str, list]] = {}
    port_up = []
    for sample in sorted(samples, key=lambda s: (s.device, s.port)):
        labels = (sample.device, str(sample.port))
        port_up.append((labels, 1.0 if "ACTIVE" in sample.port_state.upper() else 0.0))
        seen: set[str] = set()
        for counter in sorted(sample.counters):
            name = efa_family_name(counter)
            if name is None or name in seen:
                continue  # lifespan, or two raw names that sanitise alike: the first one wins
            seen.add(name)
            rows.setdefault(name, (counter, []))[1].append((labels, sample.counters[counter]))
    columns = {name: _EfaCounterColumn(counter, tuple(values)) for name, (counter, values) in rows.items()}
    return columns, tuple(port_up)


def _efa_families(samples: tuple[EfaSample, ...], expected: int | None) -> Iterator[Metric]:
    """One counter family per counter name seen, plus port_up and device counts."""
    for family in _efa_family_inputs(samples, expected):
        yield family.build()


def _efa_family_inputs(samples: tuple[EfaSample, ...], expected: int | None) -> Iterator[FamilyInput]:
    columns, port_up = _efa_columns(samples)
    for name in sorted(columns):
        column = columns[name]
        yield FamilyInput(name, column, lambda name=name, column=column: _efa_counter_family(name, column))
    yield FamilyInput(names.PREFIX + "efa_port_up", port_up, lambda: _gauge_rows("efa_port_up", port_up))
    device_count = len({s.device for s in samples})
    yield FamilyInput(names.PREFIX + "efa_devices", device_count,
                      lambda: _gauge_rows("efa_devices", (((), device_count),)))
    expected_rows = () if expected is None else (((), expected),)
    yield FamilyInput(names.PREFIX + "efa_devices_expected", expected_rows,
                      lambda: _gauge_rows("efa_devices_expected", expected_rows))


def _gauge_rows(name: str, rows: Iterable[tuple[tuple[str, ...], float | int]]) -> Metric:
    family = _family(name)
    for labels, value in rows:
        family.add_metric(list(labels), float(value))
    return family


def _efa_counter_family(name: str, column: _EfaCounterColumn) -> Metric:
    family = CounterMetricFamily(name, names.EFA_COUNTER_HELP.format(counter=column.counter),
                                 labels=list(names.EFA_COUNTER_LABELS))
    for labels, value in column.samples:
        family.add_metric(list(labels), float(value))
    return family


def _verdict_families(snapshot: AgentSnapshot) -> Iterator[Metric]:
    findings = _family("findings")
    node_action = _family("node_action")
    verdict = snapshot.verdict
    if verdict is not None:
        open_by_kind = Counter((f.code, f.action.value) for f in verdict.findings)
        for (code, action) in sorted(open_by_kind):
            findings.add_metric([code, action], float(open_by_kind[(code, action)]))
        for action in Action:
            node_action.add_metric([action.value], 1.0 if action is verdict.action else 0.0)
    yield findings
    yield node_action


KUBE_WRITE_PAIRS = tuple((kind, result) for kind in ("node", "node_status", "event")
                         for result in ("ok", "conflict", "error"))


def _kube_families(snapshot: AgentSnapshot) -> Iterator[Metric]:
    kube = snapshot.kube
    for name, value in (
            ("node_taint_applied", bool(kube.taint_effect)),
            ("budget_holding_taint", kube.budget_blocked),
            ("budget_blocked_total", kube.budget_blocked_total),
            ("kube_reachable", kube.reachable),
            ("kube_pending_writes", kube.pending_writes),
            ("kube_watch_up", kube.watching)):
        family = _family(name)
        family.add_metric([], float(value))
        yield family
    # Every (kind, result) pair from the start, at 0 until it happens: increase() and dashboards
    # need the series to exist before the first write, and a dry-run agent never writes.
    writes = _family("kube_writes_total")
    for pair in sorted(set(KUBE_WRITE_PAIRS) | set(kube.writes)):
        writes.add_metric(list(pair), float(kube.writes.get(pair, 0)))
    yield writes
    api_errors = _family("kube_api_errors_total")
    for kind in sorted(set(API_CONDITION_KINDS) | set(kube.api_errors)):
        api_errors.add_metric([kind], float(kube.api_errors.get(kind, 0)))
    yield api_errors
    if kube.gpu_quarantines or kube.dra_fallbacks:  # DRA hook: per-GPU quarantine (healthagent/dra)
        quarantined = _family("gpu_quarantined")
        for row in kube.gpu_quarantines:
            quarantined.add_metric(list(row), 1.0)
        yield quarantined
        fallback = _family("gpu_quarantine_fallback")
        for reason in kube.dra_fallbacks:
            fallback.add_metric([reason], 1.0)
        yield fallback


# Failures the agent survives, by component, from the start at 0 (increase() needs the series to
# exist before the first failure): the state file's, the effects', the classifier's, the HTTP
# server's and the loop's kinds. Other kinds (an API refusal with its status) appear when counted.
INTERNAL_ERROR_PAIRS: tuple[tuple[str, str], ...] = (
    ("state", "unreadable"), ("state", "corrupt"), ("state", "unwritable"), ("state", "too_large"),
    ("state", "not_json"),
    ("kube", "internal"), ("kube", "events_dropped"),
    ("policy", "internal"), ("policy", "restore"),
    ("http", "refused"), ("http", "handler"),
    ("loop", "cycle"), ("loop", "persist"),
)


def _internal_error_families(snapshot: AgentSnapshot) -> Iterator[Metric]:
    family = _family("internal_errors_total")
    counts = snapshot.internal_errors
    for pair in sorted(set(INTERNAL_ERROR_PAIRS) | set(counts)):
        family.add_metric(list(pair), float(counts.get(pair, 0)))
    yield family


def _source_families(snapshot: AgentSnapshot) -> Iterator[Metric]:
    up = _family("source_up")
    errors = _family("source_errors_total")
    for health in sorted(snapshot.health, key=lambda h: h.source):
        up.add_metric([health.source], 1.0 if health.up else 0.0)
        for kind in sorted(health.errors):
            errors.add_metric([health.source, kind], float(health.errors[kind]))
    yield up
    yield errors
    last = _family("last_cycle_timestamp_seconds")
    last.add_metric([], float(snapshot.timestamp))
    yield last

