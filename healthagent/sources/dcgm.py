"""GPU health fields from a dcgm-exporter ``/metrics`` endpoint.

For nodes where the agent cannot load NVML itself (no driver library in its image) but
dcgm-exporter runs beside it. One HTTP GET per collection with a short timeout (``requests``),
parsed by ``prometheus_client.parser``, mapped onto the same ``GpuSample`` records NVML produces
(``source="dcgm"``), so policy does not care where a number came from.

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

XIDs: dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS`` is a gauge holding the *last* XID a GPU
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
import socket
import time
from dataclasses import dataclass, field

import requests
from prometheus_client.parser import text_string_to_metric_families
from urllib3.exceptions import ProtocolError, ReadTimeoutError

from healthagent.model import THROTTLE_REASONS, EccCounts, GpuSample, RemapState, RetiredPages, SourceHealth, XidEvent
from healthagent.model import canonical_pci_bus_id
from healthagent.common import ErrorTally
from healthagent.sources.base import SourceResult

MAX_BODY_BYTES = 16 * 1024 * 1024
CHUNK_BYTES = 64 * 1024

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
}

# DCGM's blank sentinels: int64 values from DCGM_INT64_BLANK up, doubles from DCGM_FP64_BLANK up.
_INT64_BLANK = float(0x7FFFFFFFFFFFFFF0)
_FP64_BLANK = 140737488355328.0
_DOUBLE_FIELDS = frozenset({"temperature_c", "power_w"})
_NVLINK_PREFIX = "nvlink_"


def throttle_reason_names(mask: int) -> tuple[str, ...]:
    """Names of the set bits of a clocks-event mask. DCGM's field carries NVML's bitmask, so
    NVML's table names them: both sources report a throttle the same way."""
    return tuple(name for name, bit in THROTTLE_REASONS if mask & bit)


