"""The bundled demo node: its shape, and that its fault injections read back through the real
sources (``EfaSource``, the kernel-log parser ``kmsg.iter_events`` and ``KmsgSource``)."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

import pytest

from healthagent.demo import DEMO_GPUS, stub_nvml
from healthagent.demo.node import P5_EFA_BUSES, XID_MESSAGES, build_demo_root
from healthagent.model import canonical_pci_bus_id
from healthagent.sources.efa import EfaSource
from healthagent.sources.kernel_log.source import KmsgSource
from healthagent.sources.kernel_log.offline import iter_events
from tests.support.efa_reference import efa_counter_facts

KMSG_RECORD = re.compile(r"^(?P<pri>\d+),(?P<seq>\d+),(?P<usec>\d+),(?P<flags>[-c+]);(?P<text>.*)$")
KMSG_FIELD = re.compile(r"^ [A-Z_]+=\S+$")


@pytest.fixture
def node(tmp_path):
    """A fresh node for tests that change it."""
    return build_demo_root(tmp_path / "host")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One node shared by the tests that only read it (a build writes ~1,400 files)."""
    return build_demo_root(tmp_path_factory.mktemp("demo") / "host")


def reference() -> dict[str, str]:
    """counter -> fault relevance column of the driver reference."""
    return {name: fact.relevance for name, fact in efa_counter_facts().items()}


def records(path: Path) -> list[dict]:
    """The kmsg records of a file, checking that every line is a record or a dictionary line."""
    out = []
    for line in path.read_text().splitlines():
        match = KMSG_RECORD.match(line)
        if match:
            out.append({k: (int(v) if k in ("pri", "seq", "usec") else v) for k, v in match.groupdict().items()})
        else:
            assert KMSG_FIELD.match(line), f"not a /dev/kmsg line: {line!r}"
    return out


def events(node):
    with open(node.kernel_log, encoding="utf-8") as fh:
        return list(iter_events(fh, time.time(), host_root=str(node.root)))


# -- shape ---------------------------------------------------------------------------------------

def test_shape_of_a_p5_host_root(built):
    root = built.root
    assert built.root.is_dir()
    assert built.kernel_log == root / "dev" / "kmsg" and built.kernel_log.is_file()
    assert built.scenario == root / "nvml-scenario.json"
    assert uuid.UUID((root / "proc/sys/kernel/random/boot_id").read_text().strip())
    assert len(built.efa_devices) == 32
    assert built.efa_devices[:4] == ["rdmap79s0", "rdmap80s0", "rdmap81s0", "rdmap82s0"]
    assert built.efa_devices[-1] == "rdmap201s0"
    assert sorted(os.listdir(root / "sys/class/infiniband")) == sorted(built.efa_devices)
    for name in built.efa_devices:
        link = root / "sys/class/infiniband" / name
        assert not os.path.isabs(os.readlink(link))
        assert not os.path.isabs(os.readlink(link.resolve() / "device"))


def test_gpus_come_from_the_stub_scenario(built):
    bundled = stub_nvml.load_scenario(stub_nvml.DEMO_SCENARIO)
    copied = json.loads(built.scenario.read_text())
    assert copied["gpus"] == bundled["gpus"]
    assert built.gpu_pci_bus_ids == [canonical_pci_bus_id(g["pci_bus_id"]) for g in bundled["gpus"]]
    assert len(built.gpu_pci_bus_ids) == 8 == DEMO_GPUS  # what `demo --gpu` accepts: 0 to 7
    assert built.gpu_pci_bus_ids[0] == "0000:53:00.0"
    assert built.gpu_uuids == [g["uuid"] for g in bundled["gpus"]]


