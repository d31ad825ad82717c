"""Node drill-down: everything the agent knows about one node, GPU by GPU.

Where an on-call lands from an alert (the alert's ``node`` label is this dashboard's variable):
the verdict and its findings by code, then per-GPU ECC, remaps, XIDs, throttling, temperature,
power, NVLink and PCIe, and finally the agent's own sources and Kubernetes writes.
"""

from dashboards.common import (
    RATE,
    GREEN_RED,
    cluster_variable,
    dashboard as build_dashboard,
    node_variable,
    sel,
    stat,
    state_timeline,
    table,
    target,
    timeseries,
    up_down_mappings,
)


dashboard = build_dashboard(
    title="healthagent / Node drill-down",
    uid="healthagent-node",
    description="One node: verdict, findings, and per-GPU health as healthagent reads it.",
    tags=["gpu", "node"],
    variables=[cluster_variable(), node_variable(single=True)],
    rows=[
        (4, [
            stat("Verdict", "The node's action: the most severe open finding decides it.",
                 [target(f"max by (action) ({sel('healthagent_node_action')} == 1)", "{{action}}")],
                 text_mode="name"),
            stat("Taint applied", "1 while the agent's own taint is on the node.",
                 [target(f"max({sel('healthagent_node_taint_applied')})")], thresholds=GREEN_RED),
            stat("Budget holding back", "1 while the disruption budget holds this node at NoSchedule, waiting for a slot.",
                 [target(f"max({sel('healthagent_budget_holding_taint')})")], thresholds=GREEN_RED),
            stat("Kubernetes reachable", "Whether the agent reaches the API server, and writes it still owes.",
                 [target(f"max({sel('healthagent_kube_reachable')})", "reachable"),
                  target(f"max({sel('healthagent_kube_pending_writes')})", "pending writes")]),
            stat("Last cycle", "Seconds since the agent finished a cycle (a stuck loop serves stale health).",
                 [target(f"time() - max({sel('healthagent_last_cycle_timestamp_seconds')})")], unit="s"),
            stat("Agent version", "healthagent_build_info.",
                 [target(f"max by (version) ({sel('healthagent_build_info')})", "{{version}}")],
                 text_mode="name"),
        ]),
        (8, [
            table("Open findings", "Findings by stable code and the action each demands; the code's runbook is "
                  "its section in docs/findings.md.",
                  [target(f"max by (code, action) ({sel('healthagent_findings')}) > 0", instant=True, table=True)],
                  sort_by="Value"),
            table("GPUs", "Inventory: index, UUID, PCI bus id, model and driver.",
                  [target("max by (gpu, uuid, pci_bus_id, model_name, driver_version) ("
                          + sel("healthagent_gpu_info") + ")", instant=True, table=True),
                   target(f"max by (gpu, uuid) ({sel('healthagent_gpu_up')})", instant=True, table=True)]),
        ]),
        (8, [
            timeseries("ECC errors / s by GPU", "Volatile ECC error rate per GPU; uncorrected is a DBE.",
                       [target("sum by (gpu, type) (rate("
                               + sel("healthagent_gpu_ecc_errors_total", 'scope="volatile"') + RATE + "))",
                               "GPU {{gpu}} {{type}}")], unit="ops"),
            timeseries("ECC errors since driver load", "Volatile ECC counts per GPU (reset by a driver reload).",
                       [target("max by (gpu, type) ("
                               + sel("healthagent_gpu_ecc_errors_total", 'scope="volatile"') + ")",
                               "GPU {{gpu}} {{type}}")], step=True),
            timeseries("Row remapping", "Remapped rows per GPU, and the pending / failure flags.",
                       [target(f"max by (gpu, type) ({sel('healthagent_gpu_remapped_rows')})", "GPU {{gpu}} {{type}} rows"),
                        target(f"max by (gpu) ({sel('healthagent_gpu_row_remap_pending')})", "GPU {{gpu}} pending"),
                        target(f"max by (gpu) ({sel('healthagent_gpu_row_remap_failure')})", "GPU {{gpu}} FAILED")],
                       step=True),
        ]),
        (8, [
            timeseries("XIDs by GPU", "XID errors per interval, by GPU and XID (gpu empty: not attributed).",
                       [target(f"sum by (gpu, xid) (increase({sel('healthagent_xid_errors_total')}{RATE}))",
                               "GPU {{gpu}} XID {{xid}}")], bars=True),
            state_timeline("Throttle reasons", "Active clock-event (throttle) reasons per GPU: 1 = active.",
                           [target(f"max by (gpu, reason) ({sel('healthagent_gpu_throttle_reasons')})",
                                   "GPU {{gpu}} {{reason}}")]),
        ]),
        (8, [
            timeseries("Temperature", "GPU temperature.",
                       [target(f"max by (gpu) ({sel('healthagent_gpu_temperature_celsius')})", "GPU {{gpu}}")],
                       unit="celsius"),
            timeseries("Power", "GPU power draw.",
                       [target(f"max by (gpu) ({sel('healthagent_gpu_power_watts')})", "GPU {{gpu}}")],
                       unit="watt"),
        ]),
        (8, [
            timeseries("NVLink errors / s", "NVLink error counters per GPU, summed over links.",
                       [target(f"sum by (gpu, type) (rate({sel('healthagent_nvlink_errors_total')}{RATE}))",
                               "GPU {{gpu}} {{type}}")], unit="ops"),
            timeseries("PCIe replays / s", "PCIe replay counter rate per GPU.",
                       [target(f"sum by (gpu) (rate({sel('healthagent_gpu_pcie_replay_total')}{RATE}))",
                               "GPU {{gpu}}")], unit="ops"),
        ]),
        (8, [
            state_timeline("Sources", "Each source's health in its last collection.",
                           [target(f"max by (source) ({sel('healthagent_source_up')})", "{{source}}")],
                           mappings=up_down_mappings(), thresholds=[{"color": "red", "value": None},
                                                                    {"color": "green", "value": 1}]),
            timeseries("Collection time p99", "How long each source's collection takes.",
                       [target("histogram_quantile(0.99, sum by (source, le) (rate("
                               + sel("healthagent_collect_duration_seconds_bucket") + RATE + ")))", "{{source}}")],
                       unit="s"),
            timeseries("Source errors", "Bad input and failed reads by source and kind (counted, never fatal).",
                       [target(f"sum by (source, kind) (increase({sel('healthagent_source_errors_total')}{RATE}))",
                               "{{source}} {{kind}}")], bars=True),
            timeseries("Kubernetes writes", "API writes by kind and result (zero in steady state).",
                       [target(f"sum by (kind, result) (increase({sel('healthagent_kube_writes_total')}{RATE}))",
                               "{{kind}} {{result}}")], bars=True),
        ]),
    ],
)
