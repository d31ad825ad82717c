"""The exporter against the documented metric contract: scraped over real HTTP, parsed by prometheus_client."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import pytest
from prometheus_client.exposition import generate_latest

from healthagent.model import Action, Finding, GpuSample, Verdict, XidCount
from healthagent.telemetry.metrics import Telemetry, efa_family_name
from healthagent.training.schema import RendezvousReport, StepReport
from tests.telemetry.harness import start_agent
from tests.telemetry.contract import CONTRACT, EXTRAS, parse, sample_value
from tests.telemetry.snapshots import EFA_COUNTERS, EFA_DEVICES, GPUS, NOW, demo_snapshot, pci, uuid


@pytest.fixture(scope="module")
def scraped():
    """The demo node's snapshot, one collect observation and one training job, scraped over HTTP."""
    agent = start_agent()
    try:
        agent.telemetry.observe_collect("nvml", 0.004)
        agent.telemetry.publish(demo_snapshot())
        agent.intake.apply(StepReport("llama", 0, 64, 10, 4096, 8, 2.0))
        agent.intake.apply(RendezvousReport("llama", 56, "scale_down"))
        reply = agent.scrape()
    finally:
        agent.server.stop()
    assert reply.status == 200
    return parse(reply.text)


@pytest.mark.integration
@pytest.mark.parametrize("name,kind,labels", CONTRACT + EXTRAS, ids=[c[0] for c in CONTRACT + EXTRAS])
def test_every_contract_metric_has_its_type_and_labels(scraped, name, kind, labels):
    full = "healthagent_" + name
    assert full in scraped, f"{full} not exported"
    got_type, label_sets, samples = scraped[full]
    assert got_type == kind
    assert samples, f"{full} has no samples for the demo node"
    assert label_sets == {tuple(sorted(labels))}


@pytest.mark.integration
def test_nothing_outside_the_contract_is_exported(scraped):
    allowed = {"healthagent_" + name for name, _, _ in CONTRACT + EXTRAS}
    created = {n for n in scraped if n.endswith("_created")}  # prometheus_client's histogram clock
    assert set(scraped) - created == allowed
    assert "healthagent_efa_lifespan_total" not in scraped


@pytest.mark.integration
def test_demo_node_values(scraped):
    every_sample = [sample for _, _, samples in scraped.values() for sample in samples]

    def v(name, **labels):
        return sample_value(every_sample, "healthagent_" + name, **labels)

    g3 = {"gpu": "3", "uuid": uuid(3)}
    assert v("gpu_up", gpu="3", uuid=uuid(3), pci_bus_id=pci(3)) == 1
    assert v("gpu_ecc_errors_total", type="uncorrected", scope="aggregate", **g3) == 1
    assert v("gpu_retired_pages", cause="double_bit", **g3) == 2
    assert v("gpu_row_remap_failure", gpu="5", uuid=uuid(5)) == 1
    assert v("gpu_pcie_replay_total", **g3) == 21
    assert v("nvlink_errors_total", type="replay", **g3) == 3
    assert v("gpu_temperature_celsius", **g3) == 43
    assert v("xid_errors_total", xid="79", **g3) == 1
    assert v("xid_errors_total", gpu="", uuid="", xid="48") == 3  # two unknown-GPU tallies, summed
    assert v("sxid_errors_total", pci_bus_id="0000:05:00.0", sxid="12028") == 3
    assert v("efa_rx_drops_total", efa_device="rdmap18s0", port="1") == 2000 + EFA_COUNTERS.index("rx_drops")
    assert v("efa_port_up", efa_device="rdmap18s0", port="1") == 1
    assert v("efa_devices") == EFA_DEVICES
    assert v("efa_devices_expected") == 32
    assert v("gpus_expected") == 8
    assert v("findings", code="GPU_XID", action="monitor") == 2
    assert v("findings", code="GPU_XID", action="replace_node") == 1
    assert v("findings", code="EFA_RX_DROPS", action="monitor") == 1
    assert v("node_taint_applied") == 1
    assert v("budget_holding_taint") == 0
    assert v("budget_blocked_total") == 2
    assert v("kube_writes_total", kind="node", result="conflict") == 1
    assert v("kube_reachable") == 1
    assert v("source_up", source="dcgm") == 0
    assert v("source_errors_total", source="kmsg", kind="parse") == 5
    assert v("last_cycle_timestamp_seconds") == NOW
    assert v("build_info", version="9.9.9") == 1
    assert v("collect_duration_seconds_bucket", source="nvml", le="0.005") == 1


@pytest.mark.integration
def test_node_action_has_all_six_actions_and_one_is_set(scraped):
    samples = scraped["healthagent_node_action"][2]
    assert {s.labels["action"]: s.value for s in samples} == {
        "none": 0, "monitor": 0, "restart_app": 0, "reset_gpu": 0, "reboot_node": 0, "replace_node": 1}


@pytest.mark.integration
def test_throttle_reasons_one_series_per_known_reason(scraped):
    samples = scraped["healthagent_gpu_throttle_reasons"][2]
    gpu2 = {s.labels["reason"]: s.value for s in samples if s.labels["gpu"] == "2"}
    assert gpu2 == {"gpu_idle": 0, "applications_clocks_setting": 0, "sw_power_cap": 1, "hw_slowdown": 0,
                    "sync_boost": 0, "sw_thermal_slowdown": 0, "hw_thermal_slowdown": 1,
                    "hw_power_brake_slowdown": 0, "display_clock_setting": 0}
    assert len(samples) == 9 * GPUS


