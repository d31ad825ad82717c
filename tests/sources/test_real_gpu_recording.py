"""The stub NVML library against what a real GPU answered.

``tests/fixtures/nvml/h200-recording.json`` is ``record_nvml.py`` run on one NVIDIA H200 (driver
580.159.04, VBIOS 96.00.A5.00.1A, in PCI pass-through to a VM with no NVLink peers), and
``h200-check.json`` is ``healthagent check --json`` on the same machine a moment earlier. Every
other NVML test runs on the stub, so these tests are what ties the stub's answers (return codes
included) and the reader's interpretation of them to a real driver:

- the stub, fed the recorded scenario, records back the same values and the same error codes
  (``nvmlDeviceGetRetiredPages*`` NOT_SUPPORTED on Hopper, which retires memory by row remapping;
  ``nvmlDeviceGetNvLinkState`` NOT_SUPPORTED at link 0 on a GPU without NVLink);
- ``healthagent check --json`` on the stub reports the GPU exactly as it did on the real one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from healthagent.demo.stub_setup import stub_nvml_env
from tests.support.nvml_stub import lib  # noqa: F401 (fixture)

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "nvml"
RECORDER = FIXTURES / "record_nvml.py"
REAL_RECORDING = json.loads((FIXTURES / "h200-recording.json").read_text())
REAL_CHECK = json.loads((FIXTURES / "h200-check.json").read_text())
# What moves between two reads of an idle GPU, or is the time of the read.
VARYING = ("timestamp", "power_w")


@pytest.fixture
def h200_scenario(tmp_path) -> Path:
    path = tmp_path / "h200-scenario.json"
    path.write_text(json.dumps(REAL_RECORDING["scenario"]))
    return path


def test_the_recording_is_of_a_healthy_h200_without_nvlink():
    """Guards the fixture itself: the tests below mean something only for what it holds."""
    (gpu,) = REAL_RECORDING["scenario"]["gpus"]
    assert gpu["name"] == "NVIDIA H200" and gpu["pci_device_id"] == 0x233510DE  # device 0x2335, vendor 0x10de
    assert gpu["nvlink_links"] == 0 and REAL_RECORDING["codes"]["0"]["nvmlDeviceGetNvLinkState[0]"] == 3
    assert REAL_CHECK["verdict"] == "none" and REAL_CHECK["findings"] == [] and REAL_CHECK["unobserved"] == []


@pytest.mark.integration
def test_the_stub_fed_the_recording_answers_as_the_real_driver_did(lib, h200_scenario):  # noqa: F811
    env = stub_nvml_env(h200_scenario, cache_dir=lib.parent.parent)
    proc = subprocess.run([sys.executable, str(RECORDER), "--preload", str(lib)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == REAL_RECORDING


@pytest.mark.integration
def test_check_on_the_stub_reports_the_gpu_as_it_did_on_the_real_one(lib, h200_scenario, tmp_path):  # noqa: F811
    host = tmp_path / "host"
    (host / "sys" / "class").mkdir(parents=True)
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text("")
    env = stub_nvml_env(h200_scenario, cache_dir=lib.parent.parent)
    proc = subprocess.run([sys.executable, "-m", "healthagent", "check", "--json", "--host-root", str(host),
                           "--kernel-log", str(kernel_log)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    (real,) = REAL_CHECK["gpus"]
    (seen,) = report["gpus"]
    assert {k: v for k, v in seen.items() if k not in VARYING} == {k: v for k, v in real.items() if k not in VARYING}
    (gpu,) = REAL_RECORDING["scenario"]["gpus"]
    assert seen["power_w"] == gpu["power_mw"] / 1000
    nvml = next(s for s in report["sources"] if s["source"] == "nvml")
    assert nvml == next(s for s in REAL_CHECK["sources"] if s["source"] == "nvml")
    assert (report["verdict"], report["findings"], report["unobserved"]) == ("none", [], [])