def test_efa_source_reads_32_healthy_devices(built):
    result = EfaSource(str(built.root)).collect(time.time())
    assert result.health.up is True and result.health.errors == {}
    assert [s.device for s in result.efa] == built.efa_devices
    assert [s.pci_bus_id for s in result.efa] == [f"0000:{bus:02x}:00.0" for bus in P5_EFA_BUSES]
    relevance = reference()
    for sample in result.efa:
        assert (sample.port, sample.port_state, sample.phys_state) == (1, "4: ACTIVE", "5: LinkUp")
        assert set(sample.counters) == set(relevance) - {"lifespan"}
        for counter, value in sample.counters.items():
            why = relevance[counter]
            if why.startswith("volume only"):
                assert value > 0, (sample.device, counter)
            elif why.startswith(("FAULT", "APP/CONFIG", "DEGRADATION")):
                assert value == 0, (sample.device, counter)
        assert sample.counters["completed_cmds"] == sample.counters["submitted_cmds"]
        assert sample.counters["keep_alive_rcvd"] > 0


def test_lifespan_is_present_but_not_a_counter(built):
    device = (built.root / "sys/class/infiniband/rdmap79s0").resolve()
    assert (device / "hw_counters/lifespan").read_text() == "10\n"
    assert (device / "ports/1/hw_counters/lifespan").read_text() == "10\n"