def test_before_the_first_snapshot_only_self_metrics_render():
    telemetry = Telemetry("1.2.3")
    families = parse(generate_latest(telemetry.registry).decode())
    assert {name for name, (_, _, samples) in families.items() if samples} == {"healthagent_build_info"}
    telemetry.observe_collect("kmsg", 0.0002)
    families = parse(generate_latest(telemetry.registry).decode())
    assert {name for name, (_, _, samples) in families.items() if samples} == {
        "healthagent_build_info", "healthagent_collect_duration_seconds",
        "healthagent_collect_duration_seconds_created"}


def test_publish_swaps_the_snapshot_a_scrape_renders():
    telemetry = Telemetry("1")
    telemetry.publish(demo_snapshot(verdict=Verdict.of((), NOW)))
    first = parse(generate_latest(telemetry.registry).decode())
    assert sample_value(first["healthagent_node_action"][2], "healthagent_node_action", action="none") == 1
    telemetry.publish(demo_snapshot())
    second = parse(generate_latest(telemetry.registry).decode())
    assert sample_value(second["healthagent_node_action"][2], "healthagent_node_action", action="replace_node") == 1


def test_lost_gpu_is_down_and_its_stale_readings_are_not_rendered():
    gpus = demo_snapshot().gpus
    lost = replace(gpus[4], lost=True)
    telemetry = Telemetry("1")
    telemetry.publish(demo_snapshot(gpus=gpus[:4] + (lost,) + gpus[5:]))
    families = parse(generate_latest(telemetry.registry).decode())
    assert sample_value(families["healthagent_gpu_up"][2], "healthagent_gpu_up", gpu="4", uuid=uuid(4),
                  pci_bus_id=pci(4)) == 0
    temps = {s.labels["gpu"] for s in families["healthagent_gpu_temperature_celsius"][2]}
    assert temps == {str(i) for i in range(GPUS)} - {"4"}


def test_unsupported_counters_are_absent_not_zero():
    telemetry = Telemetry("1")
    telemetry.publish(demo_snapshot(gpus=(GpuSample(index=0, uuid="GPU-x", pci_bus_id=pci(0)),)))
    families = parse(generate_latest(telemetry.registry).decode())
    assert families["healthagent_gpu_ecc_errors_total"][2] == []
    assert families["healthagent_gpu_power_watts"][2] == []
    assert len(families["healthagent_gpu_up"][2]) == 1


@pytest.mark.parametrize("raw,family", [
    ("rx_drops", "healthagent_efa_rx_drops_total"),
    ("Weird-Name.v2", "healthagent_efa_weird_name_v2_total"),
    ("already_total", "healthagent_efa_already_total"),
    ("lifespan", None),
    ("---", None),
])
def test_efa_family_names_are_sanitised(raw, family):
    assert efa_family_name(raw) == family


def test_unknown_throttle_reason_and_fallen_off_bus_are_not_dropped():
    gpus = (replace(demo_snapshot().gpus[0], throttle_reasons=("new_reason_2030",)),)
    telemetry = Telemetry("1")
    telemetry.publish(demo_snapshot(gpus=gpus, xid_counts=(
        XidCount(xid=79, count=2, gpu_index=0, uuid=uuid(0), kind="fallen_off_bus"),)))
    families = parse(generate_latest(telemetry.registry).decode())
    throttle = {s.labels["reason"]: s.value for s in families["healthagent_gpu_throttle_reasons"][2]}
    assert throttle["new_reason_2030"] == 1 and len(throttle) == 10
    assert sample_value(families["healthagent_xid_errors_total"][2], "healthagent_xid_errors_total",
                  gpu="0", uuid=uuid(0), xid="79") == 2


def test_series_for_the_demo_node_stay_bounded():
    """docs/reference/metrics.md states the count; a per-pod or per-rank label would blow through this."""
    telemetry = Telemetry("1")
    for source in ("nvml", "efa", "kmsg", "dcgm"):
        telemetry.observe_collect(source, 0.01)
    telemetry.publish(demo_snapshot())
    samples = sum(len(f.samples) for f in telemetry.registry.collect())
    efa = (len(EFA_COUNTERS) - 1) * EFA_DEVICES
    assert efa == 1152
    assert 1400 < samples < 1700


def test_findings_count_open_findings_by_code_and_action():
    findings = tuple(
        Finding(code="EFA_RX_DROPS", action=Action.MONITOR, summary="", evidence="", next_steps="",
                fabric_device=f"rdmap{i}s0", first_seen=NOW) for i in range(3))
    telemetry = Telemetry("1")
    telemetry.publish(demo_snapshot(verdict=Verdict.of(findings, NOW)))
    families = parse(generate_latest(telemetry.registry).decode())
    assert [(s.labels, s.value) for s in families["healthagent_findings"][2]] == [
        ({"code": "EFA_RX_DROPS", "action": "monitor"}, 3.0)]


@pytest.mark.integration
def test_promtool_lints_the_exposition(tmp_path, agent):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus); CI installs it")
    agent.telemetry.observe_collect("nvml", 0.01)
    agent.telemetry.publish(demo_snapshot())
    agent.intake.apply(StepReport("llama", 0, 8, 1, 10, 1, 1.0))
    text = agent.scrape().text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""