class ScrapeError(Exception):
    """One failed scrape; ``kind`` is the error counter it goes to."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


@dataclass
class _GpuSeries:
    """The health fields of one GPU gathered from all its series in one scrape."""

    index: int
    uuid: str
    labels: dict[str, str]
    values: dict[str, float] = field(default_factory=dict)
    xid_line: str = ""
    xid_message: str = ""


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


def _body_chunks(reply: requests.Response):
    """The body in the pieces single socket receives return (urllib3 2's ``read1``), so the caller's
    deadline is checked after every receive; whole ``CHUNK_BYTES`` blocks (each of which may take
    many receives) only with an urllib3 that has no ``read1``."""
    read1 = getattr(reply.raw, "read1", None)
    if read1 is None:
        yield from reply.iter_content(CHUNK_BYTES)
        return
    while True:
        chunk = read1(CHUNK_BYTES, decode_content=True)
        if not chunk:
            return
        yield chunk


class DcgmSource:
    """Scrapes dcgm-exporter once per ``collect``; never raises."""

    name = "dcgm"

    def __init__(self, url: str, timeout_seconds: float) -> None:
        self.url = url
        self.timeout = timeout_seconds
        self.errors = ErrorTally(self.name)
        self._session = requests.Session()
        # dcgm-exporter is on the node or in-cluster: a proxy from the environment would only hurt.
        self._session.trust_env = False
        self._last_xid: dict[str, int] = {}

    def close(self) -> None:
        self._session.close()

    def collect(self, now: float) -> SourceResult:
        try:
            text = self._fetch()
            families = list(text_string_to_metric_families(text))
        except ScrapeError as exc:
            return self._failed(exc.kind, exc.detail)
        except ValueError as exc:  # the parser's answer to anything that is not exposition text
            return self._failed("parse", f"not Prometheus text: {exc}")
        gpus = self._group(families)
        samples = tuple(self._sample(g, now) for g in sorted(gpus.values(), key=lambda g: g.index))
        xids = tuple(self._new_xids(gpus, now))
        health = SourceHealth(source=self.name, up=True, detail=f"{len(samples)} GPUs from {self.url}",
                              errors=self.errors.snapshot())
        return SourceResult(health=health, gpus=samples, xids=xids)

    def _failed(self, kind: str, detail: str) -> SourceResult:
        self.errors.count(kind, f"url={self.url} {detail}")
        return SourceResult(health=SourceHealth(source=self.name, up=False, detail=detail,
                                                errors=self.errors.snapshot()))

    # -- HTTP ----------------------------------------------------------------------------------------

    def _fetch(self) -> str:
        """The body as text, or ScrapeError. The whole read is bounded by the timeout, not only
        each socket operation, so a server trickling bytes cannot hold the loop: the body is read
        one socket receive at a time (``read1``; each receive waits at most ``timeout``) and the
        deadline is checked between them, so a scrape ends within twice the timeout at worst."""
        deadline = time.monotonic() + self.timeout
        try:
            with self._session.get(self.url, timeout=self.timeout, stream=True,
                                   headers={"Accept": "text/plain", "Accept-Encoding": "identity"}) as reply:
                if reply.status_code >= 500:
                    raise ScrapeError("http_5xx", f"HTTP {reply.status_code} from {self.url}")
                if reply.status_code != 200:
                    raise ScrapeError("http_4xx" if reply.status_code >= 400 else "parse",
                                      f"HTTP {reply.status_code} from {self.url}")
                content_type = reply.headers.get("Content-Type", "text/plain")
                if not content_type.startswith("text/plain"):
                    raise ScrapeError("parse", f"Content-Type {content_type!r} is not Prometheus text")
                body = bytearray()
                for chunk in _body_chunks(reply):
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        raise ScrapeError("parse", f"body larger than {MAX_BODY_BYTES} bytes")
                    if time.monotonic() > deadline:
                        raise ScrapeError("timeout", f"body not complete within {self.timeout}s")
        except ScrapeError:
            raise
        except (ReadTimeoutError, socket.timeout):  # read1 goes around requests' exception mapping
            raise ScrapeError("timeout", f"body not complete within {self.timeout}s") from None
        except ProtocolError as exc:
            raise ScrapeError("parse", f"truncated or undecodable body: {type(exc).__name__}") from None
        except requests.exceptions.Timeout as exc:
            raise ScrapeError("timeout", f"no answer within {self.timeout}s: {type(exc).__name__}") from None
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError) as exc:
            raise ScrapeError("parse", f"truncated or undecodable body: {type(exc).__name__}") from None
        except requests.exceptions.ConnectionError as exc:
            if "timed out" in str(exc).lower():  # a body read timeout surfaces as ConnectionError
                raise ScrapeError("timeout", f"body not complete within {self.timeout}s") from None
            raise ScrapeError("connect", f"cannot connect to {self.url}: {type(exc).__name__}") from None
        except requests.exceptions.RequestException as exc:
            raise ScrapeError("connect", f"request to {self.url!r} failed: {type(exc).__name__}") from None
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise ScrapeError("parse", "body is not UTF-8 text") from None
        if text and not text.endswith("\n"):
            # The exposition format ends every line with \n; without it the body was cut short.
            raise ScrapeError("parse", f"body truncated ({len(body)} bytes, no final newline)")
        return text

    # -- mapping -------------------------------------------------------------------------------------

    def _group(self, families) -> dict[str, _GpuSeries]:
        gpus: dict[str, _GpuSeries] = {}
        for family in families:
            for sample in family.samples:
                name = sample.name
                target = FIELD_OF_METRIC.get(name)
                if target is None and name.endswith("_total"):  # the parser appends _total to counters
                    target = FIELD_OF_METRIC.get(name[: -len("_total")])
                    name = name[: -len("_total")]
                if target is None or sample.labels.get("nvlink"):
                    continue
                gpu = self._gpu_of(gpus, sample.labels, name)
                if gpu is None:
                    continue
                value = float(sample.value)
                if math.isnan(value) or math.isinf(value):
                    self.errors.count("parse", f"metric={name} gpu={gpu.index} value={sample.value}")
                    continue
                if target in gpu.values:
                    continue  # MIG instances and pod series repeat device-level fields
                gpu.values[target] = value
                if target == "xid":
                    gpu.xid_line = _render(name, sample.labels, value)
                    gpu.xid_message = sample.labels.get("err_msg", "")
        return gpus

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
        """One event per change of a GPU's last-XID gauge to a new non-zero value; a GPU's first
        value is its baseline (see the module docstring), never an event."""
        events: list[XidEvent] = []
        baseline: list[str] = []
        for key, gpu in sorted(gpus.items(), key=lambda item: item[1].index):
            xid = self._counter(gpu, "xid")
            if xid is None:
                continue
            first = key not in self._last_xid
            previous = self._last_xid.get(key)
            self._last_xid[key] = xid
            if first:
                if xid != 0:
                    baseline.append(f"GPU {gpu.index}={xid}")
                continue
            if xid == 0 or xid == previous:
                continue
            labels = gpu.labels
            gpu_instance = labels.get("GPU_I_ID", "")
            events.append(XidEvent(
                xid=xid,
                pci_bus_id=canonical_pci_bus_id(labels.get("pci_bus_id", "")) or "",
                message=gpu.xid_message,
                line=gpu.xid_line,
                timestamp=now,
                source=self.name,
                gpu_index=gpu.index,
                uuid=gpu.uuid,
                gpu_instance=int(gpu_instance) if gpu_instance.isdigit() else None,
            ))
        if baseline:
            self.errors.count("baseline", "last-XID gauge at first sight taken as baseline, not as new "
                                          "XIDs (no time on the gauge; the kernel log has this boot's "
                                          f"XIDs): {', '.join(baseline)}", n=len(baseline))
        return events
