"""What training jobs report to the agent: the client ranks import, the launcher hooks, the intake.

An input to the agent, like a source, with its own listener and credentials:

- ``client``: ``TrainingReporter``, what a rank calls; stdlib only, never blocks or raises.
- ``elastic_hooks``: torchrun's rendezvous and end events as reports, in the torchrun process.
- ``torchrun``: ``python -m healthagent.training.torchrun``, torchrun with those hooks installed.
- ``schema``: what a report must look like, and the one clear error a bad one gets.
- ``access``: who may post (``token``, ``open``, ``off``), job tokens derived from the key.
- ``intake``: the agent side: validate, count each step once per job, render the metrics.

Ranks import this module, so importing it must stay cheap and stdlib-only: the client and the
hooks are imported here directly, while ``TrainingIntake`` (which needs prometheus_client) is
loaded only when the agent asks for it (PEP 562 module ``__getattr__``).

In a training script::

    from healthagent.training import TrainingReporter
    reporter = TrainingReporter(job="llama-70b")
    reporter.report_step(step, tokens=global_tokens, samples=global_batch)  # every step

See docs/training.md for torchrun/HyperPod and what the metrics mean.
"""

from __future__ import annotations

from typing import Any

from healthagent.training.elastic_hooks import (
    ElasticEventHandler,
    ElasticMetricHandler,
    install_elastic_hooks,
)
from healthagent.training.client import (
    ReporterStats,
    TrainingReporter,
    agent_base_url,
    default_job,
)

_AGENT_SIDE = {"TrainingIntake", "IntakeReply"}

__all__ = [
    "ElasticEventHandler", "ElasticMetricHandler", "IntakeReply", "ReporterStats", "TrainingIntake",
    "TrainingReporter", "agent_base_url", "default_job", "install_elastic_hooks",
]


def __getattr__(name: str) -> Any:
    if name in _AGENT_SIDE:
        # deferred: ranks import this package; the intake (prometheus_client) loads only agent-side
        from healthagent.training import intake as training_intake

        return getattr(training_intake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
