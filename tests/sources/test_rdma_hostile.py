"""An InfiniBand/RoCE tree broken the ways a hostile or hand-edited host can break it, read by the
real source and judged by the real classifier: none of it may become a node action.

Real files under a tmp host root (the DGX-style tree of ``tests/support/rdma_tree``). Each port
was first read healthy and up, so the classifier knows every device and port: had a break made a
device *missing*, a port *down* or a counter *jump*, RDMA_DEVICE_MISSING, RDMA_PORT_DOWN or
RDMA_LINK_FLAPPING (reboot_node) would follow.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from prometheus_client.exposition import choose_encoder

from healthagent.demo.node import write_efa_devices
from healthagent.model import Action, AgentSnapshot, Collection
from healthagent.policy.catalog import load_catalog
from healthagent.policy.classify import Classifier
from healthagent.policy.rules_efa import ADMIN_QUEUE, EfaRules, EfaTrack
from healthagent.policy.settings import Policy
from healthagent.sources.efa import EfaSource
from healthagent.sources.rdma import RdmaSource
from healthagent.sources.sysfs_reader import MAX_DEVICES, MAX_PORTS, TOO_MANY
from healthagent.telemetry.metrics import Telemetry
from tests.support.rdma_tree import ACTIVE, LINK_UP, build_rdma_tree

T0 = 1_700_000_000.0
STEP = 10.0
VICTIM = "mlx5_4"
U64_MAX = 2**64 - 1


class Node:
    """The tree, a source and a classifier that has seen every port up."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tree = build_rdma_tree(root)
        self.source = RdmaSource(str(root))
        self.classifier = Classifier(Policy(), load_catalog(Policy()))
        self.t = T0
        self.read(2)  # every device known, every port seen up

    def read(self, steps: int = 1):
        verdict = None
        for _ in range(steps):
            self.result = self.source.collect(self.t)
            verdict = self.classifier.observe(Collection(timestamp=self.t, rdma=self.result.rdma,
                                                         health=(self.result.health,))).verdict
            self.t += STEP
        return verdict

    def device_dir(self, name: str = VICTIM) -> Path:
        return (self.root / "sys/class/infiniband" / name).resolve()


def loop(a: Path, b: Path) -> None:
    os.symlink(b.name, a)
    os.symlink(a.name, b)


def ports_a_looping_link(node: Node) -> None:
    ports = node.device_dir() / "ports"
    shutil.rmtree(ports)
    loop(ports, ports.with_name("ports-b"))


def ports_a_file(node: Node) -> None:
    ports = node.device_dir() / "ports"
    shutil.rmtree(ports)
    ports.write_text("not a directory\n")


@pytest.mark.parametrize("restart", [False, True], ids=["same agent", "restarted agent"])
@pytest.mark.parametrize("how, errno_name", [(ports_a_looping_link, "ELOOP"), (ports_a_file, "ENOTDIR")],
                         ids=["ELOOP", "ENOTDIR"])
def test_a_device_whose_ports_cannot_be_listed_is_unobserved_never_missing(tmp_path, how, errno_name, restart):
    node = Node(tmp_path)
    how(node)
    if restart:  # a fresh source lists the device's ports (the classifier still knows the device)
        node.source = RdmaSource(str(tmp_path))
    verdict = node.read(6)  # a minute: past RDMA_PORT_DOWN's 30 s
    health = node.result.health
    assert verdict.findings == () and verdict.action is Action.NONE and "rdma" in verdict.unobserved
    assert health.up is False and [n.split("/")[0] for n in health.unobserved] == [VICTIM]
    assert errno_name in health.detail and "unobserved" in health.detail
    assert len(node.result.rdma) == 9  # every other port still read


def test_a_port_whose_counters_cannot_be_listed_is_unobserved_until_repaired(tmp_path):
    node = Node(tmp_path)
    counters = node.tree.port_dir(VICTIM) / "counters"
    saved = tmp_path / "saved-counters"
    counters.rename(saved)
    counters.write_text("not a directory\n")
    node.source = RdmaSource(str(tmp_path))  # lists the port afresh
    verdict = node.read(6)
    assert verdict.findings == () and node.result.health.unobserved == (f"{VICTIM}/1",)
    assert "ENOTDIR" in node.result.health.detail
    counters.unlink()
    saved.rename(counters)
    node.read()
    assert node.result.health.up and len(node.result.rdma) == 10  # listed again, never trusted while blind


