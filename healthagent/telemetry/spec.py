"""The exported metric names, types, labels and help texts, in one table.

Dashboards, alerts and people depend on these names (the conventions: prefix ``healthagent_``,
base units, counters end ``_total``), so they are declared once here and every collector builds
its families from this table: a name or label set cannot drift between the renderer, the docs
test and the help text.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

PREFIX = "healthagent_"


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family. ``name`` is without the prefix and, for counters, ends _total."""

    name: str
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str

    @property
    def full_name(self) -> str:
        return PREFIX + self.name

    def family(self) -> Metric:
        """A fresh, empty family for this metric; the caller adds samples in ``labels`` order."""
        labels = list(self.labels)
        if self.type == "counter":
            return CounterMetricFamily(self.full_name, self.help, labels=labels)
        if self.type == "histogram":
            return HistogramMetricFamily(self.full_name, self.help, labels=labels)
        return GaugeMetricFamily(self.full_name, self.help, labels=labels)


def _spec(name: str, kind: str, labels: str, text: str) -> MetricSpec:
    return MetricSpec(name, kind, tuple(labels.split()) if labels else (), text)


GPU = "gpu uuid"

# Node health, rendered from the loop's snapshot (telemetry/metrics.py).
HEALTH: tuple[MetricSpec, ...] = (
    _spec("gpu_info", "gauge", "gpu uuid pci_bus_id model_name driver_version",
          "1 for every GPU the agent reads; the labels identify it."),
    _spec("gpu_up", "gauge", "gpu uuid pci_bus_id",
          "1 while the GPU answers, 0 when NVML reports it lost (fallen off the bus)."),
    _spec("gpu_ecc_errors_total", "counter", GPU + " type scope",
          "ECC errors: type corrected|uncorrected, scope volatile (since driver load)|aggregate (lifetime)."),
    _spec("gpu_remapped_rows", "gauge", GPU + " type",
          "Rows remapped by the GPU, by type correctable|uncorrectable."),
    _spec("gpu_row_remap_pending", "gauge", GPU,
          "1 when a row remap waits for a GPU reset."),
    _spec("gpu_row_remap_failure", "gauge", GPU,
          "1 when a row remap failed (out of spare rows: NVIDIA says replace the GPU)."),
    _spec("gpu_retired_pages", "gauge", GPU + " cause",
          "Retired memory pages, by cause single_bit|double_bit."),
    _spec("gpu_retired_pages_pending", "gauge", GPU,
          "1 when a page retirement waits for a GPU reset."),
    _spec("xid_errors_total", "counter", GPU + " xid",
          "XID errors seen by this agent, by GPU and XID (gpu and uuid empty when unknown)."),
    _spec("sxid_errors_total", "counter", "pci_bus_id sxid",
          "NVSwitch SXid errors seen by this agent, by switch PCI id and SXid."),
    _spec("mlx5_events_total", "counter", "device pci_bus_id event",
          "ConnectX (mlx5) adapter events in the kernel log seen by this agent in this boot, by RDMA device "
          "(\"\" when unknown), PCI id and event (a row of the mlx5 catalog)."),
    _spec("nvlink_errors_total", "counter", GPU + " type",
          "NVLink errors summed over the GPU's links, by counter type."),
    _spec("gpu_pcie_replay_total", "counter", GPU,
          "PCIe replay counter of the GPU."),
    _spec("gpu_throttle_reasons", "gauge", GPU + " reason",
          "1 for each clocks-event (throttle) reason active now, 0 for the other known reasons."),
    _spec("gpu_temperature_celsius", "gauge", GPU, "GPU core temperature."),
    _spec("gpu_power_watts", "gauge", GPU, "GPU power draw."),
    _spec("gpus_expected", "gauge", "", "GPUs this node must have (configured expected_gpus)."),
    _spec("efa_port_up", "gauge", "efa_device port",
          "1 while the EFA device is present and its port says ACTIVE (the driver hard-codes ACTIVE, "
          "so this is really 'device present')."),
    _spec("efa_devices", "gauge", "", "EFA devices the agent reads now."),
    _spec("efa_devices_expected", "gauge", "",
          "EFA devices this node must have (configured expected_efa_devices; p5.48xlarge: 32)."),
    _spec("findings", "gauge", "code action", "Open findings by code and the action they demand."),
    _spec("node_action", "gauge", "action",
          "1 for the node's verdict action, 0 for the other five actions."),
    _spec("node_taint_applied", "gauge", "", "1 while the agent's own taint is on the node."),
    _spec("gpu_quarantined", "gauge", "device uuid pci_bus_id stage",
          "1 for each GPU quarantined with a DRA DeviceTaintRule; stage is the rule's effect now "
          "(None, NoSchedule, NoExecute), or held_by_budget: NoSchedule with its NoExecute due and no "
          "disruption-budget slot for it."),
    _spec("gpu_quarantine_fallback", "gauge", "reason",
          "1 while GPU-scope findings act on the node instead of one device (dra_not_served, "
          "gpu_not_published, too_many_gpus)."),
    _spec("budget_holding_taint", "gauge", "",
          "1 while the cluster-wide disruption budget holds the node at NoSchedule, waiting for a "
          "slot before its disruptive step."),
    _spec("budget_blocked_total", "counter", "", "Times the disruption budget held the node at NoSchedule."),
    _spec("kube_writes_total", "counter", "kind result",
          "Kubernetes API writes by kind node|node_status|event and result ok|conflict|error."),
    _spec("kube_reachable", "gauge", "", "1 when the last Kubernetes API call succeeded."),
    _spec("kube_pending_writes", "gauge", "",
          "Desired Kubernetes changes not yet applied (the API was unreachable)."),
    _spec("kube_api_errors_total", "counter", "kind",
          "Kubernetes API conditions the agent rode out, by kind (unavailable, node_not_found, "
          "conflicts_exhausted, budget_count_failed, watch_*): the API server's state, not the agent's."),
    _spec("kube_watch_up", "gauge", "",
          "1 while the watch on the agent's own node is live (0 in dry-run and while it is down)."),
    _spec("remediation_stage", "gauge", "stage",
          "1 for the stage of the remediation pipeline the node is in, 0 for the other seven "
          "(healthy, observing, cordoned, held_by_budget, disrupting, handed_off, rebooting, cleared)."),
    _spec("remediation_stage_info", "gauge", "stage reason",
          "1; the labels name the current stage and why (a finding code, an engine, budget)."),
    _spec("remediation_stage_entered_timestamp_seconds", "gauge", "",
          "Unix time the node entered its current stage (as this agent saw it; an agent restart starts it again)."),
    _spec("remediation_stage_transitions_total", "counter", "from_stage to_stage",
          "Moves between remediation stages, by stage pair."),
    _spec("remediation_stage_duration_seconds", "histogram", "stage",
          "How long finished stays in each remediation stage lasted."),
    _spec("budget_limit", "gauge", "scope",
          "The disruption budget's limit as this agent last read it (scope: the budget_scope_label value, "
          "\"\" for the fleet); absent until it looks."),
    _spec("budget_slots_held", "gauge", "scope",
          "Nodes holding a disruption budget slot, as this agent last read them; absent until it looks."),
    _spec("conditions_owned_elsewhere", "gauge", "",
          "Condition types of the agent's that another writer holds now (the agent leaves them alone)."),
    _spec("source_up", "gauge", "source", "1 when the source's last collection worked."),
    _spec("source_errors_total", "counter", "source kind",
          "Errors per source by kind (parse, unreadable, timeout, ...)."),
    _spec("last_cycle_timestamp_seconds", "gauge", "",
          "Unix time of the loop's last completed cycle."),
    _spec("names_folded_total", "counter", "source",
          "Names from text or sysfs (mlx5_adapter, xid_pci, sxid_pci, xid_number) folded into the one overflow name "
          "\"~other\" once a source's bound of distinct names is reached; absent until one is."),
    _spec("internal_errors_total", "counter", "component kind",
          "Failures the agent survived, by component state|kube|policy|http|loop and kind "
          "(e.g. state unwritable: restart safety is lost until the file can be written)."),
)

