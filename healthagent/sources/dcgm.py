"""GPU health fields from a dcgm-exporter ``/metrics`` endpoint.

For nodes where the agent cannot load NVML itself (no driver library in its image) but
dcgm-exporter runs beside it. One HTTP GET per collection with a short timeout (``requests``,
in ``sources/dcgm_fetch.py``), parsed by ``prometheus_client.parser``, mapped onto the same
``GpuSample`` records NVML produces (``source="dcgm"``), so policy does not care where a number
came from.

Formats accepted (all seen in the wild):
- field names ``DCGM_FI_DEV_*`` (2.x and later) and the 1.x compatibility names ``dcgm_*``;
- label sets ``gpu, UUID, device, modelName, Hostname`` (2.x), plus ``pci_bus_id`` and
  ``DCGM_FI_DRIVER_VERSION`` (3.x), ``uuid`` for ``UUID`` (old namespace), ``hostname`` for
  ``Hostname``, MIG's ``GPU_I_PROFILE``/``GPU_I_ID``, pod mapping's ``container``/``namespace``/
  ``pod`` and, on the XID gauge, ``err_code``/``err_msg`` (3.3+);
- the throttle bitmask under its old name ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` and its new one
  ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``;
- DCGM's "blank" sentinels (older exporters print e.g. ``9223372036854775794`` for a field the
  GPU does not support) read as "not supported" (None), not as a value.
Only the ``*_TOTAL`` NVLink fields are used; per-link series (``nvlink`` label) are ignored.

Every name dcgm-exporter versions give the health fields is mapped (``FIELD_OF_METRIC``): ECC
volatile/aggregate SBE/DBE totals, row remapping (correctable, uncorrectable, pending, failure),
retired pages (SBE, DBE, pending), in the ``DCGM_FI_DEV_*`` and 1.x ``dcgm_*`` namespaces, and
the XID in all three forms (below).

**Listed is not observed.** dcgm-exporter is often deployed with a custom field list that
carries only profiling or clock fields. Its GPUs are then *listed* (their series carry ``gpu`` and
``UUID``) but their health cannot be seen: no XID, no ECC, no row remapping. Such a GPU is not
reported as a sample (it would read as healthy) but named in ``SourceHealth.unobserved``; when
no GPU carries a health field, or the exporter lists no GPU at all (an empty body), the source is
down: the GPUs are unobserved through dcgm, never missing and never healthy, so nothing it did not
see can lead to a node action. A GPU with some of the health fields is reported with the others
``None`` (not supported), as NVML does, and the detail names the fields the exporter leaves out.

XIDs come in three forms. ``DCGM_EXP_XID_ERRORS_TOTAL{xid}`` (3.6+, opt-in) counts each XID
since the exporter started and ``DCGM_EXP_XID_ERRORS_COUNT{xid}`` counts them within a time
window: a rise of either is that many new XIDs (``XidEvent.repeats``), a series that appears after
the GPU's first scrape is new too, and a counter that went down is an exporter restart (its value
is new). When a GPU has either, its last-XID gauge is not read for events (one XID, one event).

dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS`` is a gauge holding the *last* XID a GPU
reported, not a count, and without a time: a value of 94 may be from days ago. So the first value
read for each GPU (the first successful scrape after every agent start) is a *baseline*: no event,
counted as ``baseline`` and logged (rate-limited) when it is non-zero. Only a later change to a new
non-zero value becomes one ``XidEvent(source="dcgm")``. Otherwise every agent restart would replay
a stale replace_node XID as new and re-open a finding an operator had cleared. Nothing is lost:
the kernel-log source reads the current boot's XIDs from the start of the ring, with their own
times. **dcgm cannot show repeats of the same XID**:
94 followed by another 94 leaves the gauge at 94, so the kernel log and NVML stay the sources of
truth for counts; this source is the fallback that still sees *that* something happened.

Failures (HTTP 5xx, timeouts, connection refused, non-text or truncated bodies) are counted by
kind (``http_5xx``, ``http_4xx``, ``timeout``, ``connect``, ``parse``), reported as ``up=False``
with the reason, and never raise. The last good XID values are kept across failures, so the
first good scrape after an outage does not replay an old XID as new.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from healthagent.model import THROTTLE_REASONS, EccCounts, GpuSample, RemapState, RetiredPages, SourceHealth, XidEvent
from healthagent.model import canonical_pci_bus_id
from healthagent.common import ErrorTally
from healthagent.sources.base import SourceResult
from healthagent.sources.dcgm_fetch import DcgmFetcher, ScrapeError

# metric name (as dcgm-exporter writes it) -> the GpuSample field it fills
FIELD_OF_METRIC: dict[str, str] = {
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "ecc_volatile_corrected",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_volatile_uncorrected",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "ecc_aggregate_corrected",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "ecc_aggregate_uncorrected",
    "dcgm_ecc_sbe_volatile_total": "ecc_volatile_corrected",
    "dcgm_ecc_dbe_volatile_total": "ecc_volatile_uncorrected",
    "dcgm_ecc_sbe_aggregate_total": "ecc_aggregate_corrected",
    "dcgm_ecc_dbe_aggregate_total": "ecc_aggregate_uncorrected",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "remap_correctable",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "remap_uncorrectable",
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "remap_pending",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "remap_failure",
    "DCGM_FI_DEV_RETIRED_SBE": "retired_single_bit",
    "DCGM_FI_DEV_RETIRED_DBE": "retired_double_bit",
    "DCGM_FI_DEV_RETIRED_PENDING": "retired_pending",
    "dcgm_retired_pages_sbe": "retired_single_bit",
    "dcgm_retired_pages_dbe": "retired_double_bit",
    "dcgm_retired_pages_pending": "retired_pending",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "pcie_replay",
    "dcgm_pcie_replay_counter": "pcie_replay",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": "nvlink_crc_flit",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": "nvlink_crc_data",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": "nvlink_replay",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": "nvlink_recovery",
    "dcgm_nvlink_flit_crc_error_count_total": "nvlink_crc_flit",
    "dcgm_nvlink_data_crc_error_count_total": "nvlink_crc_data",
    "dcgm_nvlink_replay_error_count_total": "nvlink_replay",
    "dcgm_nvlink_recovery_error_count_total": "nvlink_recovery",
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
    "dcgm_gpu_temp": "temperature_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "dcgm_power_usage": "power_w",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "throttle",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "throttle",
    "DCGM_FI_DEV_XID_ERRORS": "xid",
    "dcgm_xid_errors": "xid",
    # dcgm-exporter's own XID counters, one series per ``xid`` label
    "DCGM_EXP_XID_ERRORS_TOTAL": "xid_total",
    "DCGM_EXP_XID_ERRORS_COUNT": "xid_window",
}
# The fields that let the policy see a GPU's health: without any of them a GPU is only listed.
HEALTH_FIELDS: dict[str, tuple[str, ...]] = {
    "XID": ("xid", "xid_total", "xid_window"),
    "ECC": ("ecc_volatile_corrected", "ecc_volatile_uncorrected", "ecc_aggregate_corrected",
            "ecc_aggregate_uncorrected"),
    "row remapping": ("remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failure"),
    "retired pages": ("retired_single_bit", "retired_double_bit", "retired_pending"),
}
_XID_COUNTERS = ("xid_total", "xid_window")
MAX_XID_SERIES = 64  # distinct ``xid`` labels kept per GPU: far above the XIDs a GPU reports
MAX_GPUS = 256  # GPUs remembered between scrapes: a bound for garbage input, far above a real node

# DCGM's blank sentinels: int64 values from DCGM_INT64_BLANK up, doubles from DCGM_FP64_BLANK up.
_INT64_BLANK = float(0x7FFFFFFFFFFFFFF0)
_FP64_BLANK = 140737488355328.0
_DOUBLE_FIELDS = frozenset({"temperature_c", "power_w"})
_NVLINK_PREFIX = "nvlink_"


def throttle_reason_names(mask: int) -> tuple[str, ...]:
    """Names of the set bits of a clocks-event mask. DCGM's field carries NVML's bitmask, so
    NVML's table names them: both sources report a throttle the same way."""
    return tuple(name for name, bit in THROTTLE_REASONS if mask & bit)