def test_a_device_positively_gone_is_still_missing(tmp_path):
    node = Node(tmp_path)
    node.tree.remove_device(VICTIM)
    verdict = node.read(4)
    assert [f.code for f in verdict.findings] == ["RDMA_DEVICE_MISSING"] and VICTIM in verdict.findings[0].evidence


@pytest.mark.parametrize("state, phys_state", [
    ("9: BOGUS", LINK_UP), (ACTIVE, "77: ???"), ("7: UNKNOWN", LINK_UP), ("1: ACTIVE", LINK_UP),
    (ACTIVE, "5: Polling"), ("-1: DOWN", LINK_UP),
])
def test_a_state_the_kernel_cannot_write_is_unobserved_never_down(tmp_path, state, phys_state):
    node = Node(tmp_path)
    node.tree.set_state(VICTIM, state, phys_state)
    verdict = node.read(6)  # a minute: past RDMA_PORT_DOWN's 30 s
    health = node.result.health
    assert verdict.findings == () and verdict.action is Action.NONE
    assert health.unobserved == (f"{VICTIM}/1",) and health.errors.get("parse", 0) >= 1
    assert "not a state the kernel writes" in health.detail


def flaps(verdict) -> list:
    return [f for f in verdict.findings if f.code == "RDMA_LINK_FLAPPING"]


@pytest.mark.parametrize("garbage", [U64_MAX, 256, 2**32])
def test_link_downed_past_its_8_bits_is_garbage_not_flaps(tmp_path, garbage):
    node = Node(tmp_path)
    normal = node.tree.counter(VICTIM, "link_downed")
    node.tree.write(VICTIM, "counters/link_downed", str(garbage))
    verdict = node.read()
    port = {p.name: p for p in node.result.rdma}[f"{VICTIM}/1"]
    assert "link_downed" not in port.counters and node.result.health.errors.get("parse", 0) >= 1
    assert verdict.findings == () and verdict.action is Action.NONE
    node.tree.write(VICTIM, "counters/link_downed", str(normal))
    assert node.read(3).findings == ()


@pytest.mark.parametrize("name, high, past", [("local_link_integrity_errors", 12, 200),
                                              ("link_error_recovery", 200, 256),
                                              ("symbol_error", 60_000, 65_536), ("port_rcv_errors", 60_000, 2**20)])
def test_every_pma_counter_is_held_to_its_width(tmp_path, name, high, past):
    """A counter high in its range, one reading past its width, then the same value again: neither
    the garbage nor a sum that lost a part and got it back is an error rate."""
    node = Node(tmp_path)
    node.tree.write(VICTIM, f"counters/{name}", str(high))
    node.read()
    node.classifier = Classifier(Policy(), load_catalog(Policy()))  # the jump to ``high`` forgotten
    node.read(2)
    node.tree.write(VICTIM, f"counters/{name}", str(past))
    assert node.read().findings == ()
    node.tree.write(VICTIM, f"counters/{name}", str(high))
    assert node.read(2).findings == ()


def test_a_counter_going_backwards_is_a_reset_never_flaps(tmp_path):
    node = Node(tmp_path)
    node.tree.write(VICTIM, "counters/link_downed", "200")
    node.read()  # +198 at once: flapping, found as such
    node.classifier = Classifier(Policy(), load_catalog(Policy()))
    node.read(2)
    node.tree.write(VICTIM, "counters/link_downed", "3")
    assert flaps(node.read(2)) == []  # backwards: a reset, a new baseline
    node.tree.write(VICTIM, "counters/link_downed", "9")
    assert [f.subject for f in flaps(node.read())] == [f"{VICTIM}/1"]  # real flaps after it still count


