"""The remediation pipeline's families: the node's stage, its history, and the budget it waits on.

Every stage is rendered (0 or 1) from the first snapshot, so a fleet view (``sum by (stage)``)
sees a series before the first move. The transitions and durations are cumulative since the agent
started (``effects/stage.py`` keeps them), and the usual moves and every stage's stays (but the
healthy one's, which is no part of a remediation) are rendered at 0 from the start: ``increase()``
counts nothing for a series that appears already at 1, so the first fault of a node would be
missing from every rate. Rendered from the snapshot like the rest: no I/O, no clock.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import Metric

from healthagent.stage_history import DURATION_BUCKETS, HEALTHY, STAGES, USUAL_MOVES, Durations
from healthagent.model import AgentSnapshot


def pipeline_families(snapshot: AgentSnapshot, family: Callable[[str], Metric]) -> Iterator[Metric]:
    """The stage families (once the loop has looked) and the budget's (once the agent read it)."""
    history = snapshot.stage
    if history is not None:
        stage = family("remediation_stage")
        for name in STAGES:
            stage.add_metric([name], 1.0 if name == history.stage else 0.0)
        yield stage
        info = family("remediation_stage_info")
        info.add_metric([history.stage, history.reason], 1.0)
        yield info
        entered = family("remediation_stage_entered_timestamp_seconds")
        entered.add_metric([], float(history.entered_wall))
        yield entered
        transitions = family("remediation_stage_transitions_total")
        for before, after in sorted(set(USUAL_MOVES) | set(history.transitions)):
            transitions.add_metric([before, after], float(history.transitions.get((before, after), 0)))
        yield transitions
        durations = family("remediation_stage_duration_seconds")
        bounds = [*(f"{b:g}" for b in DURATION_BUCKETS), "+Inf"]
        for name in STAGES:
            if name == HEALTHY:
                continue
            stays = history.durations.get(name, Durations())
            durations.add_metric([name], list(zip(bounds, (float(n) for n in stays.buckets))), stays.total)
        yield durations
    kube = snapshot.kube
    limit, held = family("budget_limit"), family("budget_slots_held")
    if kube.budget_limit is not None:
        limit.add_metric([kube.budget_scope], float(kube.budget_limit))
    if kube.budget_slots_held is not None:
        held.add_metric([kube.budget_scope], float(kube.budget_slots_held))
    yield limit
    yield held
    elsewhere = family("conditions_owned_elsewhere")
    elsewhere.add_metric([], float(kube.conditions_owned_elsewhere))
    yield elsewhere
