"""NvmlSource through the real nvidia-ml-py bindings against the stub libnvidia-ml.so.1.

Each test runs its scenario in a fresh interpreter (``tests.support.nvml_stub.run_steps``) because
pynvml keeps module-global library state; nothing here replaces pynvml or its ctypes structures.
"""

from __future__ import annotations

import ctypes.util

import pytest

from healthagent.demo import stub_nvml
from tests.support.nvml_stub import lib, run_steps, scenario  # noqa: F401 (lib, scenario: fixtures)

ALL_STUB_FUNCTIONS = [
    "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage", "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetSupportedEventTypes",
]
P5_PCI_BUS_IDS = ["0000:53:00.0", "0000:64:00.0", "0000:75:00.0", "0000:86:00.0",
                  "0000:97:00.0", "0000:a8:00.0", "0000:b9:00.0", "0000:ca:00.0"]


def _gpu(result: dict, index: int) -> dict:
    matches = [g for g in result["gpus"] if g["index"] == index]
    assert len(matches) == 1, result["gpus"]
    return matches[0]


@pytest.mark.integration
def test_reads_every_field_of_the_8_x_h100_scenario(lib, scenario):
    [result] = run_steps(lib, scenario, [{"op": "collect", "now": 1000.0}], {"expected_gpus": 8})
    want = stub_nvml.load_scenario(stub_nvml.DEMO_SCENARIO)
    assert result["health"]["up"] is True
    assert result["health"]["detail"] == "driver 550.127.08; 8 GPUs"
    assert result["health"]["errors"] == {}
    assert [g["index"] for g in result["gpus"]] == list(range(8))
    assert [g["pci_bus_id"] for g in result["gpus"]] == P5_PCI_BUS_IDS
    for gpu, raw in zip(result["gpus"], want["gpus"]):
        assert gpu["uuid"] == raw["uuid"] and gpu["uuid"].startswith("GPU-")
        assert gpu["name"] == "NVIDIA H100 80GB HBM3"
        assert gpu["driver_version"] == "550.127.08"
        assert gpu["source"] == "nvml" and gpu["lost"] is False and gpu["timestamp"] == 1000.0
        assert gpu["ecc"] == {"volatile_corrected": 0, "volatile_uncorrected": 0,
                              "aggregate_corrected": raw["ecc_aggregate_corrected"], "aggregate_uncorrected": 0}
        assert gpu["remap"] == {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
        # Hopper replaced page retirement with row remapping: NVML says NOT_SUPPORTED, we say None.
        assert gpu["retired_pages"] == {"single_bit": None, "double_bit": None, "pending": None}
        assert gpu["throttle_reasons"] == ["gpu_idle"]
        assert gpu["nvlink_errors"] == {"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0}
        assert gpu["pcie_replay"] == 0
        assert gpu["temperature_c"] == float(raw["temperature_c"])
        assert gpu["power_w"] == raw["power_mw"] / 1000.0
    assert result["gpus"][5]["ecc"]["aggregate_corrected"] == 2


@pytest.mark.integration
def test_non_default_values_map_onto_every_field(lib, scenario):
    fields = {
        "ecc_volatile_corrected": 11, "ecc_volatile_uncorrected": 1, "ecc_aggregate_corrected": 40,
        "ecc_aggregate_uncorrected": 3, "remapped_rows_correctable": 2, "remapped_rows_uncorrectable": 1,
        "remap_pending": True, "remap_failure": True, "not_supported": [],
        "retired_pages_single_bit": 4, "retired_pages_double_bit": 2, "retired_pages_pending": True,
        "clocks_event_reasons": 0x4 | 0x40 | 0x80,  # sw power cap, hw thermal, hw power brake
        "nvlink_inactive": [17], "nvlink_replay": [1, 2, 0, 0], "nvlink_recovery": [0, 0, 5],
        "nvlink_crc_flit": [7], "nvlink_crc_data": [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 900],
        "pcie_replay": 12, "temperature_c": 87, "power_mw": 699500,
    }
    steps = [{"op": "set_field", "gpu": 1, "field": f, "value": v} for f, v in fields.items()]
    *_, result = run_steps(lib, scenario, steps + [{"op": "collect"}])
    gpu = _gpu(result, 1)
    assert gpu["ecc"] == {"volatile_corrected": 11, "volatile_uncorrected": 1,
                          "aggregate_corrected": 40, "aggregate_uncorrected": 3}
    assert gpu["remap"] == {"correctable": 2, "uncorrectable": 1, "pending": True, "failure": True}
    assert gpu["retired_pages"] == {"single_bit": 4, "double_bit": 2, "pending": True}
    assert gpu["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown", "hw_power_brake_slowdown"]
    # Link 17 is down, so its 900 CRC data errors are not summed (only active links count).
    assert gpu["nvlink_errors"] == {"replay": 3, "recovery": 5, "crc_flit": 7, "crc_data": 0}
    assert gpu["pcie_replay"] == 12
    assert gpu["temperature_c"] == 87.0
    assert gpu["power_w"] == 699.5
    assert result["health"]["errors"] == {}
    assert _gpu(result, 0)["ecc"]["volatile_corrected"] == 0  # the others are untouched


@pytest.mark.integration
def test_not_supported_fields_are_none_and_not_errors(lib, scenario):
    steps = [{"op": "set_field", "gpu": 0, "field": "not_supported", "value": ALL_STUB_FUNCTIONS},
             {"op": "collect"}]
    _, result = run_steps(lib, scenario, steps)
    gpu = _gpu(result, 0)
    assert gpu["uuid"].startswith("GPU-") and gpu["pci_bus_id"] == "0000:53:00.0" and gpu["lost"] is False
    assert gpu["ecc"] == {"volatile_corrected": None, "volatile_uncorrected": None,
                          "aggregate_corrected": None, "aggregate_uncorrected": None}
    assert gpu["remap"] == {"correctable": None, "uncorrectable": None, "pending": None, "failure": None}
    assert gpu["retired_pages"] == {"single_bit": None, "double_bit": None, "pending": None}
    assert gpu["throttle_reasons"] == []
    assert gpu["nvlink_errors"] == {}
    assert (gpu["pcie_replay"], gpu["temperature_c"], gpu["power_w"]) == (None, None, None)
    assert result["health"]["up"] is True
    assert result["health"]["errors"] == {}


@pytest.mark.integration
def test_a_gpu_without_nvlink_has_no_nvlink_counters(lib, scenario):
    _, result = run_steps(lib, scenario, [{"op": "set_field", "gpu": 2, "field": "nvlink_links", "value": 0},
                                          {"op": "collect"}])
    assert _gpu(result, 2)["nvlink_errors"] == {}
    assert _gpu(result, 3)["nvlink_errors"]["replay"] == 0


@pytest.mark.integration
def test_gpu_lost_between_collects_keeps_its_identity(lib, scenario):
    first, _, second, third, _, fourth = run_steps(lib, scenario, [
        {"op": "collect", "now": 1.0},
        {"op": "set_lost", "gpu": 2},
        {"op": "collect", "now": 2.0},
        {"op": "collect", "now": 3.0},
        {"op": "set_lost", "gpu": 2, "lost": False},
        {"op": "collect", "now": 4.0},
    ])
    before = _gpu(first, 2)
    lost = _gpu(second, 2)
    assert lost["lost"] is True
    assert (lost["uuid"], lost["pci_bus_id"], lost["name"]) == (before["uuid"], "0000:75:00.0", before["name"])
    assert lost["timestamp"] == 2.0
    assert [g["lost"] for g in second["gpus"]] == [False, False, True, False, False, False, False, False]
    assert second["health"]["up"] is True
    assert second["health"]["detail"] == "driver 550.127.08; 8 GPUs; lost: 2"
    assert second["health"]["errors"]["lost"] == 1
    assert _gpu(third, 2)["lost"] is True
    assert third["health"]["errors"]["lost"] == 1  # one episode, counted once
    assert _gpu(fourth, 2)["lost"] is False and _gpu(fourth, 2)["uuid"] == before["uuid"]


@pytest.mark.integration
def test_gpu_lost_before_the_first_read_is_still_reported(lib, scenario):
    stub_nvml.set_gpu_lost(scenario, 6)
    [result] = run_steps(lib, scenario, [{"op": "collect"}])
    lost = _gpu(result, 6)
    assert lost["lost"] is True and lost["uuid"] == "" and lost["pci_bus_id"] == ""
    assert result["health"]["errors"] == {"lost": 1}
    assert len(result["gpus"]) == 8


@pytest.mark.integration
def test_gpu_vanishing_from_the_count_becomes_a_lost_sample(lib, scenario):
    first, removed_uuid, second = run_steps(lib, scenario, [
        {"op": "collect"}, {"op": "remove_gpu", "gpu": 5}, {"op": "collect"},
    ], {"expected_gpus": 8})
    gone = [g for g in second["gpus"] if g["uuid"] == removed_uuid]
    assert len(gone) == 1
    assert gone[0]["lost"] is True
    assert gone[0]["pci_bus_id"] == "0000:a8:00.0" and gone[0]["index"] == 5
    assert gone[0]["uuid"] == _gpu(first, 5)["uuid"]
    assert sum(not g["lost"] for g in second["gpus"]) == 7
    assert second["health"]["errors"]["vanished"] == 1
    assert "lost" not in second["health"]["errors"]  # vanished, not answered GPU_IS_LOST
    assert second["health"]["detail"] == "driver 550.127.08; 7 GPUs; 8 expected; lost: 5"


@pytest.mark.integration
def test_a_gpu_leaving_in_the_middle_of_a_walk_is_named_right(lib, scenario):
    """GPU 3 leaves while the source is reading GPU 5: the walk mixes indexes from before and
    after, so it is read again, and the one GPU judged gone is GPU 3, never one that moved."""
    first, removed_uuid, second = run_steps(lib, scenario, [
        {"op": "collect"}, {"op": "remove_gpu_during_walk", "gpu": 3, "at_index": 5}, {"op": "collect"},
    ], {"expected_gpus": 8})
    assert _gpu(first, 3)["uuid"] == removed_uuid
    lost = [g for g in second["gpus"] if g["lost"]]
    assert [g["uuid"] for g in lost] == [removed_uuid]
    assert second["health"]["errors"]["vanished"] == 1
    assert sorted(g["uuid"] for g in second["gpus"] if not g["lost"]) == sorted(
        g["uuid"] for g in first["gpus"] if g["uuid"] != removed_uuid)


@pytest.mark.integration
def test_counters_changing_between_collects_are_read_fresh(lib, scenario):
    first, *_, second = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "set_field", "gpu": 4, "field": "ecc_aggregate_uncorrected", "value": 2},
        {"op": "set_field", "gpu": 4, "field": "ecc_volatile_corrected", "value": 1500},
        {"op": "set_field", "gpu": 4, "field": "remapped_rows_uncorrectable", "value": 1},
        {"op": "set_field", "gpu": 4, "field": "remap_pending", "value": True},
        {"op": "set_field", "gpu": 4, "field": "pcie_replay", "value": 33},
        {"op": "set_field", "gpu": 4, "field": "nvlink_replay", "value": [0, 0, 0, 9]},
        {"op": "set_field", "gpu": 4, "field": "temperature_c", "value": 91},
        {"op": "collect"},
    ])
    before, after = _gpu(first, 4), _gpu(second, 4)
    assert before["ecc"]["aggregate_uncorrected"] == 0 and after["ecc"]["aggregate_uncorrected"] == 2
    assert after["ecc"]["volatile_corrected"] == 1500
    assert after["remap"] == {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}
    assert (before["pcie_replay"], after["pcie_replay"]) == (0, 33)
    assert after["nvlink_errors"]["replay"] == 9
    assert after["temperature_c"] == 91.0


