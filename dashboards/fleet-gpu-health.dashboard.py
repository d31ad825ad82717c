"""Fleet GPU health: which nodes need what, what the agents did about it, and where faults cluster.

The first screen of an on-call: verdicts and taints across the fleet, the disruption budget, XIDs
by code, ECC rates, row remapping, lost GPUs, and the nodes that offend most.
"""

from dashboards.common import (
    RATE,
    GREEN_RED,
    cluster_variable,
    dashboard as build_dashboard,
    node_variable,
    sel,
    stat,
    table,
    target,
    timeseries,
)

NODE_ACTIONS = 'action=~"reboot_node|replace_node"'

dashboard = build_dashboard(
    title="healthagent / Fleet GPU health",
    uid="healthagent-fleet",
    description="Verdicts, taints, budget and GPU faults across every node running healthagent.",
    tags=["gpu", "fleet"],
    variables=[cluster_variable(), node_variable()],
    rows=[
        (4, [
            stat("Nodes reporting", "Agents Prometheus scrapes (healthagent_build_info).",
                 [target(f"count({sel('healthagent_build_info')})")]),
            stat("Nodes needing action", "Nodes whose verdict is reboot_node or replace_node.",
                 [target(f"count(max by (node) ({sel('healthagent_node_action', NODE_ACTIONS)}) == 1) or vector(0)")],
                 thresholds=GREEN_RED),
            stat("Nodes tainted", "Nodes on which the agent's own taint is applied.",
                 [target(f"sum({sel('healthagent_node_taint_applied')})")], thresholds=GREEN_RED),
            stat("Budget holding back", "Nodes the cluster-wide disruption budget holds at NoSchedule: "
                 "they need action and their running pods are still in their jobs.",
                 [target(f"sum({sel('healthagent_budget_holding_taint')})")], thresholds=GREEN_RED),
            stat("GPUs lost", "GPUs NVML reports lost (healthagent_gpu_up == 0).",
                 [target(f"count({sel('healthagent_gpu_up')} == 0) or vector(0)")], thresholds=GREEN_RED),
            stat("Open findings", "Findings open on all nodes (any action).",
                 [target(f"sum({sel('healthagent_findings')})")]),
        ]),
        (8, [
            timeseries("Nodes by verdict", "How many nodes have each verdict (node_action == 1).",
                       [target(f"count by (action) ({sel('healthagent_node_action')} == 1)", "{{action}}")],
                       stacked=True, step=True),
            timeseries("XIDs by code", "XID errors logged per interval, by XID number.",
                       [target(f"sum by (xid) (increase({sel('healthagent_xid_errors_total')}{RATE}))",
                               "XID {{xid}}")], bars=True),
        ]),
        (8, [
            timeseries("Uncorrectable (DBE) ECC errors / s", "Double-bit ECC errors by node (volatile count).",
                       [target("sum by (node) (rate("
                               + sel("healthagent_gpu_ecc_errors_total", 'type="uncorrected"', 'scope="volatile"')
                               + f"{RATE}))", "{{node}}")], unit="ops"),
            timeseries("Correctable (SBE) ECC errors / s", "Single-bit ECC errors by node (volatile count).",
                       [target("sum by (node) (rate("
                               + sel("healthagent_gpu_ecc_errors_total", 'type="corrected"', 'scope="volatile"')
                               + f"{RATE}))", "{{node}}")], unit="ops"),
        ]),
        (8, [
            timeseries("Row remapping pending / failed", "GPUs with a row remap waiting for a reset, and "
                       "GPUs whose remapping failed (replace), by node.",
                       [target(f"sum by (node) ({sel('healthagent_gpu_row_remap_pending')})", "{{node}} pending"),
                        target(f"sum by (node) ({sel('healthagent_gpu_row_remap_failure')})", "{{node}} FAILED")],
                       step=True),
            timeseries("GPUs lost or missing", "GPUs NVML reports lost, and GPUs missing from the expected "
                       "count (healthagent_gpus_expected), by node.",
                       [target(f"sum by (node) (1 - {sel('healthagent_gpu_up')})", "{{node}} lost"),
                        target(f"clamp_min(max by (node) ({sel('healthagent_gpus_expected')})"
                               f" - count by (node) ({sel('healthagent_gpu_up')}), 0)", "{{node}} missing")],
                       step=True),
            timeseries("Taints and budget", "Nodes tainted by the agent, nodes the budget holds at NoSchedule, and "
                       "how often the budget said no.",
                       [target(f"sum({sel('healthagent_node_taint_applied')})", "tainted"),
                        target(f"sum({sel('healthagent_budget_holding_taint')})", "held back by budget"),
                        target(f"sum(increase({sel('healthagent_budget_blocked_total')}{RATE}))",
                               "budget refusals")], step=True),
        ]),
        (10, [
            table("Top offending nodes", "Nodes with the most open findings, their verdict, and their XIDs "
                  "in the dashboard's time range.",
                  [target(f"topk(20, sum by (node) ({sel('healthagent_findings')}))", instant=True, table=True),
                   target(f"max by (node, action) ({sel('healthagent_node_action')} == 1)", instant=True, table=True),
                   target(f"sum by (node) (increase({sel('healthagent_xid_errors_total')}[$__range]))",
                          instant=True, table=True)],
                  sort_by="Value #A"),
        ]),
    ],
)