def test_an_efa_counter_going_backwards_is_a_reset_never_an_event(tmp_path):
    """EFA hw_counters are u64, so no width catches a lower value: the reset rule does. The admin
    queue's counter going down is a new baseline, never EFA_ADMIN_QUEUE_STUCK; a rise after it is."""
    write_efa_devices(tmp_path, ["0000:4f:00.0"])
    counter = tmp_path / "sys/class/infiniband/rdmap79s0/hw_counters/no_completion_cmds"
    source, rules, track = EfaSource(str(tmp_path)), EfaRules(Policy()), EfaTrack()

    def bad_signals(value: int, t: float) -> list[str]:
        counter.resolve().write_text(f"{value}\n")
        (sample,) = source.collect(t).efa
        assert sample.counters[ADMIN_QUEUE] == value
        return [s.code for s in rules.evaluate(sample, track, t) if s.bad]

    assert bad_signals(0, T0) == []
    assert bad_signals(7, T0 + 10) == ["EFA_ADMIN_QUEUE_STUCK"]
    assert bad_signals(3, T0 + 20) == []  # backwards: a reset
    assert bad_signals(3, T0 + 30) == []
    assert bad_signals(4, T0 + 40) == ["EFA_ADMIN_QUEUE_STUCK"]


def write_hostile_devices(root: Path, devices: int, ports: int) -> None:
    """``devices`` class entries (``ib00000``..., sorted before ``mlx5_*``) of ``ports`` up ports
    each, on one PCI function bound to mlx5_core: the least a device needs to be read."""
    pci = next((root / "sys/bus/pci/devices").iterdir()).resolve()
    base = root / "sys/devices/virtual/hostile"
    classes = root / "sys/class/infiniband"
    for i in range(devices):
        name = f"ib{i:05d}"
        device = base / name
        for port in range(1, ports + 1):
            port_dir = device / "ports" / str(port)
            os.makedirs(port_dir / "counters")
            for file, text in (("state", ACTIVE), ("phys_state", LINK_UP), ("rate", "400 Gb/sec (4X NDR)"),
                               ("link_layer", "InfiniBand"), ("counters/link_downed", "0")):
                (port_dir / file).write_text(text + "\n")
        os.symlink(os.path.relpath(pci, device), device / "device")
        os.symlink(os.path.relpath(device, classes), classes / name)


def test_ten_thousand_ports_stay_bounded_in_readings_and_series(tmp_path):
    node = Node(tmp_path)
    write_hostile_devices(tmp_path, devices=2_500, ports=4)  # 10,000 ports, before mlx5_* in order
    verdict = node.read(6)
    health = node.result.health
    assert len(node.result.rdma) <= MAX_PORTS
    assert health.errors["too_many"] >= 2_500 - MAX_DEVICES
    assert len(health.unobserved) >= 2_500 + 10 - MAX_DEVICES and len(health.detail) < 1_000
    # The devices read before are pushed past the bound: unobserved, never missing or down.
    assert {f"mlx5_{i}" for i in range(10)} <= set(health.unobserved)
    assert verdict.findings == () and verdict.action is Action.NONE and "rdma" in verdict.unobserved
    telemetry = Telemetry("test")
    telemetry.publish(AgentSnapshot(timestamp=node.t, rdma=node.result.rdma, health=(health,)))
    body = telemetry.exposition(choose_encoder("text/plain")[0], "").decode()
    series = [line for line in body.splitlines() if line and not line.startswith("#")]
    assert sum(line.startswith("healthagent_infiniband_port_up{") for line in series) == len(node.result.rdma)
    assert len(series) < 5_000 and len(body) < 1_000_000


def test_efa_devices_past_the_bound_are_unobserved_never_missing(tmp_path):
    """The EFA source reads through the same layer: 100 devices (a p5 has 32) are read as
    MAX_PORTS, the rest named unobserved and counted, so none is taken for missing."""
    pci_ids = [f"0000:{bus:02x}:00.0" for bus in range(0x10, 0x10 + 100)]
    write_efa_devices(tmp_path, pci_ids)
    result = EfaSource(str(tmp_path)).collect(T0)
    assert len(result.efa) == MAX_PORTS and result.health.up is False
    assert len(result.health.unobserved) == 100 - MAX_PORTS
    assert result.health.errors[TOO_MANY] == 100 - MAX_DEVICES + (MAX_DEVICES - MAX_PORTS)
    classifier = Classifier(Policy(), load_catalog(Policy()))
    verdict = classifier.observe(Collection(timestamp=T0, efa=result.efa, health=(result.health,),
                                            expected_efa_devices=32)).verdict
    assert verdict.findings == () and "efa" in verdict.unobserved
