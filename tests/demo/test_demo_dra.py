"""``healthagent demo --dra``: XID 48 on GPU 3 of eight is quarantined by one DeviceTaintRule
(dry-run, said, not written) while the node gets no taint, and a GPU reset seen through NVML
removes the rule; checked from what the demo prints (read back from the running agent and its
/metrics) and from the dry-run writes it logs. The slices are NVIDIA's DRA driver's shape."""

from __future__ import annotations

import json
import re

import pytest

from healthagent.demo.dra_script import demo_slice
from healthagent.dra.slices import device_map
from tests.demo.test_demo_command import run_demo

pytestmark = pytest.mark.integration
RULE = "demo-p5-node.gpu-3.healthagent"


def test_one_gpu_is_quarantined_alone_and_the_reset_lifts_it():
    done = run_demo("--dra")
    assert done.returncode == 0, done.stdout + done.stderr
    out, log = done.stdout, done.stderr
    assert "gpu.nvidia.com/demo-p5-node/gpu-3  GPU-" in out and "0000:86:00.0" in out
    assert "[GPU_XID] GPU 3 0000:86:00.0: reset_gpu" in out
    creates = re.findall(r"would create DeviceTaintRule (\S+) (\{.*\})", log)
    assert [name for name, _ in creates] == [RULE]  # one rule, for that one GPU
    spec = json.loads(creates[0][1])
    assert spec["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": "demo-p5-node", "device": "gpu-3"}
    assert spec["taint"]["effect"] == "NoSchedule"  # at once; NoExecute after the grace, with a budget slot
    changes = [json.loads(spec)["taint"]["effect"] for spec in re.findall(
        rf"would change DeviceTaintRule {re.escape(RULE)} (\{{.*\}})", log)]
    assert changes[-1] == "NoExecute"
    assert log.index("would set annotation healthagent.io/device-noexecute=gpu-3") < log.rindex(
        "would change DeviceTaintRule")  # the Node shows the eviction before it happens
    assert f"DeviceTaintRule {RULE}: device gpu.nvidia.com/demo-p5-node/gpu-3" in out
    assert "NoExecute now: the pods using GPU 3 are evicted" in out
    assert "Node taint: none: the node stays in the job" in out
    assert "write=taint" not in log  # the Node got no taint, dry-run or not
    assert 'healthagent_gpu_quarantined{device="gpu.nvidia.com/demo-p5-node/gpu-3"' in out
    assert "reset seen through NVML in" in out and "DeviceTaintRule removed; verdict = none" in out
    assert f"would delete DeviceTaintRule {RULE}" in log
    assert "would remove annotation healthagent.io/device-noexecute" in log
    assert "no healthagent_gpu_quarantined series now" in out


def test_the_demo_slice_maps_every_gpu_as_the_driver_names_it():
    uuids = [f"GPU-{i:08x}-aaaa-bbbb-cccc-dddddddddddd" for i in range(8)]
    pcis = [f"0000:{bus:02x}:00.0" for bus in (0x53, 0x64, 0x75, 0x86, 0x97, 0xa8, 0xb9, 0xca)]
    devices = device_map([demo_slice("n1", uuids, pcis)], "n1")
    assert [d.device for d in devices.devices] == [f"gpu-{i}" for i in range(8)] and devices.skipped == 0
    assert devices.find(uuids[3], pcis[3]).path == "gpu.nvidia.com/n1/gpu-3"


@pytest.mark.parametrize("extra", [("--fabric", "ib"), ("--xid", "94")])
def test_dra_refuses_what_it_does_not_show(extra):
    done = run_demo("--dra", *extra)
    assert done.returncode == 3 and "--dra" in done.stderr
