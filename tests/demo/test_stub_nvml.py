"""The stub libnvidia-ml.so.1 and its Python helpers: build, load, ABI as pynvml sees it, the
scenario reader's strictness and robustness, thread safety, and the scenario mutation helpers."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest

from healthagent.demo import stub_nvml
from healthagent.demo.stub_setup import default_cache_dir
from tests.support.nvml_stub import lib, run_steps, sanitizer_harness, scenario  # noqa: F401 (lib, scenario: fixtures)

REPO_ROOT = Path(__file__).resolve().parents[2]
HARNESS = REPO_ROOT / "tests" / "fixtures" / "nvml" / "asan_harness.c"
RECORDER = REPO_ROOT / "tests" / "fixtures" / "nvml" / "record_nvml.py"
GOOD_GPU = '{"uuid": "GPU-1", "name": "x", "pci_bus_id": "00000000:53:00.0"%s}'


# -- build and load ----------------------------------------------------------------------------------

@pytest.mark.integration
def test_build_is_cached_by_source_hash(tmp_path, lib):
    first = stub_nvml.build_stub(tmp_path)
    mtime = first.stat().st_mtime_ns
    again = stub_nvml.build_stub(tmp_path)
    assert again == first and again.stat().st_mtime_ns == mtime
    assert first.name == "libnvidia-ml.so.1"
    assert [p.name for p in first.parent.iterdir()] == ["libnvidia-ml.so.1"]  # no temp files left


def test_build_without_cc_names_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(stub_nvml.StubBuildError, match=r"^cc not found: install a C compiler"):
        stub_nvml.build_stub(tmp_path / "cache")


@pytest.mark.integration
def test_pynvml_loads_the_preloaded_stub_through_its_own_loader_and_real_structs(lib, scenario):
    stub_nvml.set_gpu_field(scenario, 1, "not_supported", [])
    stub_nvml.set_gpu_field(scenario, 1, "retired_pages_single_bit", 3)
    stub_nvml.set_gpu_field(scenario, 1, "name", "NVIDIA H100 80GB HBM3 \u00e9")
    soname_is_stub, results = run_steps(lib, scenario, [{"op": "soname_is_stub"}, {"op": "pynvml", "calls": [
        ["nvmlInit"],
        ["nvmlSystemGetDriverVersion"],
        ["nvmlDeviceGetCount"],
        ["nvmlDeviceGetPciInfo", "@5"],
        ["nvmlDeviceGetHandleByIndex", 8],
        ["nvmlDeviceGetRetiredPages", "@0", 0],
        ["nvmlDeviceGetRetiredPages", "@1", 0],
        ["nvmlDeviceGetRetiredPagesPendingStatus", "@1"],
        ["nvmlDeviceGetName", "@1"],
        ["nvmlDeviceGetNvLinkState", "@0", 17],
        ["nvmlDeviceGetNvLinkState", "@0", 18],
        ["nvmlDeviceGetNvLinkErrorCounter", "@0", 0, 9],
        ["nvmlDeviceGetTemperature", "@0", 0],
        ["nvmlDeviceGetPowerUsage", "@0"],
        ["nvmlDeviceGetSupportedEventTypes", "@0"],
        ["nvmlDeviceGetMigMode", "@0"],
        ["nvmlDeviceGetCurrentClocksThrottleReasons", "@0"],
        ["nvmlErrorString", 15],
        ["nvmlShutdown"],
        ["nvmlDeviceGetCount"],
    ]}])
    assert results == [
        {"ok": None},
        {"ok": "550.127.08"},
        {"ok": 8},
        {"ok": {"busIdLegacy": "0000:A8:00.0", "domain": 0, "bus": 0xA8, "device": 0,
                "pciDeviceId": 0x233010DE, "pciSubSystemId": 0x16C110DE, "busId": "00000000:A8:00.0"}},
        {"error": 2},  # NVML_ERROR_INVALID_ARGUMENT: no ninth GPU
        {"error": 3},  # NOT_SUPPORTED on an H100
        {"ok": [0x1000000, 0x1001000, 0x1002000]},
        {"ok": 0},
        {"ok": "NVIDIA H100 80GB HBM3 \u00e9"},
        {"ok": 1},
        {"error": 2},  # an H100 has links 0..17
        {"error": 2},  # no such counter
        {"ok": 33},
        {"ok": 71254},
        {"ok": 31},
        {"ok": [0, 0]},
        {"ok": 1},
        {"ok": "GPU is lost"},
        {"ok": None},
        {"error": 1},  # UNINITIALIZED after the last shutdown
    ]
    assert soname_is_stub is True  # dlopen("libnvidia-ml.so.1"), as pynvml's loader does, finds the stub


@pytest.mark.integration
def test_preloading_twice_keeps_the_first_stub(lib, scenario, tmp_path):
    second_copy = stub_nvml.build_stub(tmp_path / "another-cache")
    assert second_copy != lib
    same, [init, count] = run_steps(lib, scenario, [
        {"op": "preload_again", "lib": str(second_copy)},
        {"op": "pynvml", "calls": [["nvmlInit"], ["nvmlDeviceGetCount"]]},
    ])
    assert same is True
    assert (init, count) == ({"ok": None}, {"ok": 8})


@pytest.mark.integration
def test_every_documented_gpu_field_is_accepted_by_the_stub(lib, scenario):
    data = stub_nvml.load_scenario(scenario)
    values = {"lost": False, "not_supported": ["nvmlDeviceGetMigMode"], "remap_pending": True,
              "remap_failure": False, "retired_pages_pending": True, "nvlink_inactive": [3],
              "nvlink_replay": [1], "nvlink_recovery": [1], "nvlink_crc_flit": [1], "nvlink_crc_data": [1],
              "nvlink_ecc_data": [1], "nvlink_links": 18, "mig_mode": 1, "temperature_c": 40}
    gpu = data["gpus"][0]
    for field in stub_nvml.GPU_FIELDS - set(gpu):
        gpu[field] = values.get(field, 1)
    assert set(gpu) == stub_nvml.GPU_FIELDS
    _, _, stats = run_steps(lib, scenario, [{"op": "pynvml", "calls": [["nvmlInit"]]},
                                            {"op": "write_scenario", "data": data}, {"op": "stub_stats"}])
    assert (stats["loads"], stats["rejects"]) == (2, 0), stats["last_error"]


@pytest.mark.integration
def test_recording_the_stub_reproduces_its_scenario(lib, scenario):
    """The recorder meant for a real H100 (tests/fixtures/nvml/record_nvml.py), pointed at the stub,
    must write back the scenario the stub serves: both sides speak the same format and codes."""
    import os
    import sys

    env = dict(os.environ, HEALTHAGENT_STUB_NVML_SCENARIO=str(scenario))
    proc = subprocess.run([sys.executable, str(RECORDER), "--preload", str(lib)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    recording = json.loads(proc.stdout)
    want = stub_nvml.load_scenario(stub_nvml.DEMO_SCENARIO)
    assert recording["scenario"] == {"driver_version": want["driver_version"], "events": [],
                                     "gpus": [dict(g, mig_mode=0) for g in want["gpus"]]}
    # NVLink state answers INVALID_ARGUMENT past an H100's 18 links; retired pages NOT_SUPPORTED.
    assert recording["codes"]["0"] == {"nvmlDeviceGetRetiredPages": 3, "nvmlDeviceGetRetiredPagesPendingStatus": 3,
                                       "nvmlDeviceGetNvLinkState[18]": 2}


# -- the scenario reader rejects bad files, names the problem, keeps the last good one --------------

MALFORMED = [
    ('{"gpus": [}', "JSON error at byte 10"),
    ('{"gpus": [],}', "expected a member name"),
    ('{"gpus": []} x', "trailing characters"),
    ('{"gpus": [], "gpus": []}', "duplicate member name"),
    ("", "unexpected end of input"),
    ("[]", "the scenario must be a JSON object"),
    ("{}", "gpus: required"),
    ('{"gpus": "eight"}', "gpus: expected an array"),
    ('{"gpus": [], "colour": 1}', "colour: unknown top-level key"),
    ('{"gpus": [], "driver_version": NaN}', "bad number"),
    ('{"gpus": [], "driver_version": "%s"}' % ("9" * 80), "driver_version: longer than 79 bytes"),
    ('{"gpus": [{"uuid": "GPU-1"}]}', "uuid, name and pci_bus_id are required"),
    ('{"gpus": [%s]}' % (GOOD_GPU % "").replace("00000000:53:00.0", "0000:53:00"), "expected a PCI bus id"),
    ('{"gpus": [%s]}' % (GOOD_GPU % "").replace("00000000:53:00.0", " 0x53:00:00.0"), "expected a PCI bus id"),
    ('{"gpus": [%s]}' % (GOOD_GPU % ', "temperature_c": -1'), "gpus[0].temperature_c: expected an integer"),
    ('{"gpus": [%s]}' % (GOOD_GPU % ', "temperature_c": 3.5'), "gpus[0].temperature_c: expected an integer"),
    ('{"gpus": [%s]}' % (GOOD_GPU % ', "temperature_c": 07'), "leading zero"),
    ('{"gpus": [%s]}' % (GOOD_GPU % ', "ecc_aggregate_uncorrected": 18446744073709551616'), "expected an integer"),
    ('{"gpus": [%s]}' % (GOOD_GPU % ', "lost": "yes"'), "gpus[0].lost: expected true or false"),
    ('{"gpus": [%s]}' % (GOOD_GPU % ', "not_supported": ["nvmlDeviceGetFanSpeed"]'), "not an NVML function"),
    ('{"gpus": [%s]}' % (GOOD_GPU % ', "temperatur_c": 3'), "gpus[0].temperatur_c: unknown key"),
    ('{"gpus": [%s]}' % (GOOD_GPU % ', "nvlink_links": 2, "nvlink_replay": [0, 0, 0]'), "3 entries but nvlink_links is 2"),
    ('{"gpus": [%s, %s]}' % (GOOD_GPU % "", GOOD_GPU % ""), "gpus[1].uuid: same as gpus[0]"),
    ('{"gpus": [%s]}' % ", ".join((GOOD_GPU % "").replace("GPU-1", f"GPU-{i}") for i in range(65)), "at most 64 GPUs"),
    ('{"gpus": [], "events": [{"gpu": 0, "data": 94}]}', "id, gpu and data are required"),
    ('{"gpus": [], "events": [{"id": 0, "gpu": 0, "data": 94}]}', "events[0].id: must be positive"),
    ('{"gpus": [], "events": [{"id": 4, "gpu": 0, "data": 1}, {"id": 4, "gpu": 1, "data": 2}]}', "id 4 appears twice"),
    ('{"gpus": [], "events": [{"id": 1, "gpu": 0, "data": 1, "type": "ecc"}]}', 'expected "xid"'),
    ('{"gpus": [], "driver_version": "a\\u0000b"}', "\\u0000 is not allowed"),
    ('{"gpus": [], "driver_version": "\\ud800"}', "unpaired surrogate"),
    ('{"gpus": [], "driver_version": "a\\qb"}', "unknown escape"),
    ('{"gpus": [], "driver_version": "a\tb"}', "control character in string"),
    ('{"gpus": [], "driver_version": "a\xc3\x28b"}', "invalid UTF-8 in string"),
    ('{"gpus": [], "_deep": %s}' % ("[" * 40 + "]" * 40), "nested too deeply"),
]


@pytest.mark.integration
def test_malformed_scenarios_are_rejected_with_a_reason_and_the_last_good_one_stays(lib, scenario):
    steps: list[dict] = [{"op": "pynvml", "calls": [["nvmlInit"]]}]
    for text, _ in MALFORMED:
        steps += [{"op": "write_text", "text": text, "encoding": "latin-1"}, {"op": "stub_stats"}]
    steps.append({"op": "pynvml", "calls": [["nvmlDeviceGetCount"], ["nvmlDeviceGetTemperature", "@7", 0]]})
    results = run_steps(lib, scenario, steps)
    stats = results[2:-1:2]
    for n, ((text, reason), stat) in enumerate(zip(MALFORMED, stats), start=1):
        assert stat["rejects"] == n, (text, stat)
        assert reason in stat["last_error"], (text, stat["last_error"])
        assert stat["loads"] == 1
    assert results[-1] == [{"ok": 8}, {"ok": 33}]


@pytest.mark.integration
def test_one_write_is_one_reload_even_when_a_look_races_the_rename(lib, scenario):
    """A rename moves the file's ctime after its new name already resolves: a stub that counted
    the ctime as a change loaded (or rejected) one write twice when a look raced the rename."""
    _, result = run_steps(lib, scenario, [{"op": "pynvml", "calls": [["nvmlInit"]]},
                                          {"op": "racing_rewrites", "writes": 300}])
    assert result == {"rejects": 300, "loads": 0}


@pytest.mark.integration
def test_unicode_escapes_are_decoded(lib, scenario):
    text = scenario.read_text().replace('"550.127.08"', '"550\\u002e127\\/08 \\ud83d\\ude80"')
    _, [_, version] = run_steps(lib, scenario, [
        {"op": "write_text", "text": text},
        {"op": "pynvml", "calls": [["nvmlInit"], ["nvmlSystemGetDriverVersion"]]},
    ])
    assert version == {"ok": "550.127/08 \U0001F680"}


@pytest.mark.integration
def test_every_truncation_and_random_mutation_is_loaded_or_rejected_never_a_crash(lib, scenario):
    [_, result] = run_steps(lib, scenario, [{"op": "pynvml", "calls": [["nvmlInit"]]},
                                            {"op": "fuzz", "seed": 2024, "prefixes": True, "mutations": 1500}])
    size = len(scenario.read_bytes())
    assert result["fed"] == size + 1500
    assert result["unaccounted"] == 0
    assert result["loads"] + result["rejects"] == result["fed"]
    assert result["rejects"] >= size - 1  # every prefix but the one missing only the final newline
    assert result["count_after_restore"] == 8


@pytest.mark.integration
def test_scenario_reader_is_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path, lib):
    try:
        harness = sanitizer_harness(HARNESS, default_cache_dir())
    except stub_nvml.StubBuildError as exc:
        pytest.skip(f"cc cannot build with -fsanitize=address,undefined here: {exc}")
    work = tmp_path / "work.json"
    run = subprocess.run([str(harness), str(work), str(stub_nvml.DEMO_SCENARIO), "1500", "7"],
                         env={"HEALTHAGENT_STUB_NVML_SCENARIO": str(work), "ASAN_OPTIONS": "detect_leaks=1"},
                         capture_output=True, text=True, errors="replace", timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.startswith("ok fed=")
    assert "runtime error" not in run.stderr and "AddressSanitizer" not in run.stderr


@pytest.mark.integration
def test_readers_see_whole_scenarios_while_the_file_is_rewritten(lib, scenario):
    _, result = run_steps(lib, scenario, [
        {"op": "pynvml", "calls": [["nvmlInit"]]},
        {"op": "concurrent_reads", "gpu": 0, "values": [40, 60], "writes": 200, "readers": 4},
    ])
    assert result["errors"] == []
    assert set(result["seen"]) <= {33, 40, 60}  # never a torn or half-parsed value
    assert set(result["seen"]) & {40, 60}


# -- the mutation helpers -------------------------------------------------------------------------

def test_write_scenario_is_atomic_and_moves_mtime_forward(tmp_path):
    path = tmp_path / "s.json"
    stamps = []
    for n in range(5):
        stub_nvml.write_scenario(path, {"gpus": [], "n": n})
        stamps.append(path.stat().st_mtime_ns)
    assert stamps == sorted(set(stamps))  # strictly increasing even within one timer tick
    assert stub_nvml.load_scenario(path) == {"gpus": [], "n": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


def test_inject_xid_appends_numbered_events(scenario):
    assert stub_nvml.inject_xid(scenario, 3, 94) == 1
    assert stub_nvml.inject_xid(scenario, 5, 13, gpu_instance=2, compute_instance=0) == 2
    assert stub_nvml.inject_xid(scenario, 5, 0, event_type="dbe") == 3
    assert stub_nvml.load_scenario(scenario)["events"] == [
        {"id": 1, "gpu": 3, "type": "xid", "data": 94},
        {"id": 2, "gpu": 5, "type": "xid", "data": 13, "gpu_instance": 2, "compute_instance": 0},
        {"id": 3, "gpu": 5, "type": "dbe", "data": 0},
    ]


@pytest.mark.parametrize("call, error", [
    (lambda p: stub_nvml.inject_xid(p, 8, 94), IndexError),
    (lambda p: stub_nvml.inject_xid(p, 0, 94, event_type="ecc"), ValueError),
    (lambda p: stub_nvml.set_gpu_field(p, 0, "temperatur_c", 3), ValueError),
    (lambda p: stub_nvml.set_gpu_lost(p, -1), IndexError),
    (lambda p: stub_nvml.remove_gpu(p, 8), IndexError),
])
def test_helpers_reject_bad_arguments_without_touching_the_file(scenario, call, error):
    before = scenario.read_bytes()
    with pytest.raises(error):
        call(scenario)
    assert scenario.read_bytes() == before


def test_remove_gpu_reindexes_the_gpus_and_their_events(scenario):
    uuids = [g["uuid"] for g in stub_nvml.load_scenario(scenario)["gpus"]]
    stub_nvml.inject_xid(scenario, 1, 31)
    stub_nvml.inject_xid(scenario, 2, 79)
    stub_nvml.inject_xid(scenario, 6, 48)
    removed = stub_nvml.remove_gpu(scenario, 2)
    data = stub_nvml.load_scenario(scenario)
    assert removed["uuid"] == uuids[2]
    assert [g["uuid"] for g in data["gpus"]] == uuids[:2] + uuids[3:]
    assert [(e["id"], e["gpu"], e["data"]) for e in data["events"]] == [(1, 1, 31), (3, 5, 48)]


def test_set_gpu_lost_and_fields(scenario):
    stub_nvml.set_gpu_lost(scenario, 4)
    stub_nvml.set_gpu_field(scenario, 4, "ecc_aggregate_uncorrected", 7)
    gpu = stub_nvml.load_scenario(scenario)["gpus"][4]
    assert (gpu["lost"], gpu["ecc_aggregate_uncorrected"]) == (True, 7)
    stub_nvml.set_gpu_lost(scenario, 4, lost=False)
    assert stub_nvml.load_scenario(scenario)["gpus"][4]["lost"] is False


def test_concurrent_injections_lose_nothing(scenario):
    def inject(gpu: int) -> None:
        for _ in range(25):
            stub_nvml.inject_xid(scenario, gpu, 94)

    threads = [threading.Thread(target=inject, args=(g,)) for g in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    events = stub_nvml.load_scenario(scenario)["events"]
    assert sorted(e["id"] for e in events) == list(range(1, 51))
    assert sorted(e["gpu"] for e in events) == [0] * 25 + [1] * 25


def test_demo_scenario_is_a_p5_48xlarge():
    data = stub_nvml.load_scenario(stub_nvml.DEMO_SCENARIO)
    assert [g["pci_bus_id"] for g in data["gpus"]] == [
        f"00000000:{bus}:00.0" for bus in ("53", "64", "75", "86", "97", "A8", "B9", "CA")]
    assert {g["name"] for g in data["gpus"]} == {"NVIDIA H100 80GB HBM3"}
    assert len({g["uuid"] for g in data["gpus"]}) == 8
    assert all(g["nvlink_links"] == 18 for g in data["gpus"])
    assert all(30 <= g["temperature_c"] <= 40 and 60_000 <= g["power_mw"] <= 120_000 for g in data["gpus"])
    assert data["events"] == []