@pytest.mark.integration
def test_injected_xid_arrives_through_take_events_and_wakes_the_loop(lib, scenario):
    results = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "inject_xid", "gpu": 3, "xid": 94},
        {"op": "wait_events", "count": 1},
        {"op": "take_events"},
    ])
    first, event_id, waited, drained_again = results
    assert event_id == 1
    assert waited["woken"] is True
    [event] = waited["events"]
    assert event["xid"] == 94 and event["kind"] == "xid" and event["source"] == "nvml"
    assert event["gpu_index"] == 3
    assert event["uuid"] == _gpu(first, 3)["uuid"]
    assert event["pci_bus_id"] == "0000:86:00.0"
    assert event["gpu_instance"] is None and event["compute_instance"] is None
    assert "Xid 94" in event["line"]
    assert drained_again == []


@pytest.mark.integration
def test_mig_instance_ids_and_a_burst_arrive_in_order(lib, scenario):
    results = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "inject_xid", "gpu": 7, "xid": 13, "gpu_instance": 3, "compute_instance": 1},
        {"op": "inject_xid", "gpu": 7, "xid": 31},
        {"op": "inject_xid", "gpu": 0, "xid": 79},
        {"op": "wait_events", "count": 3},
    ])
    events = results[-1]["events"]
    assert [(e["gpu_index"], e["xid"]) for e in events] == [(7, 13), (7, 31), (0, 79)]
    assert (events[0]["gpu_instance"], events[0]["compute_instance"]) == (3, 1)
    assert events[1]["gpu_instance"] is None