# Self-metrics that exist before the first snapshot.
COLLECT_DURATION = _spec("collect_duration_seconds", "histogram", "source",
                         "Seconds one collection of a source took.")
BUILD_INFO = _spec("build_info", "gauge", "version", "1; the label carries the agent's version.")

EFA_COUNTER_HELP = "EFA driver counter {counter} (cumulative since launch or driver reload)."
EFA_COUNTER_LABELS = ("efa_device", "port")

# Training intake (training/intake.py); every per-job series has the job label only.
TRAINING: tuple[MetricSpec, ...] = (
    _spec("training_steps_total", "counter", "job",
          "Training steps that advanced the job (each step once per agent; aggregate with max by job)."),
    _spec("training_tokens_total", "counter", "job",
          "Tokens of the job's counted steps (the reports' global per-step tokens)."),
    _spec("training_samples_total", "counter", "job",
          "Samples of the job's counted steps (the reports' global per-step samples)."),
    _spec("training_step_seconds", "histogram", "job", "Seconds per counted training step."),
    _spec("training_world_size", "gauge", "job", "The job's world size (ranks) as last reported."),
    _spec("training_last_step_timestamp_seconds", "gauge", "job",
          "Unix time of the job's last counted step."),
    _spec("scaling_events_total", "counter", "job direction reason",
          "World-size changes by direction up|down and reason fault|capacity|unknown."),
    _spec("training_productive_seconds_total", "counter", "job",
          "Step time of counted steps: the numerator of goodput."),
    _spec("training_wall_seconds_total", "counter", "job",
          "Wall time the job has been running on this node, stalls included: goodput's denominator."),
    _spec("training_rendezvous_total", "counter", "job",
          "Rendezvous (restart or membership change) reports received for the job."),
    _spec("training_jobs", "gauge", "", "Training jobs tracked now (at most training_max_jobs)."),
    _spec("training_reports_rejected_total", "counter", "reason",
          "Training reports rejected with a 4xx, by reason."),
    _spec("training_jobs_evicted_total", "counter", "",
          "Idle jobs dropped to stay under training_max_jobs."),
)


def by_name(specs: tuple[MetricSpec, ...]) -> dict[str, MetricSpec]:
    return {spec.name: spec for spec in specs}
