"""The torch elastic hooks, fed events the way torch emits them, reporting to a real agent.

torch is not a dependency, so the events are stand-ins: dataclasses with the real field names of
``torch.distributed.elastic.events.api`` (``Event``, ``RdzvEvent``, ``NodeState``, ``EventSource``)
and of ``metrics.api.MetricData``, serialised with ``json.dumps(asdict(...))`` and logged through a
non-propagating logger exactly as ``events.record`` / ``record_rdzv_event`` do. What they leave
out: torch's own dispatch (which destination key a torch version uses).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Optional

import pytest

from healthagent.training.elastic_hooks import (
    ElasticEventHandler,
    ElasticMetricHandler,
    install_elastic_hooks,
    nproc_per_node_from_env,
)
from healthagent.training.client import TrainingReporter

pytestmark = pytest.mark.integration


class EventSource(str, Enum):
    AGENT = "AGENT"
    WORKER = "WORKER"


class NodeState(str, Enum):
    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


@dataclass
class Event:
    name: str
    source: EventSource
    timestamp: int = 0
    metadata: dict = field(default_factory=dict)

    def serialize(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class RdzvEvent:
    name: str
    run_id: str
    message: str
    hostname: str
    pid: int
    node_state: NodeState
    master_endpoint: str = ""
    rank: Optional[int] = None
    local_id: Optional[int] = None
    error_trace: str = ""

    def serialize(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class MetricData:
    timestamp: float
    group_name: str
    name: str
    value: int


def joined(nodes: int, node_rank: int = 0, state: NodeState = NodeState.RUNNING) -> RdzvEvent:
    return RdzvEvent(
        name="dynamic_rendezvous.py:next_rendezvous", run_id="llama-run", node_state=state,
        message=(f"The node 'ip-10-0-0-1_123_0' has joined round 3 of the rendezvous 'llama-run' as rank "
                 f"{node_rank} in a world of size {nodes}."),
        hostname="ip-10-0-0-1", pid=123, rank=node_rank, local_id=0)


def agent_event(state: str, source: EventSource = EventSource.AGENT, group_world_size: int = 4) -> Event:
    metadata = {
        "run_id": "llama-run", "global_rank": None, "group_rank": 0, "worker_id": None, "role": "default",
        "hostname": "ip-10-0-0-1", "state": state, "total_run_time": 0, "rdzv_backend": "c10d",
        "raw_error": None, "metadata": json.dumps({"group_world_size": group_world_size, "entry_point": "python"}),
        "agent_restarts": 0, "duration_ms": 1234.5,
    }
    return Event(f"torchelastic.worker.status.{state}", source=source, timestamp=1_760_000_000_000,
                 metadata=metadata)


def torch_logger(name: str, handler: logging.Handler) -> logging.Logger:
    """What ``events._get_or_create_logger`` builds for a destination."""
    logger = logging.getLogger(f"torchelastic-events-{name}-test")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.handlers = [handler]
    return logger


@pytest.fixture
def wired(agent):
    reporter = TrainingReporter(url=agent.intake_url, env={})
    handler = ElasticEventHandler(reporter, nproc_per_node=8, env={})
    rdzv_log = torch_logger("dynamic_rendezvous", handler)
    events_log = torch_logger("healthagent", handler)
    yield agent, reporter, rdzv_log, events_log
    reporter.close(timeout=0.1)


def samples_for(agent, job: str = "llama-run") -> dict[str, float]:
    out = {}
    for row in agent.scrape().text.splitlines():
        if not row.startswith("#") and f'job="{job}"' in row:
            name, value = row.rsplit(" ", 1)
            out[name.removeprefix("healthagent_")] = float(value)
    return out


def test_rendezvous_events_become_rendezvous_reports_with_ranks(wired):
    agent, reporter, rdzv_log, events_log = wired
    rdzv_log.info(joined(4).serialize())  # 4 nodes x 8 ranks
    events_log.info(agent_event("RENDEZVOUS").serialize())  # the same rendezvous: not twice
    rdzv_log.info(joined(3).serialize())  # a node left: 24 ranks
    events_log.info(agent_event("RENDEZVOUS").serialize())
    events_log.info(agent_event("SUCCEEDED").serialize())
    reporter.close(timeout=30)
    assert reporter.stats().delivered == 3
    values = samples_for(agent)
    assert values['training_rendezvous_total{job="llama-run"}'] == 2
    assert values['training_world_size{job="llama-run"}'] == 24
    assert values['scaling_events_total{direction="down",job="llama-run",reason="unknown"}'] == 1


def test_agent_rendezvous_without_a_rdzv_event_is_still_a_rendezvous(wired):
    agent, reporter, _, events_log = wired
    events_log.info(agent_event("RENDEZVOUS").serialize())
    events_log.info(agent_event("RENDEZVOUS").serialize())
    reporter.close(timeout=30)
    values = samples_for(agent)
    assert values['training_rendezvous_total{job="llama-run"}'] == 2
    assert 'training_world_size{job="llama-run"}' not in values  # stale group_world_size is not used


@pytest.mark.parametrize("message", [
    joined(4, state=NodeState.FAILED).serialize(),
    agent_event("RENDEZVOUS", source=EventSource.WORKER).serialize(),
    agent_event("HEALTHY").serialize(),
    RdzvEvent(name="x", run_id="llama-run", message="The node has closed the rendezvous", hostname="h",
              pid=1, node_state=NodeState.RUNNING).serialize(),
    "not json at all",
    json.dumps([1, 2, 3]),
])
def test_other_records_are_ignored(wired, message):
    agent, reporter, rdzv_log, _ = wired
    rdzv_log.info(message)
    reporter.close(timeout=30)
    stats = reporter.stats()
    assert stats.delivered + stats.dropped + stats.pending == 0
    assert agent.intake.jobs() == []


def test_event_objects_are_accepted_as_well_as_their_json(wired):
    agent, reporter, rdzv_log, _ = wired
    rdzv_log.info(joined(2))  # the events module docstring logs the object itself
    reporter.close(timeout=30)
    assert samples_for(agent)['training_world_size{job="llama-run"}'] == 16


def test_without_ranks_per_node_the_rendezvous_has_no_world_size(agent):
    reporter = TrainingReporter(url=agent.intake_url, env={})
    handler = ElasticEventHandler(reporter, job="fixed-name", env={})
    torch_logger("dynamic_rendezvous", handler).info(joined(4).serialize())
    reporter.close(timeout=30)
    values = samples_for(agent, "fixed-name")
    assert values['training_rendezvous_total{job="fixed-name"}'] == 1
    assert 'training_world_size{job="fixed-name"}' not in values


def test_a_broken_reporter_never_breaks_torchrun():
    class Exploding:
        def __getattr__(self, name):
            raise RuntimeError("boom")

    handler = ElasticEventHandler(Exploding(), nproc_per_node=8, env={})  # type: ignore[arg-type]
    torch_logger("dynamic_rendezvous", handler).info(joined(4).serialize())
    metrics = ElasticMetricHandler(Exploding(), env={})  # type: ignore[arg-type]
    metrics.emit(MetricData(0.0, "torchelastic", "SimpleElasticAgent._rendezvous.success", 1))


def test_metric_handler_maps_rendezvous_and_run_success_and_forwards(agent):
    forwarded = []

    class Console:
        def emit(self, metric_data):
            forwarded.append(metric_data.name)

    reporter = TrainingReporter(url=agent.intake_url, env={})
    handler = ElasticMetricHandler(reporter, job="llama", forward=Console(), env={})
    for name, value in (("SimpleElasticAgent._rendezvous.success", 1),
                        ("SimpleElasticAgent._rendezvous.duration.ms", 1500),
                        ("workers.default.remaining_restarts", 3),
                        ("workers.default.run_success_no_retries", 0),
                        ("workers.default.run_success_with_retries", 1)):
        handler.emit(MetricData(1.0, "torchelastic", name, value))
    reporter.close(timeout=30)
    assert reporter.stats().delivered == 2  # one rendezvous, one end
    assert len(forwarded) == 5
    values = samples_for(agent, "llama")
    assert values['training_rendezvous_total{job="llama"}'] == 1


@pytest.mark.parametrize("env,expected", [
    ({"PET_NPROC_PER_NODE": "8"}, 8),
    ({"HEALTHAGENT_NPROC_PER_NODE": "4", "PET_NPROC_PER_NODE": "8"}, 4),
    ({"PET_NPROC_PER_NODE": "gpu"}, None),
    ({}, None),
])
def test_ranks_per_node_from_the_environment(env, expected):
    assert nproc_per_node_from_env(env) == expected


def test_install_without_torch_returns_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert install_elastic_hooks() is None


def test_install_registers_the_handler_under_both_keys(monkeypatch, agent):
    """A fake of the two torch modules install touches: a handler dict and a logger cache."""
    handlers_module = types.ModuleType("torch.distributed.elastic.events.handlers")
    handlers_module._log_handlers = {"console": logging.StreamHandler(), "null": logging.NullHandler(),
                                     "dynamic_rendezvous": logging.NullHandler()}
    events_module = types.ModuleType("torch.distributed.elastic.events")
    cached = logging.getLogger("torchelastic-events-dynamic_rendezvous-fake")
    events_module._events_loggers = {"dynamic_rendezvous": cached}
    events_module.handlers = handlers_module
    elastic = types.ModuleType("torch.distributed.elastic")
    elastic.events = events_module
    for name, module in (("torch", types.ModuleType("torch")),
                         ("torch.distributed", types.ModuleType("torch.distributed")),
                         ("torch.distributed.elastic", elastic),
                         ("torch.distributed.elastic.events", events_module),
                         ("torch.distributed.elastic.events.handlers", handlers_module)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("PET_EVENT_LOG_HANDLER", raising=False)
    reporter = TrainingReporter(url=agent.intake_url, env={})
    handler = install_elastic_hooks(reporter, nproc_per_node=8)
    assert isinstance(handler, ElasticEventHandler)
    assert handlers_module._log_handlers["healthagent"] is handler
    assert handlers_module._log_handlers["dynamic_rendezvous"] is handler
    assert cached.handlers == [handler]
    assert os.environ["PET_EVENT_LOG_HANDLER"] == "healthagent"
    reporter.close(timeout=0.1)


def test_torchrun_wrapper_without_torch_says_what_is_missing(monkeypatch):
    from healthagent.training import torchrun

    monkeypatch.setitem(sys.modules, "torch", None)
    assert torchrun.ranks_per_node(["--nproc-per-node", "8", "train.py"]) is None
    with pytest.raises(SystemExit, match="needs PyTorch"):
        torchrun.main(["--nproc-per-node", "8", "train.py"])
