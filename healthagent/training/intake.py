"""The agent side of the training intake: validate reports, aggregate per job, render metrics.

Ranks report to the agent on their own node, so each agent sees only its local ranks. Every
per-job number here is "the job as seen from this node", and rank-level reports become job-level
series (never per-rank series):

- A step counts once per agent: the first local report of a step number above the highest one
  counted so far advances ``steps``, ``tokens``, ``samples``, ``productive`` and the step-time
  histogram; the same step from the other local ranks, and steps re-done after a restart from an
  older checkpoint, add nothing (re-done work is badput, as in Google's goodput definition).
  ``tokens``/``samples`` are the step's *global* totals, which every framework logs, so it does not
  matter which rank's report is counted. Across nodes: ``max by (job)`` (docs/training.md).
- ``wall`` starts when the first reported step began (its timestamp minus its step_seconds) and
  covers everything after it: stalls, re-rendezvous, checkpoint restores. Time since the last
  report is rendered up to ``open_stall_cap_seconds``; the rest is added when the job reports
  again. So a stall is counted in full once the job is back, while a job that vanished without an
  ``end`` report (deleted, finished without hooks) inflates wall by at most the cap before it
  expires. The counter never goes backwards.
- A world-size change (from a step or rendezvous report, ordered by report timestamp so a late
  report from the old world cannot flap it back) is one ``scaling_events_total`` event: reason
  ``fault`` for a shrink within ``fault_window_seconds`` after this agent decided a node action
  (``note_fault``), else what the report's ``reason`` says (capacity/fault words), else
  ``unknown``.

Jobs are capped at ``max_jobs``: a new job evicts the least recently active one; a job with no
report for ``idle_seconds`` expires. Thread-safe: HTTP threads report while a scrape renders.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from healthagent.common import ErrorTally
from healthagent.telemetry import spec as names
from healthagent.training.schema import (
    REJECT_REASONS,
    EndReport,
    RendezvousReport,
    Report,
    ReportError,
    StepReport,
    parse_body,
    parse_report,
)

log = logging.getLogger(__name__)

# Step times from 50 ms (small models) to 10 minutes (huge pipeline steps).
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
DIRECTIONS = ("up", "down")
SCALING_REASONS = ("fault", "capacity", "unknown")
_FAULT_WORDS = frozenset({"fault", "failure", "node_failure", "node_fault", "hardware", "unhealthy",
                          "xid", "error"})
_CAPACITY_WORDS = frozenset({"capacity", "scale_up", "scaleup", "scale_down", "scaledown", "hpa",
                             "autoscaler", "autoscaling", "preemption", "spot", "quota"})
MAX_ERRORS_IN_REPLY = 10


@dataclass(frozen=True)
class IntakeReply:
    """What the HTTP layer sends back: a status and a JSON-able body."""

    status: int
    body: dict


def scaling_reason_from_text(text: str) -> str:
    """Map a report's free-text reason to fault|capacity|unknown (a bounded label value)."""
    word = text.strip().lower().replace("-", "_").replace(" ", "_")
    if word in _FAULT_WORDS:
        return "fault"
    if word in _CAPACITY_WORDS:
        return "capacity"
    return "unknown"


@dataclass
class JobState:
    """Everything kept about one job (mutable; only touched under the intake's lock)."""

    job: str
    last_activity: float
    world_size: int | None = None
    world_size_as_of: float = 0.0
    counted_step: int = -1
    steps: int = 0
    tokens: int = 0
    samples: int = 0
    productive: float = 0.0
    wall_confirmed: float = 0.0
    running_since: float | None = None  # start of the wall interval not yet confirmed by a report
    last_step_timestamp: float | None = None
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    step_count: int = 0
    step_sum: float = 0.0
    rendezvous: int = 0
    scaling: Counter = field(default_factory=Counter)

    def observe_step_time(self, seconds: float) -> None:
        index = bisect.bisect_left(STEP_BUCKETS, seconds)
        if index < len(self.bucket_counts):
            self.bucket_counts[index] += 1
        self.step_count += 1
        self.step_sum += seconds

    def confirm_wall(self, now: float) -> None:
        """A report proves the job was alive until now: the open interval becomes wall time."""
        if self.running_since is not None:
            self.wall_confirmed += max(0.0, now - self.running_since)
            self.running_since = now

    def wall_seconds(self, now: float, open_cap: float) -> float:
        if self.running_since is None:
            return self.wall_confirmed
        return self.wall_confirmed + min(max(0.0, now - self.running_since), open_cap)


