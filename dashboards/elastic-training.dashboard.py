"""Elastic training: world size, scaling events, throughput, step time and goodput per job.

Ranks report to the agent on their node (``/v1/training``), so each job's series come from every
node it runs on. Every agent counts each step once, with the step's global tokens and samples, so
steps, tokens, samples and world size are the same on every node of the job: panels take the max
over nodes, never the sum (which would multiply by the node count). Goodput is productive step
time over wall time (Google's ml-goodput-measurement definition; Meta's ETTR), pooled over nodes.
"""

from dashboards.common import (
    RATE,
    TRAINING_FILTERS,
    cluster_variable,
    dashboard as build_dashboard,
    job_variable,
    node_variable,
    prometheus_annotation,
    sel,
    stat,
    target,
    timeseries,
)



def tsel(metric: str, *matchers: str) -> str:
    return sel(metric, *matchers, filters=TRAINING_FILTERS)


def step_time_quantile(q: float) -> object:
    return target(f"histogram_quantile({q}, sum by (job, le) (rate({tsel('healthagent_training_step_seconds_bucket')}{RATE})))",
                  f"{{{{job}}}} p{int(q * 100)}")


GOODPUT_RATE = (f"sum by (job) (rate({tsel('healthagent_training_productive_seconds_total')}{RATE}))"
                f" / sum by (job) (rate({tsel('healthagent_training_wall_seconds_total')}{RATE}))")
GOODPUT_RANGE = (f"sum(increase({tsel('healthagent_training_productive_seconds_total')}[$__range]))"
                 f" / sum(increase({tsel('healthagent_training_wall_seconds_total')}[$__range]))")

dashboard = build_dashboard(
    title="healthagent / Elastic training",
    uid="healthagent-training",
    description="Elastic training jobs as their ranks report them to healthagent: size, scaling, speed, goodput.",
    tags=["training", "elastic"],
    variables=[cluster_variable(), job_variable(), node_variable()],
    annotations=[prometheus_annotation(
        "Scaling events",
        f"max by (job) ({tsel('healthagent_training_world_size')})"
        f" and changes(max by (job) ({tsel('healthagent_training_world_size')})[2m:]) > 0",
        title="{{job}} world size", text="{{job}} rescaled: world size now shown as the value", tags="job",
    )],
    rows=[
        (4, [
            stat("Jobs reporting", "Training jobs whose ranks report to healthagent.",
                 [target(f"count(count by (job) ({tsel('healthagent_training_world_size')}))")]),
            stat("World size now", "Current world size per job.",
                 [target(f"max by (job) ({tsel('healthagent_training_world_size')})", "{{job}}")]),
            stat("Scaling events in range", "Scale-ups and scale-downs in the time range.",
                 [target(f"sum(increase({tsel('healthagent_scaling_events_total')}[$__range]))")]),
            stat("Goodput in range", "Productive step time over wall time, over the time range.",
                 [target(GOODPUT_RANGE)], unit="percentunit", decimals=1),
            stat("Rejected reports", "Rank reports the agents refused (malformed, too many jobs ...); not "
                 "per job, since a rejected report may not name one.",
                 [target(f"sum(increase({sel('healthagent_training_reports_rejected_total')}[$__range]))"
                         " or vector(0)")]),
        ]),
        (8, [
            timeseries("World size", "World size per job over time; each drop is a scale-down (see annotations).",
                       [target(f"max by (job) ({tsel('healthagent_training_world_size')})", "{{job}}")], step=True),
            timeseries("Scaling events", "Scale events per interval by direction and reason (fault = a node "
                       "the agent took out).",
                       [target(f"sum by (job, direction, reason) (increase({tsel('healthagent_scaling_events_total')}{RATE}))",
                               "{{job}} {{direction}} ({{reason}})")], bars=True),
        ]),
        (8, [
            timeseries("Tokens / s", "Tokens per second per job (global per-step tokens; max over nodes).",
                       [target(f"max by (job) (rate({tsel('healthagent_training_tokens_total')}{RATE}))", "{{job}}")]),
            timeseries("Samples / s", "Samples per second per job (global per-step samples; max over nodes).",
                       [target(f"max by (job) (rate({tsel('healthagent_training_samples_total')}{RATE}))", "{{job}}")]),
            timeseries("Steps / s", "Steps per second per job (the same on every node; max over nodes).",
                       [target(f"max by (job) (rate({tsel('healthagent_training_steps_total')}{RATE}))", "{{job}}")]),
        ]),
        (8, [
            timeseries("Step time quantiles", "p50, p90 and p99 of the step time per job.",
                       [step_time_quantile(0.5), step_time_quantile(0.9), step_time_quantile(0.99)], unit="s"),
            timeseries("Goodput", "Productive step time over wall time per job.",
                       [target(GOODPUT_RATE, "{{job}}")], unit="percentunit"),
        ]),
        (8, [
            timeseries("Step rate by node", "Steps per second as each node's ranks report them: a node far "
                       "below the others is the straggler.",
                       [target(f"max by (job, node) (rate({tsel('healthagent_training_steps_total')}{RATE}))",
                               "{{job}} {{node}}")]),
            timeseries("Time since last step", "Seconds since any rank of the job reported a step.",
                       [target(f"time() - max by (job) ({tsel('healthagent_training_last_step_timestamp_seconds')})",
                               "{{job}}")], unit="s"),
        ]),
    ],
)