def test_kernel_log_is_an_ordinary_boot(built):
    recs = records(built.kernel_log)
    assert 40 <= len(recs) <= 120
    assert [r["seq"] for r in recs] == list(range(len(recs)))
    assert [r["usec"] for r in recs] == sorted(r["usec"] for r in recs)
    texts = [r["text"] for r in recs]
    driver = stub_nvml.load_scenario(stub_nvml.DEMO_SCENARIO)["driver_version"]
    assert any(t.startswith(f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module  {driver} ") for t in texts)
    assert any(t.startswith("nvidia-uvm: Loaded the UVM driver") for t in texts)
    for pci in built.gpu_pci_bus_ids:
        assert f"pci {pci}: [10de:2330] type 00 class 0x030200" in texts
    assert not any("Xid" in t for t in texts)
    assert events(built) == []


def test_proc_times_agree(built):
    uptime = float((built.root / "proc/uptime").read_text().split()[0])
    assert uptime == pytest.approx(built.uptime_at_build, abs=0.01)
    btime = int(re.search(r"^btime (\d+)$", (built.root / "proc/stat").read_text(), re.M).group(1))
    assert abs(btime - (built.built_at - built.uptime_at_build)) <= 1
    last_usec = records(built.kernel_log)[-1]["usec"]
    assert last_usec < uptime * 1_000_000


# -- inject_xid ----------------------------------------------------------------------------------

# Each on another GPU, so every case also shows the driver's first-XID "GPU at PCI" line.
INJECTIONS = [(3, 94), (0, 79), (7, 48), (5, 95), (2, 13), (1, 63), (6, 119), (4, 999)]


def test_injected_xids_are_real_kmsg_records(node):
    """Table-driven on one node (a build is ~1,400 files): each injection checked on its own."""
    for gpu, xid in INJECTIONS:
        before = records(node.kernel_log)
        events_before = events(node)
        text = node.inject_xid(gpu, xid)
        new = records(node.kernel_log)[len(before):]
        case = (gpu, xid)
        assert [r["seq"] for r in new] == list(range(before[-1]["seq"] + 1, before[-1]["seq"] + 1 + len(new))), case
        assert new[-1]["text"] == text and new[-1]["pri"] == 4, case
        assert new[-1]["usec"] >= max(int(node.uptime_at_build * 1_000_000), before[-1]["usec"]), case
        pci = node.gpu_pci_bus_ids[gpu][:-2]  # the driver prints 0000:53:00, no function
        assert text.startswith(f"NVRM: Xid (PCI:{pci}): {xid}, "), case
        assert text.endswith(XID_MESSAGES.get(xid, "Unrecognized error, see the NVIDIA XID catalog")), case
        assert new[0]["text"] == f"NVRM: GPU at PCI:{pci}: {node.gpu_uuids[gpu]}", case
        (event,) = events(node)[len(events_before):]
        assert (event.xid, event.pci_bus_id, event.seq) == (xid, node.gpu_pci_bus_ids[gpu], new[-1]["seq"]), case
        assert abs(event.timestamp - time.time()) < 300, case  # boot time + usec is now, not boot


def test_process_fields_follow_the_xid(node):
    node.inject_xid(3, 94)
    node.inject_xid(3, 79)
    by_xid = {e.xid: e for e in events(node)}
    assert (by_xid[94].pid, by_xid[94].process_name) == (48258, "python")
    assert (by_xid[79].pid, by_xid[79].process_name) == (None, "")


def test_second_xid_on_a_gpu_is_just_the_xid_line(node):
    node.inject_xid(3, 94)
    count = len(records(node.kernel_log))
    node.inject_xid(3, 94)
    new = records(node.kernel_log)[count:]
    assert len(new) == 1 and new[0]["text"].startswith("NVRM: Xid (PCI:0000:86:00): 94,")
    assert [e.xid for e in events(node)] == [94, 94]


def test_kmsg_source_follows_injections(node):
    source = KmsgSource(str(node.root))
    assert source.collect(time.time()).xids == ()
    node.inject_xid(3, 94)
    node.inject_xid(6, 63)
    result = source.collect(time.time())
    assert [(e.xid, e.pci_bus_id) for e in result.xids] == [(94, "0000:86:00.0"), (63, "0000:b9:00.0")]
    assert result.xids[0].boot_id == node.boot_id
    assert source.collect(time.time()).xids == ()
    source.close()


def test_inject_via_nvml_and_both(node):
    assert node.inject_xid(2, 94, via="nvml") == ""
    assert events(node) == []
    assert stub_nvml.load_scenario(node.scenario)["events"][-1] == {"id": 1, "gpu": 2, "type": "xid", "data": 94}
    node.inject_xid(4, 95, via="both")
    assert stub_nvml.load_scenario(node.scenario)["events"][-1] == {"id": 2, "gpu": 4, "type": "xid", "data": 95}
    assert [(e.xid, e.pci_bus_id) for e in events(node)] == [(95, "0000:97:00.0")]


def test_inject_rejects_bad_arguments(node):
    with pytest.raises(ValueError, match="via"):
        node.inject_xid(0, 94, via="dmesg")
    with pytest.raises(IndexError, match="GPU 8"):
        node.inject_xid(8, 94)
    assert events(node) == []


# -- EFA faults ----------------------------------------------------------------------------------

def test_bump_efa_counter_is_seen_by_the_source(node):
    source = EfaSource(str(node.root))
    before = {s.device: s for s in source.collect(time.time()).efa}
    new_value = node.bump_efa_counter("rdmap113s0", "no_completion_cmds", 3)
    assert new_value == 3
    port_value = node.bump_efa_counter("rdmap113s0", "rx_drops", 250)
    assert port_value == 250
    node.bump_efa_counter("rdmap113s0", "tx_bytes", 1_000_000)
    result = source.collect(time.time())
    after = {s.device: s for s in result.efa}
    assert after["rdmap113s0"].counters["no_completion_cmds"] == 3
    assert after["rdmap113s0"].counters["rx_drops"] == 250
    assert after["rdmap113s0"].counters["tx_bytes"] == before["rdmap113s0"].counters["tx_bytes"] + 1_000_000
    assert after["rdmap79s0"].counters == before["rdmap79s0"].counters
    assert result.health.errors == {}  # no temporary file ever shows up among the counters
    with pytest.raises(KeyError):
        node.bump_efa_counter("rdmap113s0", "no_such_counter", 1)


def test_remove_efa_device(node):
    node.remove_efa_device("rdmap150s0")
    result = EfaSource(str(node.root)).collect(time.time())
    names = [s.device for s in result.efa]
    assert len(names) == 31 and "rdmap150s0" not in names
    assert result.health.errors == {}
    assert len(node.efa_devices) == 32  # the inventory the node should have