class TrainingIntake:
    """A prometheus_client collector fed by ``POST /v1/training`` (see module docstring)."""

    def __init__(self, max_jobs: int = 64, idle_seconds: float = 3600.0, *,
                 fault_window_seconds: float = 900.0, open_stall_cap_seconds: float = 300.0,
                 clock: Callable[[], float] = time.time) -> None:
        if max_jobs < 1 or idle_seconds <= 0:
            raise ValueError("training intake: max_jobs must be at least 1 and idle_seconds above 0")
        self.max_jobs = max_jobs
        self.idle_seconds = float(idle_seconds)
        self.fault_window_seconds = float(fault_window_seconds)
        self.open_stall_cap_seconds = min(float(open_stall_cap_seconds), self.idle_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, JobState] = OrderedDict()  # least recently active first
        self._last_fault: float | None = None
        self._evicted = 0
        self._rejected = ErrorTally(source="training_intake")
        # Evictions are logged like rejections: one line per minute with the running total, so a
        # client that posts thousands of new job names cannot flood the log.
        self._evictions = ErrorTally(source="training_intake")

    # -- input -------------------------------------------------------------------------------------

    def note_fault(self, timestamp: float) -> None:
        """This agent just decided a node action; a shrink soon after is reason=fault."""
        with self._lock:
            if self._last_fault is None or timestamp > self._last_fault:
                self._last_fault = float(timestamp)

    def reject(self, reason: str, message: str, status: int = 400) -> IntakeReply:
        """Count a rejection found by the HTTP layer (content type, size) and build its reply."""
        self._rejected.count(reason, message)
        return IntakeReply(status, {"error": message, "reason": reason, "accepted": 0})

    def submit(self, body: bytes, job: str | None = None) -> IntakeReply:
        """Validate and apply a request body; valid reports of a batch count even if others fail.

        ``job``: the one job the request's credential may write (a job token), None for any. A
        body that names another job is refused whole (403, nothing applied): a credential never
        reaches past its job, not even for part of a batch.
        """
        try:
            items = parse_body(body)
        except ReportError as exc:
            return self.reject(exc.reason, str(exc))
        if job is not None:
            other = next((item["job"] for item in items
                          if isinstance(item, dict) and "job" in item and item["job"] != job), None)
            if other is not None:
                return self.reject("wrong_job", f"this request's token is for job {job!r}, but a "
                                                f"report names job {str(other)[:160]!r}; report "
                                                f"as {job!r} (HEALTHAGENT_JOB) or use that job's "
                                                f"token", 403)
        accepted = 0
        errors: list[dict[str, Any]] = []
        for index, item in enumerate(items):
            try:
                report = parse_report(item)
            except ReportError as exc:
                self._rejected.count(exc.reason, str(exc))
                errors.append({"index": index, "reason": exc.reason, "error": str(exc)})
                continue
            self.apply(report)
            accepted += 1
        if errors:
            return IntakeReply(400, {"error": errors[0]["error"], "reason": errors[0]["reason"],
                                     "accepted": accepted, "rejected": len(errors),
                                     "errors": errors[:MAX_ERRORS_IN_REPLY]})
        return IntakeReply(202, {"accepted": accepted})

    def apply(self, report: Report) -> None:
        """Fold one validated report into its job's state."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            job = self._job(report.job, now)
            stamp = now if report.timestamp is None else min(report.timestamp, now)
            if isinstance(report, StepReport):
                self._apply_step(job, report, stamp, now)
            elif isinstance(report, RendezvousReport):
                job.rendezvous += 1
                self._start_wall(job, stamp, now)
                job.confirm_wall(now)
                if report.world_size is not None:
                    self._observe_world(job, report.world_size, stamp, now, report.reason)
            elif isinstance(report, EndReport):
                job.confirm_wall(now)
                job.running_since = None
                job.counted_step = -1  # a later run under the same name starts from step 0

    def _apply_step(self, job: JobState, report: StepReport, stamp: float, now: float) -> None:
        self._observe_world(job, report.world_size, stamp, now, "")
        self._start_wall(job, stamp - report.step_seconds, now)  # the step began before its report
        job.confirm_wall(now)
        if report.step <= job.counted_step:
            return  # another local rank's report of a counted step, or re-done work
        job.counted_step = report.step
        job.steps += 1
        job.tokens += report.tokens
        job.samples += report.samples
        job.productive += report.step_seconds
        job.observe_step_time(report.step_seconds)
        if job.last_step_timestamp is None or stamp > job.last_step_timestamp:
            job.last_step_timestamp = stamp

    def _start_wall(self, job: JobState, began: float, now: float) -> None:
        """Start the job's wall clock when its first report's work began, by the report's own
        timestamp: a backlog delivered late (the client queued it while this agent restarted) then
        spans the time it took, not the second it arrived in. Never more than idle_seconds back."""
        if job.running_since is None:
            job.running_since = max(began, now - self.idle_seconds)

    def _observe_world(self, job: JobState, world_size: int, stamp: float, now: float, reason: str) -> None:
        if job.world_size is None:
            job.world_size, job.world_size_as_of = world_size, stamp
            return
        if stamp < job.world_size_as_of:
            return  # a late report from before the last change must not flap the size back
        job.world_size_as_of = stamp
        if world_size == job.world_size:
            return
        direction = "up" if world_size > job.world_size else "down"
        cause = self._scaling_reason(direction, reason, now)
        job.scaling[(direction, cause)] += 1
        log.info("training job=%s world_size=%d->%d direction=%s reason=%s", job.job, job.world_size,
                 world_size, direction, cause)
        job.world_size = world_size

    def _scaling_reason(self, direction: str, reason: str, now: float) -> str:
        recent_fault = self._last_fault is not None and self._last_fault >= now - self.fault_window_seconds
        if direction == "down" and recent_fault:
            return "fault"
        return scaling_reason_from_text(reason)

    def _job(self, name: str, now: float) -> JobState:
        job = self._jobs.get(name)
        if job is None:
            while len(self._jobs) >= self.max_jobs:
                evicted, _ = self._jobs.popitem(last=False)
                self._evicted += 1
                self._evictions.count("evicted", f"training job={evicted} evicted: more than "
                                                 f"max_jobs={self.max_jobs} jobs report to this agent")
            job = self._jobs[name] = JobState(job=name, last_activity=now)
        job.last_activity = now
        self._jobs.move_to_end(name)
        return job

    def _expire(self, now: float) -> None:
        while self._jobs:
            name, job = next(iter(self._jobs.items()))
            if now - job.last_activity <= self.idle_seconds:
                return
            del self._jobs[name]
            log.info("training job=%s expired after %.0f s without reports", name, now - job.last_activity)

    # -- output ------------------------------------------------------------------------------------

    def jobs(self) -> list[str]:
        """The jobs tracked now, least recently active first."""
        with self._lock:
            self._expire(self._clock())
            return list(self._jobs)

    def describe(self) -> list[Metric]:
        """No fixed description: families depend on the jobs (keeps registry registration cheap)."""
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = self._clock()
            self._expire(now)
            families = self._render(now)
        yield from families

    def _render(self, now: float) -> list[Metric]:
        fam = {spec.name: spec.family() for spec in names.TRAINING}
        for job in sorted(self._jobs.values(), key=lambda j: j.job):
            j = [job.job]
            fam["training_steps_total"].add_metric(j, float(job.steps))
            fam["training_tokens_total"].add_metric(j, float(job.tokens))
            fam["training_samples_total"].add_metric(j, float(job.samples))
            cumulative, buckets = 0, []
            for bound, count in zip(STEP_BUCKETS, job.bucket_counts):
                cumulative += count
                buckets.append((floatToGoString(bound), float(cumulative)))
            buckets.append(("+Inf", float(job.step_count)))
            fam["training_step_seconds"].add_metric(j, buckets, job.step_sum)
            if job.world_size is not None:
                fam["training_world_size"].add_metric(j, float(job.world_size))
            if job.last_step_timestamp is not None:
                fam["training_last_step_timestamp_seconds"].add_metric(j, job.last_step_timestamp)
            for direction in DIRECTIONS:
                for reason in SCALING_REASONS:
                    fam["scaling_events_total"].add_metric(
                        [job.job, direction, reason], float(job.scaling[(direction, reason)]))
            fam["training_productive_seconds_total"].add_metric(j, job.productive)
            fam["training_wall_seconds_total"].add_metric(
                j, job.wall_seconds(now, self.open_stall_cap_seconds))
            fam["training_rendezvous_total"].add_metric(j, float(job.rendezvous))
        fam["training_jobs"].add_metric([], float(len(self._jobs)))
        rejected = self._rejected.snapshot()
        for reason in REJECT_REASONS:
            fam["training_reports_rejected_total"].add_metric([reason], float(rejected.get(reason, 0)))
        fam["training_jobs_evicted_total"].add_metric([], float(self._evicted))
        return list(fam.values())