@pytest.mark.integration
def test_ecc_events_are_not_reported_as_xids(lib, scenario):
    results = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "inject_xid", "gpu": 2, "xid": 0, "event_type": "dbe"},
        {"op": "inject_xid", "gpu": 2, "xid": 48},
        {"op": "wait_events", "count": 1},
    ])
    assert [e["xid"] for e in results[-1]["events"]] == [48]


@pytest.mark.integration
def test_event_thread_survives_a_lost_gpu_and_keeps_reporting_the_others(lib, scenario):
    results = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "wait_event_sets", "count": 1},
        {"op": "set_lost", "gpu": 2},
        {"op": "wait_event_sets", "count": 2},  # the set was rebuilt without the lost GPU
        {"op": "collect"},
        {"op": "inject_xid", "gpu": 4, "xid": 64},
        {"op": "wait_events", "count": 1},
        {"op": "close"},
    ])
    assert results[1] is True and results[3] is True
    assert _gpu(results[4], 2)["lost"] is True
    assert results[4]["health"]["errors"]["event_gpu_lost"] == 1
    [event] = results[6]["events"]
    assert (event["gpu_index"], event["xid"], event["pci_bus_id"]) == (4, 64, "0000:97:00.0")
    assert results[7] == {"thread_alive": False}


@pytest.mark.integration
def test_events_from_before_the_first_collect_are_not_replayed(lib, scenario):
    stub_nvml.inject_xid(scenario, 1, 43)  # already in the file when the event set is created
    results = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "inject_xid", "gpu": 1, "xid": 45},
        {"op": "wait_events", "count": 1},
    ])
    assert results[1] == 2
    assert [e["xid"] for e in results[-1]["events"]] == [45]


