"""What a training report must look like, and the one clear error a bad one gets.

The intake is reachable from every pod on the node (hostPort), so a report is untrusted input:
each field is checked for presence, type, sign, finiteness and a sane upper bound, and the job name
for length and control characters (it becomes a label value). A rejection carries a ``reason``
from a small fixed set (the ``reason`` label of ``training_reports_rejected_total``) and a message
that names the field and what is wrong, because the person reading it is debugging a training
script, not this agent.

Wire format (``POST /v1/training``, ``Content-Type: application/json``): one report object, or a
JSON array of up to ``MAX_BATCH`` of them (the client batches). ``type`` is ``step``,
``rendezvous`` or ``end``. Unknown extra fields are ignored (newer clients, older agents).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Union

MAX_JOB_LENGTH = 128
MAX_REASON_LENGTH = 128
MAX_WORLD_SIZE = 1_000_000  # ranks; the largest clusters today are ~100k GPUs
MAX_STEP = 10**15
MAX_PER_STEP_COUNT = 10**12  # tokens or samples in one step
MAX_STEP_SECONDS = 86_400.0  # a step longer than a day is a unit mistake (ms passed as s)
MAX_TIMESTAMP = 10**11  # unix seconds (year 5138); milliseconds are caught by this bound
MAX_BATCH = 1_000

# The reason label values of training_reports_rejected_total, fixed so the series stay bounded.
REJECT_REASONS: tuple[str, ...] = (
    "content_type", "length_required", "body_too_large", "malformed_json", "batch_too_large",
    "not_an_object", "unknown_type", "missing_field", "wrong_type", "negative", "not_finite",
    "out_of_range", "bad_job", "unauthorized", "wrong_job", "rate_limited",
)

REPORT_TYPES = ("step", "rendezvous", "end")


class ReportError(Exception):
    """A rejected report: ``reason`` is the metric label, ``str()`` the message for the caller."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class StepReport:
    """One rank finished one step. ``tokens``/``samples`` are the step's global totals."""

    job: str
    rank: int
    world_size: int
    step: int
    tokens: int
    samples: int
    step_seconds: float
    timestamp: float | None = None


@dataclass(frozen=True)
class RendezvousReport:
    """The job (re-)rendezvoused; ``world_size`` in ranks when known, ``reason`` free text."""

    job: str
    world_size: int | None = None
    reason: str = ""
    timestamp: float | None = None


@dataclass(frozen=True)
class EndReport:
    """The job finished on this node: stop its wall clock until it reports again."""

    job: str
    timestamp: float | None = None


Report = Union[StepReport, RendezvousReport, EndReport]


def parse_body(body: bytes) -> list[Any]:
    """The report objects in a request body (not yet validated one by one)."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ReportError("malformed_json", f"body is not UTF-8 JSON: {exc}") from None
    except RecursionError:  # "[[[[..." deeper than the decoder recurses: bad input, not our bug
        raise ReportError("malformed_json", "body is not usable JSON: arrays or objects nested too "
                                            "deeply; a report is one flat object, a batch one array "
                                            "of them") from None
    if isinstance(data, list):
        if len(data) > MAX_BATCH:
            raise ReportError("batch_too_large",
                              f"a batch holds at most {MAX_BATCH} reports, got {len(data)}")
        return data
    return [data]


def parse_report(item: Any) -> Report:
    """Validate one report object; raises ReportError naming the field and the problem."""
    if not isinstance(item, dict):
        raise ReportError("not_an_object", f"a report must be a JSON object, got {_json_type(item)}")
    kind = item.get("type")
    if kind is None:
        raise ReportError("missing_field", "field 'type' is required; use one of: " + ", ".join(REPORT_TYPES))
    if kind not in REPORT_TYPES:
        raise ReportError("unknown_type", f"field 'type' is {kind!r}; use one of: " + ", ".join(REPORT_TYPES))
    job = _job(item)
    timestamp = _number(item, kind, "timestamp", 0.0, MAX_TIMESTAMP, required=False)
    if kind == "step":
        world_size = _integer(item, kind, "world_size", 1, MAX_WORLD_SIZE)
        rank = _integer(item, kind, "rank", 0, MAX_WORLD_SIZE - 1)
        if rank >= world_size:
            raise ReportError("out_of_range", f"step report: rank {rank} is not below world_size {world_size}")
        return StepReport(
            job=job, rank=rank, world_size=world_size,
            step=_integer(item, kind, "step", 0, MAX_STEP),
            tokens=_integer(item, kind, "tokens", 0, MAX_PER_STEP_COUNT),
            samples=_integer(item, kind, "samples", 0, MAX_PER_STEP_COUNT),
            step_seconds=_number(item, kind, "step_seconds", 0.0, MAX_STEP_SECONDS),
            timestamp=timestamp,
        )
    if kind == "rendezvous":
        world_size = _integer(item, kind, "world_size", 1, MAX_WORLD_SIZE, required=False)
        return RendezvousReport(job=job, world_size=world_size, reason=_reason(item), timestamp=timestamp)
    return EndReport(job=job, timestamp=timestamp)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _text(item: dict, kind: str, key: str, required: bool) -> str | None:
    value = item.get(key)
    if value is None:
        if required:
            raise ReportError("missing_field", f"{kind} report: field {key!r} is required")
        return None
    if not isinstance(value, str):
        raise ReportError("wrong_type", f"{kind} report: field {key!r} must be a string, got {_json_type(value)}")
    return value


def _job(item: dict) -> str:
    kind = item.get("type")
    job = _text(item, kind, "job", required=True)
    if not job or len(job) > MAX_JOB_LENGTH or not job.isprintable():
        raise ReportError("bad_job", f"{kind} report: field 'job' must be 1-{MAX_JOB_LENGTH} printable "
                                     f"characters without control characters, got {job[:160]!r}")
    return job


def _reason(item: dict) -> str:
    reason = _text(item, "rendezvous", "reason", required=False) or ""
    if len(reason) > MAX_REASON_LENGTH or not reason.isprintable():
        raise ReportError("out_of_range", f"rendezvous report: field 'reason' must be at most "
                                          f"{MAX_REASON_LENGTH} printable characters")
    return reason


def _integer(item: dict, kind: str, key: str, low: int, high: int, required: bool = True) -> int | None:
    value = _present_number(item, kind, key, required)
    if value is None:
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ReportError("not_finite", f"{kind} report: field {key!r} must be a finite integer, got {value}")
        raise ReportError("wrong_type", f"{kind} report: field {key!r} must be an integer, got {value}")
    _check_range(kind, key, value, low, high)
    return value


def _number(item: dict, kind: str, key: str, low: float, high: float, required: bool = True) -> float | None:
    value = _present_number(item, kind, key, required)
    if value is None:
        return None
    if not math.isfinite(value):
        raise ReportError("not_finite", f"{kind} report: field {key!r} must be a finite number, got {value}")
    _check_range(kind, key, value, low, high)
    return float(value)


def _present_number(item: dict, kind: str, key: str, required: bool) -> int | float | None:
    value = item.get(key)
    if value is None:
        if required:
            raise ReportError("missing_field", f"{kind} report: field {key!r} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError("wrong_type", f"{kind} report: field {key!r} must be a number, got {_json_type(value)}")
    return value


def _check_range(kind: str, key: str, value: int | float, low: float, high: float) -> None:
    if value < 0 <= low:
        raise ReportError("negative", f"{kind} report: field {key!r} must not be negative, got {value}")
    if value < low or value > high:
        raise ReportError("out_of_range", f"{kind} report: field {key!r} must be between {low} and {high}, "
                                          f"got {value}")
