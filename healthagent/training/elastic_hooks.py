"""Hooks that turn ``torch.distributed.elastic`` (torchrun) signals into training reports.

They run in the torchrun agent process (one per node), not in the ranks, and report to the
healthagent on the node through a ``TrainingReporter``. torch is not a dependency: nothing here
imports it except ``install_elastic_hooks`` (lazily, inside the function).

What torch emits (``torch.distributed.elastic``'s events and metrics) and what each becomes:

- ``RdzvEvent`` records (the ``"dynamic_rendezvous"`` destination; built only when that handler is
  replaced): the message "... as rank R in a world of size W." completes a rendezvous; W counts
  *nodes*, so it becomes a rendezvous report with ``world_size = W * nproc_per_node`` ranks when the
  ranks per node are known, else a rendezvous report without a world size (the ranks' own step
  reports then carry it).
- Agent ``Event`` ``torchelastic.worker.status.RENDEZVOUS`` (destination named by torchrun's
  ``--event-log-handler``): a rendezvous happened. Its ``group_world_size`` is recorded *before* the
  new world is assigned (stale), so it is not used; when the same handler already reported the
  rendezvous from the RdzvEvent just before, it is not reported twice.
- Agent ``Event`` ``torchelastic.worker.status.SUCCEEDED``: the job ended on this node (an ``end``
  report stops its wall clock).
- Metrics (``MetricHandler.emit(MetricData)``, for torch versions without an event-log handler):
  ``SimpleElasticAgent._rendezvous.success`` is a rendezvous, ``workers.<role>.run_success_*`` = 1
  the end of the run.

Both handlers catch everything: torchrun must never fail because reporting did.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any, Mapping

from healthagent.training.client import ENV_JOB, TrainingReporter

HANDLER_KEY = "healthagent"
RDZV_DESTINATION = "dynamic_rendezvous"
METRIC_GROUP = "torchelastic"
ENV_NPROC = ("HEALTHAGENT_NPROC_PER_NODE", "PET_NPROC_PER_NODE")
_JOINED = re.compile(r"as rank (\d+) in a world of size (\d+)")
_STATUS_PREFIX = "torchelastic.worker.status."


def nproc_per_node_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """Ranks per node from ``HEALTHAGENT_NPROC_PER_NODE`` or torchrun's ``PET_NPROC_PER_NODE``."""
    env = os.environ if env is None else env
    for key in ENV_NPROC:
        text = (env.get(key) or "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return None


def _as_dict(message: Any) -> dict[str, Any] | None:
    """An elastic event as a dict: torch logs ``event.serialize()`` (JSON), or the object itself."""
    if isinstance(message, str):
        try:
            data = json.loads(message)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return dataclasses.asdict(message)
    return None


def _enum_text(value: Any) -> str:
    return str(getattr(value, "value", value) or "")


class _ElasticReporting:
    """The mapping both hooks share: job naming and the reporter they send through."""

    def __init__(self, reporter: TrainingReporter | None, job: str | None,
                 env: Mapping[str, str] | None) -> None:
        env = os.environ if env is None else env
        self._job = job or (env.get(ENV_JOB) or "").strip() or None
        self.reporter = reporter if reporter is not None else TrainingReporter(job=self._job, env=env)

    def job_for(self, run_id: Any) -> str | None:
        """The configured job name, else the rendezvous run id (the ranks' TORCHELASTIC_RUN_ID)."""
        if self._job:
            return self._job
        text = str(run_id or "").strip()
        return text if text and text != "none" else None


class ElasticEventHandler(logging.Handler):
    """A ``logging.Handler`` for ``torch.distributed.elastic.events.handlers._log_handlers``.

    Install one instance under both ``"dynamic_rendezvous"`` and ``"healthagent"`` (what
    ``install_elastic_hooks`` does) and run torchrun with ``--event-log-handler healthagent``.
    """

    def __init__(self, reporter: TrainingReporter | None = None, *, job: str | None = None,
                 nproc_per_node: int | None = None, env: Mapping[str, str] | None = None) -> None:
        super().__init__(level=logging.INFO)
        self._reporting = _ElasticReporting(reporter, job, env)
        self.nproc_per_node = nproc_per_node or nproc_per_node_from_env(env)
        self._rendezvous_reported = False

    @property
    def reporter(self) -> TrainingReporter:
        return self._reporting.reporter

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = _as_dict(record.msg)
            if data is None:
                return
            if "node_state" in data and "run_id" in data:
                self._on_rdzv_event(data)
            elif "source" in data and "name" in data:
                self._on_event(data)
        except Exception:
            pass  # never let reporting break torchrun (logging.Handler.handleError would print)

    def _on_rdzv_event(self, data: dict[str, Any]) -> None:
        match = _JOINED.search(str(data.get("message") or ""))
        if match is None or _enum_text(data.get("node_state")) == "FAILED":
            return
        nodes = int(match.group(2))
        ranks = nodes * self.nproc_per_node if self.nproc_per_node else None
        self.reporter.report_rendezvous(ranks, job=self._reporting.job_for(data.get("run_id")))
        self._rendezvous_reported = True

    def _on_event(self, data: dict[str, Any]) -> None:
        name = str(data.get("name") or "")
        if not name.startswith(_STATUS_PREFIX) or _enum_text(data.get("source")) != "AGENT":
            return
        metadata = data.get("metadata") or {}
        job = self._reporting.job_for(metadata.get("run_id"))
        state = name[len(_STATUS_PREFIX):]
        if state == "RENDEZVOUS":
            if self._rendezvous_reported:
                self._rendezvous_reported = False  # already reported from the RdzvEvent
                return
            self.reporter.report_rendezvous(None, job=job)
        elif state == "SUCCEEDED":
            self.reporter.report_end(job=job)


class ElasticMetricHandler:
    """A ``torch.distributed.elastic.metrics.MetricHandler`` (duck-typed: ``emit(MetricData)``).

    ``forward`` receives every metric too, so configuring this does not lose another handler.
    """

    def __init__(self, reporter: TrainingReporter | None = None, *, job: str | None = None,
                 forward: Any = None, env: Mapping[str, str] | None = None) -> None:
        self._reporting = _ElasticReporting(reporter, job, env)
        self._forward = forward

    @property
    def reporter(self) -> TrainingReporter:
        return self._reporting.reporter

    def emit(self, metric_data: Any) -> None:
        try:
            name = str(getattr(metric_data, "name", ""))
            value = getattr(metric_data, "value", 0)
            job = self._reporting.job_for(None)
            if name.endswith("._rendezvous.success"):
                self.reporter.report_rendezvous(None, job=job)
            elif name.startswith("workers.") and ".run_success_" in name and value == 1:
                self.reporter.report_end(job=job)
        except Exception:
            pass
        if self._forward is not None:
            try:
                self._forward.emit(metric_data)
            except Exception:
                pass


def install_elastic_hooks(reporter: TrainingReporter | None = None, *, job: str | None = None,
                          nproc_per_node: int | None = None, metrics: bool = False) -> ElasticEventHandler | None:
    """Register the event handler with torch elastic in this (torchrun) process; None if no torch.

    Sets ``PET_EVENT_LOG_HANDLER=healthagent`` so a torchrun that knows ``--event-log-handler``
    sends its agent events here. ``metrics=True`` also configures the metric adapter for the
    ``torchelastic`` group (older torch without the event-log handler).
    """
    try:
        # deferred: torch is optional (only a torchrun process has it); without it the hooks stay off
        from torch.distributed.elastic import events
        from torch.distributed.elastic.events import handlers
    except Exception:
        return None
    try:
        handler = ElasticEventHandler(reporter, job=job, nproc_per_node=nproc_per_node)
        for key in (HANDLER_KEY, RDZV_DESTINATION):
            handlers._log_handlers[key] = handler
            existing = getattr(events, "_events_loggers", {}).get(key)
            if existing is not None:  # a logger cached before we were installed
                existing.handlers = [handler]
        os.environ.setdefault("PET_EVENT_LOG_HANDLER", HANDLER_KEY)
        if metrics:
            # deferred: torch is optional (only a torchrun process has it); without it the hooks stay off
            from torch.distributed.elastic import metrics as elastic_metrics

            elastic_metrics.configure(ElasticMetricHandler(handler.reporter, job=job), METRIC_GROUP)
        return handler
    except Exception:
        return None