@pytest.mark.integration
def test_an_xid_flood_keeps_the_oldest_events_and_counts_the_drops(lib, scenario):
    from healthagent.sources.nvml import EVENT_QUEUE_MAX

    flood = list(range(1, EVENT_QUEUE_MAX + 6))
    _, _, errors, events = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "append_events", "gpu": 6, "xids": flood},
        {"op": "wait_errors", "kind": "events_dropped", "count": 5},
        {"op": "take_events"},
    ])
    assert errors["events_dropped"] == 5
    assert [e["xid"] for e in events] == flood[:EVENT_QUEUE_MAX]  # the first XID names the root cause
    assert {e["gpu_index"] for e in events} == {6}


@pytest.mark.integration
def test_an_on_event_callback_that_raises_is_counted_and_the_event_kept(lib, scenario):
    _, _, waited, errors = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "inject_xid", "gpu": 1, "xid": 119},
        {"op": "wait_events", "count": 1},
        {"op": "wait_errors", "kind": "callback_error", "count": 1},
    ], {"on_event_raises": True})
    assert [e["xid"] for e in waited["events"]] == [119]
    assert errors["callback_error"] == 1


@pytest.mark.parametrize("failures, seconds", [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0), (6, 16.0), (7, 30.0), (50, 30.0)])
def test_event_thread_backoff_doubles_up_to_its_cap(failures, seconds):
    from healthagent.sources.nvml import XidEventThread

    assert XidEventThread._backoff(failures) == seconds


@pytest.mark.integration
def test_missing_library_is_unavailable_not_an_exception(scenario):
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("a real libnvidia-ml is installed here; this test needs a node without one")
    first, second, events, closed = run_steps(None, None, [
        {"op": "collect"}, {"op": "collect"}, {"op": "take_events"}, {"op": "close"},
    ])
    assert first["health"]["up"] is False
    assert first["health"]["detail"].startswith("unavailable: libnvidia-ml.so.1 not found")
    assert first["gpus"] == []
    assert first["health"]["errors"] == {"unavailable": 1}
    assert second["health"]["errors"] == {"unavailable": 1}  # no retry inside the retry interval
    assert events == [] and closed == {"thread_alive": False}


