"""The documented metric contract (name, type, labels), written out independently of the code, and the
helpers that read a scrape with prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.telemetry.snapshots import EFA_COUNTERS

G = ("gpu", "uuid")

# The contract's list (name without prefix, type, labels), written out independently of the code.
CONTRACT: list[tuple[str, str, tuple[str, ...]]] = [
    ("gpu_info", "gauge", ("gpu", "uuid", "pci_bus_id", "model_name", "driver_version")),
    ("gpu_up", "gauge", ("gpu", "uuid", "pci_bus_id")),
    ("gpu_ecc_errors_total", "counter", G + ("type", "scope")),
    ("gpu_remapped_rows", "gauge", G + ("type",)),
    ("gpu_row_remap_pending", "gauge", G),
    ("gpu_row_remap_failure", "gauge", G),
    ("gpu_retired_pages", "gauge", G + ("cause",)),
    ("gpu_retired_pages_pending", "gauge", G),
    ("xid_errors_total", "counter", G + ("xid",)),
    ("sxid_errors_total", "counter", ("pci_bus_id", "sxid")),
    ("nvlink_errors_total", "counter", G + ("type",)),
    ("gpu_pcie_replay_total", "counter", G),
    ("gpu_throttle_reasons", "gauge", G + ("reason",)),
    ("gpu_temperature_celsius", "gauge", G),
    ("gpu_power_watts", "gauge", G),
    ("gpus_expected", "gauge", ()),
    ("efa_port_up", "gauge", ("efa_device", "port")),
    ("efa_devices", "gauge", ()),
    ("efa_devices_expected", "gauge", ()),
    ("findings", "gauge", ("code", "action")),
    ("node_action", "gauge", ("action",)),
    ("node_taint_applied", "gauge", ()),
    ("budget_holding_taint", "gauge", ()),
    ("budget_blocked_total", "counter", ()),
    ("kube_writes_total", "counter", ("kind", "result")),
    ("kube_api_errors_total", "counter", ("kind",)),
    ("kube_reachable", "gauge", ()),
    ("kube_pending_writes", "gauge", ()),
    ("collect_duration_seconds", "histogram", ("source",)),
    ("source_up", "gauge", ("source",)),
    ("source_errors_total", "counter", ("source", "kind")),
    ("build_info", "gauge", ("version",)),
    ("last_cycle_timestamp_seconds", "gauge", ()),
    ("training_steps_total", "counter", ("job",)),
    ("training_tokens_total", "counter", ("job",)),
    ("training_samples_total", "counter", ("job",)),
    ("training_step_seconds", "histogram", ("job",)),
    ("training_world_size", "gauge", ("job",)),
    ("training_last_step_timestamp_seconds", "gauge", ("job",)),
    ("scaling_events_total", "counter", ("job", "direction", "reason")),
    ("training_productive_seconds_total", "counter", ("job",)),
    ("training_wall_seconds_total", "counter", ("job",)),
    ("training_reports_rejected_total", "counter", ("reason",)),
    ("training_jobs_evicted_total", "counter", ()),
] + [(f"efa_{c}_total", "counter", ("efa_device", "port")) for c in EFA_COUNTERS if c != "lifespan"]

# Added beyond the first list (documented in docs/reference/metrics.md); same conventions.
EXTRAS = [
    ("training_rendezvous_total", "counter", ("job",)),
    ("training_jobs", "gauge", ()),
    ("internal_errors_total", "counter", ("component", "kind")),
    ("kube_watch_up", "gauge", ()),
    ("remediation_stage", "gauge", ("stage",)),
    ("remediation_stage_info", "gauge", ("stage", "reason")),
    ("remediation_stage_entered_timestamp_seconds", "gauge", ()),
    ("remediation_stage_transitions_total", "counter", ("from_stage", "to_stage")),
    ("remediation_stage_duration_seconds", "histogram", ("stage",)),
    ("budget_limit", "gauge", ("scope",)),
    ("budget_slots_held", "gauge", ("scope",)),
    ("conditions_owned_elsewhere", "gauge", ()),
]


def parse(text: str) -> dict[str, tuple[str, set[tuple[str, ...]], list]]:
    """name (with _total for counters) -> (type, label-name sets, samples)."""
    families = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        label_sets = {tuple(sorted(k for k in s.labels if k != "le")) for s in family.samples}
        families[name] = (family.type, label_sets, family.samples)
    return families


def sample_value(samples: list, name: str, **labels: str) -> float:
    matches = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]