@dataclass
class _GpuSeries:
    """The health fields of one GPU gathered from all its series in one scrape."""

    index: int
    uuid: str
    labels: dict[str, str]
    values: dict[str, float] = field(default_factory=dict)
    xid_line: str = ""
    xid_message: str = ""
    # (counter field, XID) -> value, for dcgm-exporter's per-XID counters
    xid_counts: dict[tuple[str, int], float] = field(default_factory=dict)

    def carries(self, fields: tuple[str, ...]) -> bool:
        return any(f in self.values for f in fields) or any(f in fields for f, _ in self.xid_counts)

    @property
    def observed(self) -> bool:
        """Carries at least one health field: its health can be judged."""
        return any(self.carries(fields) for fields in HEALTH_FIELDS.values())

    @property
    def name(self) -> str:
        return f"GPU {self.index}" + (f" ({self.uuid})" if self.uuid else "")


def _label(labels: dict[str, str], *names: str) -> str:
    for name in names:
        value = labels.get(name)
        if value:
            return value
    return ""


def _render(name: str, labels: dict[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    number = int(value) if float(value).is_integer() else value
    return f"{name}{{{inner}}} {number}"


class DcgmSource:
    """Scrapes dcgm-exporter once per ``collect``; never raises."""

    name = "dcgm"

    def __init__(self, url: str, timeout_seconds: float) -> None:
        self.url = url
        self.timeout = timeout_seconds
        self.errors = ErrorTally(self.name)
        self._fetcher = DcgmFetcher(url, timeout_seconds)
        self._last_xid: dict[str, int] = {}
        # GPUs whose first scrape (the baseline) was taken, and their per-XID counter values
        self._baselined: set[str] = set()
        self._last_counts: dict[tuple[str, str, int], int] = {}

    def close(self) -> None:
        self._fetcher.close()

    def collect(self, now: float) -> SourceResult:
        try:
            text = self._fetcher.fetch()
            families = list(text_string_to_metric_families(text))
        except ScrapeError as exc:
            return self._failed(exc.kind, exc.detail)
        except ValueError as exc:  # the parser's answer to anything that is not exposition text
            return self._failed("parse", f"not Prometheus text: {exc}")
        listed = self._group(families)
        if not listed:
            return self._failed("no_gpus", f"{self.url} lists no GPU (an empty body, or no series with a gpu or "
                                           f"UUID label): the GPUs are unobserved through dcgm-exporter")
        gpus = {key: g for key, g in listed.items() if g.observed}
        blind = tuple(g.name for g in sorted(listed.values(), key=lambda g: g.index) if not g.observed)
        xids = tuple(self._new_xids(gpus, now))
        if not gpus:
            return self._failed("no_health_fields", self._blind_detail(len(listed)), unobserved=blind)
        samples = tuple(self._sample(g, now) for g in sorted(gpus.values(), key=lambda g: g.index))
        health = SourceHealth(source=self.name, up=True, detail=self._detail(gpus, blind),
                              errors=self.errors.snapshot(), unobserved=blind)
        return SourceResult(health=health, gpus=samples, xids=xids)

    def _blind_detail(self, listed: int) -> str:
        return (f"{self.url} lists {listed} GPUs but carries none of the health fields (XID, ECC, row remapping, "
                f"retired pages): the GPUs are unobserved through dcgm-exporter; add DCGM_FI_DEV_XID_ERRORS, "
                f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL, DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS, "
                f"DCGM_FI_DEV_ROW_REMAP_PENDING, DCGM_FI_DEV_ROW_REMAP_FAILURE and DCGM_FI_DEV_RETIRED_DBE to "
                f"its counters CSV (dcgm-exporter --collectors)")

    def _detail(self, gpus: dict[str, _GpuSeries], blind: tuple[str, ...]) -> str:
        parts = [f"{len(gpus)} GPUs from {self.url}"]
        absent = [what for what, fields in HEALTH_FIELDS.items() if not any(g.carries(fields) for g in gpus.values())]
        if absent:
            parts.append("not carried by the exporter: " + ", ".join(absent))
        if blind:
            parts.append(f"{len(blind)} more listed without any health field (unobserved): "
                         + ", ".join(blind[:4]) + (" ..." if len(blind) > 4 else ""))
        return "; ".join(parts)

    def _failed(self, kind: str, detail: str, unobserved: tuple[str, ...] = ()) -> SourceResult:
        self.errors.count(kind, f"url={self.url} {detail}")
        return SourceResult(health=SourceHealth(source=self.name, up=False, detail=detail,
                                                errors=self.errors.snapshot(), unobserved=unobserved))

    # -- mapping -------------------------------------------------------------------------------------

    def _group(self, families) -> dict[str, _GpuSeries]:
        gpus: dict[str, _GpuSeries] = {}
        for family in families:
            for sample in family.samples:
                name = sample.name
                target = FIELD_OF_METRIC.get(name)
                if target is None and name.endswith("_total"):  # the parser appends _total to counters
                    target = FIELD_OF_METRIC.get(name[: -len("_total")])
                    name = name[: -len("_total")] if target is not None else name
                if target is None or sample.labels.get("nvlink"):
                    # not a health field: it still lists its GPU (a profiling-only field list)
                    if sample.labels.get("gpu") or _label(sample.labels, "UUID", "uuid"):
                        self._gpu_of(gpus, sample.labels, name)
                    continue
                gpu = self._gpu_of(gpus, sample.labels, name)
                if gpu is None:
                    continue
                value = float(sample.value)
                if math.isnan(value) or math.isinf(value):
                    self.errors.count("parse", f"metric={name} gpu={gpu.index} value={sample.value}")
                    continue
                if target in _XID_COUNTERS:
                    self._xid_count(gpu, target, sample.labels, value)
                    continue
                if target in gpu.values:
                    continue  # MIG instances and pod series repeat device-level fields
                gpu.values[target] = value
                if target == "xid":
                    gpu.xid_line = _render(name, sample.labels, value)
                    gpu.xid_message = sample.labels.get("err_msg", "")
        return gpus

    def _xid_count(self, gpu: _GpuSeries, target: str, labels: dict[str, str], value: float) -> None:
        """One series of dcgm-exporter's per-XID counters (its ``xid`` label; the window gauge's
        series without one, value 0, says there were none)."""
        raw = labels.get("xid", "")
        if not raw and value == 0:
            gpu.xid_counts.setdefault((target, 0), 0.0)  # present, no XID: the field is carried
            return
        if not raw.isdigit() or len(raw) > 9 or value < 0:
            self.errors.count("parse", f"gpu={gpu.index} {target} series with xid={raw!r} value={value}")
            return
        key = (target, int(raw))
        if key not in gpu.xid_counts and len(gpu.xid_counts) >= MAX_XID_SERIES:
            self.errors.count("parse", f"gpu={gpu.index} more than {MAX_XID_SERIES} XID series; xid={raw} ignored")
            return
        # MIG and pod series repeat the device's count: the largest is the GPU's, never a sum
        gpu.xid_counts[key] = max(gpu.xid_counts.get(key, 0.0), value)

    def _gpu_of(self, gpus: dict[str, _GpuSeries], labels: dict[str, str], metric: str) -> _GpuSeries | None:
        raw_index = labels.get("gpu", "")
        uuid = _label(labels, "UUID", "uuid")
        if not raw_index and not uuid:
            return None  # NVSwitch, CPU or node-level series
        try:
            index = int(raw_index)
        except ValueError:
            self.errors.count("parse", f"metric={metric} gpu label {raw_index!r} is not an index")
            return None
        key = uuid or f"gpu{index}"
        gpu = gpus.get(key)
        if gpu is None:
            gpu = gpus[key] = _GpuSeries(index=index, uuid=uuid, labels=dict(labels))
        return gpu

    def _counter(self, gpu: _GpuSeries, key: str) -> int | None:
        value = gpu.values.get(key)
        if value is None:
            return None
        blank = _FP64_BLANK if key in _DOUBLE_FIELDS else _INT64_BLANK
        if value >= blank:
            return None  # DCGM says: not supported / no data
        if value < 0:
            self.errors.count("parse", f"gpu={gpu.index} field={key} negative value {value}")
            return None
        return int(value)

    def _flag(self, gpu: _GpuSeries, key: str) -> bool | None:
        value = self._counter(gpu, key)
        return None if value is None else value > 0

    def _gauge(self, gpu: _GpuSeries, key: str) -> float | None:
        value = gpu.values.get(key)
        if value is None or value >= _FP64_BLANK:
            return None
        return value

    def _sample(self, gpu: _GpuSeries, now: float) -> GpuSample:
        labels = gpu.labels
        nvlink = {}
        for key in ("nvlink_replay", "nvlink_recovery", "nvlink_crc_flit", "nvlink_crc_data"):
            value = self._counter(gpu, key)
            if value is not None:
                nvlink[key[len(_NVLINK_PREFIX):]] = value
        throttle_mask = self._counter(gpu, "throttle")
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            pci_bus_id=canonical_pci_bus_id(labels.get("pci_bus_id", "")) or "",
            name=labels.get("modelName", ""),
            driver_version=labels.get("DCGM_FI_DRIVER_VERSION", ""),
            source=self.name,
            ecc=EccCounts(
                volatile_corrected=self._counter(gpu, "ecc_volatile_corrected"),
                volatile_uncorrected=self._counter(gpu, "ecc_volatile_uncorrected"),
                aggregate_corrected=self._counter(gpu, "ecc_aggregate_corrected"),
                aggregate_uncorrected=self._counter(gpu, "ecc_aggregate_uncorrected"),
            ),
            remap=RemapState(
                correctable=self._counter(gpu, "remap_correctable"),
                uncorrectable=self._counter(gpu, "remap_uncorrectable"),
                pending=self._flag(gpu, "remap_pending"),
                failure=self._flag(gpu, "remap_failure"),
            ),
            retired_pages=RetiredPages(
                single_bit=self._counter(gpu, "retired_single_bit"),
                double_bit=self._counter(gpu, "retired_double_bit"),
                pending=self._flag(gpu, "retired_pending"),
            ),
            throttle_reasons=throttle_reason_names(throttle_mask) if throttle_mask else (),
            nvlink_errors=nvlink,
            pcie_replay=self._counter(gpu, "pcie_replay"),
            temperature_c=self._gauge(gpu, "temperature_c"),
            power_w=self._gauge(gpu, "power_w"),
            timestamp=now,
        )

    def _new_xids(self, gpus: dict[str, _GpuSeries], now: float) -> list[XidEvent]:
        """New XIDs since the last scrape: from dcgm-exporter's per-XID counters when the GPU has
        them, else one event per change of its last-XID gauge to a new non-zero value. A GPU's
        first scrape is its baseline (see the module docstring), never an event."""
        events: list[XidEvent] = []
        baseline: list[str] = []
        for key, gpu in sorted(gpus.items(), key=lambda item: item[1].index):
            first = key not in self._baselined
            if first and len(self._baselined) < MAX_GPUS:
                self._baselined.add(key)
            counted = [(xid, n) for xid, n in self._counted(key, gpu, first) if n > 0]
            gauge = self._counter(gpu, "xid")
            if gauge is not None:
                previous = self._last_xid.get(key)
                if key in self._last_xid or len(self._last_xid) < MAX_GPUS:
                    self._last_xid[key] = gauge
                if gpu.xid_counts:
                    pass  # the per-XID counters say it, with counts: the gauge would say it again
                elif first or previous is None:
                    counted = []
                elif gauge not in (0, previous):
                    counted = [(gauge, 1)]
            if first:
                if gauge or any(v for v in gpu.xid_counts.values()):
                    baseline.append(f"GPU {gpu.index}")
                continue
            events.extend(self._event(gpu, xid, n, now) for xid, n in counted)
        if baseline:
            self.errors.count("baseline", "XID fields at first sight taken as baseline, not as new XIDs (no time on "
                                          "them; the kernel log has this boot's XIDs): " + ", ".join(baseline[:16]),
                              n=len(baseline))
        return events

    def _counted(self, key: str, gpu: _GpuSeries, first: bool) -> list[tuple[int, int]]:
        """(XID, how many are new) from the per-XID counters, remembering this scrape's values."""
        new: list[tuple[int, int]] = []
        # the count since start says it exactly; the window count only when there is no other
        kept = "xid_total" if any(t == "xid_total" for t, _ in gpu.xid_counts) else "xid_window"
        for (target, xid), raw in sorted(gpu.xid_counts.items()):
            if xid == 0 or target != kept:
                continue
            value = int(raw)
            slot = (key, target, xid)
            before = self._last_counts.get(slot)
            if slot in self._last_counts or len(self._last_counts) < MAX_GPUS * MAX_XID_SERIES:
                self._last_counts[slot] = value
            if first:
                continue
            if before is None or value < before:
                # a series that appeared since the baseline, or a counter that restarted (the window
                # count falling is old XIDs leaving its window: nothing new)
                new.append((xid, value if before is None or target == "xid_total" else 0))
            else:
                new.append((xid, value - before))
        return new

    def _event(self, gpu: _GpuSeries, xid: int, count: int, now: float) -> XidEvent:
        labels = gpu.labels
        gpu_instance = labels.get("GPU_I_ID", "")
        return XidEvent(
            xid=xid,
            pci_bus_id=canonical_pci_bus_id(labels.get("pci_bus_id", "")) or "",
            message=gpu.xid_message,
            line=gpu.xid_line or f"dcgm-exporter: {count} new XID {xid} on GPU {gpu.index}",
            timestamp=now,
            source=self.name,
            gpu_index=gpu.index,
            uuid=gpu.uuid,
            gpu_instance=int(gpu_instance) if gpu_instance.isdigit() else None,
            repeats=count,
        )