@pytest.mark.integration
def test_driver_not_loaded_then_loaded_recovers_on_retry(lib, tmp_path):
    later = tmp_path / "nvml-scenario.json"  # does not exist yet: a node whose driver is not up
    results = run_steps(lib, later, [
        {"op": "collect"},
        {"op": "write_scenario", "data": stub_nvml.load_scenario(stub_nvml.DEMO_SCENARIO)},
        {"op": "collect"},
    ], {"init_retry_seconds": 0})
    assert results[0]["health"]["up"] is False
    assert results[0]["health"]["detail"].startswith("unavailable: the NVIDIA driver is not loaded")
    assert results[2]["health"]["up"] is True and len(results[2]["gpus"]) == 8
    assert results[2]["health"]["errors"] == {"unavailable": 1}


@pytest.mark.parametrize("garbage", [
    '{"driver_version": "550.127.08", "gpus": [',
    "",
    '{"gpus": [{"uuid": "GPU-1", "name": "x", "pci_bus_id": "00000000:53:00.0", "temperatur_c": 3}]}',
    '{"gpus": []}\n{"gpus": []}',
])
@pytest.mark.integration
def test_malformed_scenario_keeps_the_last_good_one(lib, scenario, garbage):
    good = stub_nvml.load_scenario(scenario)
    good["gpus"][0]["temperature_c"] = 55
    first, _, during, stats, _, after = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "write_text", "text": garbage},
        {"op": "collect"},
        {"op": "stub_stats"},
        {"op": "write_scenario", "data": good},
        {"op": "collect"},
    ])
    assert during["gpus"] == first["gpus"]
    assert during["health"]["up"] is True
    assert stats["rejects"] == 1
    assert "rejected scenario" in stats["last_error"] and "keeping the previous one" in stats["last_error"]
    assert _gpu(after, 0)["temperature_c"] == 55.0  # the next good file is picked up again


def test_the_throttle_reason_bits_are_nvmls():
    """The shared table (model.THROTTLE_REASONS, used by the NVML and dcgm sources) holds NVML's
    own nvmlClocksThrottleReason* values."""
    import pynvml

    from healthagent.model import THROTTLE_REASONS

    names = {"gpu_idle": "GpuIdle", "applications_clocks_setting": "ApplicationsClocksSetting",
             "sw_power_cap": "SwPowerCap", "hw_slowdown": "HwSlowdown", "sync_boost": "SyncBoost",
             "sw_thermal_slowdown": "SwThermalSlowdown", "hw_thermal_slowdown": "HwThermalSlowdown",
             "hw_power_brake_slowdown": "HwPowerBrakeSlowdown", "display_clock_setting": "DisplayClockSetting"}
    assert {name for name, _ in THROTTLE_REASONS} == set(names)
    for name, bit in THROTTLE_REASONS:
        assert getattr(pynvml, f"nvmlClocksThrottleReason{names[name]}") == bit, name


@pytest.mark.integration
def test_a_gpu_nvml_counts_but_will_not_open_is_unobserved_not_dropped(lib, scenario):
    """NO_PERMISSION on a GPU's handle (a device cgroup that leaves one GPU out): NVML still counts
    it, so it is named unobserved, and the policy neither calls it missing nor the node healthy."""
    from healthagent.model import SourceHealth
    from tests.support.policy import classifier, codes, collect, gpus, verdict_of

    (result,) = run_steps(lib, scenario, [{"op": "deny_handle", "gpu": 3}, {"op": "collect"}])[1:]
    assert result["health"]["up"] is True and result["health"]["unobserved"] == ["GPU 3"]
    assert sorted(g["index"] for g in result["gpus"]) == [0, 1, 2, 4, 5, 6, 7]
    seen = tuple(g for g in gpus() if g.index != 3)
    health = SourceHealth(source="nvml", up=True, unobserved=tuple(result["health"]["unobserved"]))
    verdict = verdict_of(classifier(), collect(1.0, gpus=seen, health=(health,), expected_gpus=8))
    assert "GPU_MISSING" not in codes(verdict) and "gpu" in verdict.unobserved
    assert verdict.action.value == "none"
