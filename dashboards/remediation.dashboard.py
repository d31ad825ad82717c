"""Remediation: where every faulty node is between "fault seen" and "back in service", and why it waits.

Each agent exports its node's stage (docs/remediation.md); fleet panels sum or take quantiles
over those series, or read the recording rules of the ``healthagent-remediation`` group. The
budget panels show what the agents last read when they asked for a slot (a node that never asked
exports no budget series).
"""

from dashboards.common import (
    GREEN_RED,
    RATE,
    cluster_variable,
    dashboard as build_dashboard,
    node_variable,
    sel,
    stat,
    table,
    target,
    timeseries,
)

STAGES_NOT_HEALTHY = 'stage!="healthy"'
HANDED_OFF = 'stage="handed_off"'
TO_CLEARED = 'to_stage="cleared"'


def nodes_in(stage: str) -> object:
    """How many of the selected nodes are in ``stage`` now (0, not empty, when none)."""
    stage_is = 'stage="' + stage + '"'
    return target(f"sum({sel('healthagent_remediation_stage', stage_is)}) or vector(0)")


dashboard = build_dashboard(
    title="healthagent / Remediation",
    uid="healthagent-remediation",
    description="The remediation pipeline: nodes per stage, time in each, the budget they wait on, "
                "the engines they are handed to.",
    tags=["remediation", "budget"],
    variables=[cluster_variable(), node_variable()],
    rows=[
        (4, [
            stat("Cordoned", "Nodes with the agent's NoSchedule whose grace runs.", [nodes_in("cordoned")]),
            stat("Held by the budget", "Nodes past their grace that wait for a budget slot.",
                 [nodes_in("held_by_budget")], thresholds=GREEN_RED),
            stat("Disrupting", "Nodes that took their disruptive step; no engine has them yet.",
                 [nodes_in("disrupting")]),
            stat("Handed off", "Nodes an engine has (drain, Karpenter, HyperPod, node repair).",
                 [nodes_in("handed_off")]),
            stat("Rebooting", "Nodes waiting for a new boot after a reboot_node's disruptive step.",
                 [nodes_in("rebooting")]),
            stat("Cleared (10 min)", "Nodes whose taint came off in the last 10 minutes.", [nodes_in("cleared")]),
        ]),
        (9, [
            timeseries("Nodes per stage", "How many nodes are in each stage of the pipeline (healthy left out).",
                       [target(f"sum by (stage) ({sel('healthagent_remediation_stage', STAGES_NOT_HEALTHY)})",
                               "{{stage}}")], stacked=True, step=True),
            table("Nodes in the pipeline", "Every node not healthy: its stage, why, and how long it has "
                  "been there.",
                  [target(f"max by (node, stage, reason) "
                          f"({sel('healthagent_remediation_stage_info', STAGES_NOT_HEALTHY)})", instant=True,
                          table=True),
                   target(f"time() - max by (node) ({sel('healthagent_remediation_stage_entered_timestamp_seconds')}"
                          f" and on (node) max by (node) "
                          f"({sel('healthagent_remediation_stage', STAGES_NOT_HEALTHY)} == 1))",
                          instant=True, table=True)],
                  sort_by="Value #B"),
        ]),
        (8, [
            timeseries("Time in stage, p50", "Median of the finished stays in each stage over 6 hours.",
                       [target(f"histogram_quantile(0.5, sum by (stage, le) (increase("
                               f"{sel('healthagent_remediation_stage_duration_seconds_bucket', STAGES_NOT_HEALTHY)}"
                               f"[6h])))", "{{stage}}")], unit="s"),
            timeseries("Time in stage, p99", "99th percentile of the finished stays in each stage over 6 hours.",
                       [target(f"histogram_quantile(0.99, sum by (stage, le) (increase("
                               f"{sel('healthagent_remediation_stage_duration_seconds_bucket', STAGES_NOT_HEALTHY)}"
                               f"[6h])))", "{{stage}}")], unit="s"),
            timeseries("Stage moves", "Moves between stages per interval, by the stage entered.",
                       [target(f"sum by (to_stage) (increase({sel('healthagent_remediation_stage_transitions_total')}"
                               f"{RATE}))", "to {{to_stage}}")], bars=True),
        ]),
        (8, [
            timeseries("Budget per scope", "Slots held against the limit, per budget scope, as the agents "
                       "last read them (\"\" is the fleet's budget).",
                       [target(f"max by (scope) ({sel('healthagent_budget_slots_held')})", "{{scope}} held"),
                        target(f"max by (scope) ({sel('healthagent_budget_limit')})", "{{scope}} limit")],
                       step=True),
            timeseries("Hand-offs per engine", "Nodes in the hands of each engine (the reason of the "
                       "handed_off stage: drain, karpenter, hyperpod, node-repair), and how long the engine "
                       "has had the oldest of them: a replaced node's last value is how long its engine took.",
                       [target(f"sum by (reason) ({sel('healthagent_remediation_stage_info', HANDED_OFF)})",
                               "{{reason}} nodes"),
                        target(f"max by (reason) (time() - "
                               f"{sel('healthagent_remediation_stage_entered_timestamp_seconds')}"
                               f" * on (node) group_right max by (node, reason) "
                               f"({sel('healthagent_remediation_stage_info', HANDED_OFF)}))",
                               "{{reason}} oldest (s)")], step=True),
            timeseries("Clears and conditions owned elsewhere", "Nodes cleared per interval (taint removed: "
                       "healed or an operator's clear), and nodes whose condition another writer keeps.",
                       [target(f"sum(increase({sel('healthagent_remediation_stage_transitions_total', TO_CLEARED)}"
                               f"{RATE})) or vector(0)", "cleared"),
                        target(f"count({sel('healthagent_conditions_owned_elsewhere')} > 0) or vector(0)",
                               "condition owned elsewhere")], bars=True),
        ]),
        (8, [  # per-GPU quarantine through DRA device taints (docs/operations.md)
            table("GPUs quarantined", "Each GPU kept out of new claims by a DRA DeviceTaintRule: its node, "
                  "device, UUID and stage (the rule's effect now).",
                  [target(f"max by (node, device, uuid, stage) ({sel('healthagent_gpu_quarantined')})",
                          instant=True, table=True)]),
            timeseries("GPU quarantines and fallbacks", "GPUs quarantined per stage, and nodes whose GPU "
                       "findings act on the node instead (DRA not served, GPU not published, too many GPUs).",
                       [target(f"sum by (stage) ({sel('healthagent_gpu_quarantined')})", "{{stage}}"),
                        target(f"count by (reason) ({sel('healthagent_gpu_quarantine_fallback')})",
                               "fallback {{reason}}")], step=True),
        ]),
    ],
)
