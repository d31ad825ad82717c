"""The RDMA rules through the real source and the real classifier, on a node's InfiniBand/RoCE tree
(8 NDR IB ports, 2 RoCE ports): a port going down, a rate downgrade, link flaps, error rates, a
device gone, and a port that cannot be read (unobserved, never down)."""

from __future__ import annotations

import errno
import os

import pytest

from healthagent.check_report import check_json
from healthagent.model import Action, Collection
from healthagent.policy.catalog import load_catalog
from healthagent.policy.classify import Classifier
from healthagent.policy.settings import Policy, PolicyError, parse_policy
from healthagent.sources.rdma import RdmaSource
from tests.support.rdma_tree import ACTIVE, DISABLED, DOWN, HDR, LINK_UP, POLLING, build_rdma_tree

T0 = 1_700_000_000.0
STEP = 10.0  # the default reading interval


class Node:
    """The tree, its source and a classifier, read every ``STEP`` seconds."""

    def __init__(self, root, boot_time: float | None = None, fault=None, policy: Policy | None = None) -> None:
        self.tree = build_rdma_tree(root)
        self.source = RdmaSource(str(root), fault=fault)
        policy = policy or Policy()
        self.classifier = Classifier(policy, load_catalog(policy))
        self.t = T0
        self.boot_time = boot_time

    def read(self, steps: int = 1):
        verdict = None
        for _ in range(steps):
            result = self.source.collect(self.t)
            verdict = self.classifier.observe(Collection(timestamp=self.t, rdma=result.rdma, health=(result.health,),
                                                         boot_time=self.boot_time)).verdict
            self.t += STEP
        return verdict


def codes(verdict) -> dict[tuple[str, str], object]:
    return {(f.code, f.subject): f for f in verdict.findings}


def test_a_healthy_node_has_no_findings(tmp_path):
    verdict = Node(tmp_path).read(3)
    assert verdict.findings == () and verdict.unobserved == ()


def test_a_port_going_down_is_a_node_action_after_half_a_minute(tmp_path):
    node = Node(tmp_path)
    node.read(2)
    node.tree.set_state("mlx5_3", DOWN, DISABLED)
    for _ in range(3):  # down at +0, +10, +20 s: not yet 30 s
        assert ("RDMA_PORT_DOWN", "mlx5_3/1") not in codes(node.read())
    verdict = node.read()
    finding = codes(verdict)[("RDMA_PORT_DOWN", "mlx5_3/1")]
    assert finding.action is Action.REBOOT_NODE and verdict.action is Action.REBOOT_NODE
    assert "state 1: DOWN, phys_state 3: Disabled" in finding.evidence
    assert "GPUs behind its PCIe switch: 0000:4c:00.0" in finding.evidence
    assert "ibp75s0" in finding.summary and "InfiniBand" in finding.summary
    assert "mlx5_3/1" in finding.next_steps and "docs/findings.md#rdma_port_down" in finding.next_steps
    # The link returns: the reboot-class finding stays until a reboot or an operator's clear.
    node.tree.set_state("mlx5_3", ACTIVE, LINK_UP)
    assert ("RDMA_PORT_DOWN", "mlx5_3/1") in codes(node.read(4))


def test_a_port_findings_port_is_its_fabric_device_in_check_json(tmp_path):
    """The port field names the fabric, not EFA: an InfiniBand port's finding carries it in
    ``fabric_device``, and ``check --json`` prints it there."""
    node = Node(tmp_path)
    node.read(2)
    node.tree.set_state("mlx5_3", DOWN, DISABLED)
    verdict = node.read(4)
    (finding,) = [f for f in verdict.findings if f.code == "RDMA_PORT_DOWN"]
    printed = check_json(Collection(timestamp=node.t), verdict)["findings"]
    assert [(f["code"], f["fabric_device"], f["pci_bus_id"]) for f in printed] == [("RDMA_PORT_DOWN", "mlx5_3/1", "")]
    assert "efa_device" not in printed[0] and finding.subject == "mlx5_3/1"


def test_a_roce_port_going_down_counts_too(tmp_path):
    node = Node(tmp_path)
    node.read()
    node.tree.set_state("mlx5_9", DOWN, DISABLED)
    assert codes(node.read(5))[("RDMA_PORT_DOWN", "mlx5_9/1")].action is Action.REBOOT_NODE


def test_a_port_never_seen_up_is_not_judged(tmp_path):
    node = Node(tmp_path)
    node.tree.set_state("mlx5_8", DOWN, POLLING)  # a storage port without a cable from the start
    assert node.read(6).findings == ()


# The operator's word on what the node is built as: the compute rails up at 400 Gb/s, the
# storage ports up, and one port named that this tree does not have.
EXPECTED = parse_policy({"rdma_ports": {
    "mlx5_[0-7]/1": {"up": True, "rate_gbps": 400},
    "ibp*": {"rate_gbps": 800},  # never reached for mlx5_0..7: the first matching pattern decides
    "mlx5_8/1": {"up": True},
    "mlx5_10/1": {"up": True},
}})


def test_a_port_the_policy_expects_up_is_down_though_never_seen_up(tmp_path):
    node = Node(tmp_path, policy=EXPECTED)
    node.tree.set_state("mlx5_8", DOWN, POLLING)
    found = codes(node.read(4))
    down = found[("RDMA_PORT_DOWN", "mlx5_8/1")]
    assert down.action is Action.REBOOT_NODE
    assert "never seen up; the policy file expects it up (rdma_ports: mlx5_8/1)" in down.evidence
    # The port it names that the node does not have is down too; nothing else is.
    absent = found[("RDMA_PORT_DOWN", "mlx5_10/1")]
    assert "no such port among the 10 InfiniBand/RoCE ports read" in absent.evidence
    assert set(found) == {("RDMA_PORT_DOWN", "mlx5_8/1"), ("RDMA_PORT_DOWN", "mlx5_10/1")}
    # A port no pattern names keeps the default: never seen up, not judged.
    assert ("RDMA_PORT_DOWN", "mlx5_9/1") not in codes(Node(tmp_path / "other").read(4))


def test_ports_that_all_came_up_slow_are_degraded_by_the_policy_rate(tmp_path):
    node = Node(tmp_path, policy=EXPECTED)
    for device in [f"mlx5_{i}" for i in range(8)]:
        node.tree.set_rate(device, HDR)  # every sibling at 200: only the policy file says 400
    found = codes(node.read())
    assert {s for c, s in found if c == "RDMA_PORT_DEGRADED"} == {f"mlx5_{i}/1" for i in range(8)}
    assert found[("RDMA_PORT_DEGRADED", "mlx5_0/1")].evidence == (
        "rate 200 Gb/sec (4X HDR); the policy file expects (rdma_ports: mlx5_[0-7]/1) 400 Gb/sec; "
        "GPUs behind its PCIe switch: 0000:0c:00.0")


def test_an_expected_port_that_cannot_be_read_is_unobserved_not_down(tmp_path):
    def fault(path: str) -> None:
        if "/mlx5_4/" in path:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), path)

    policy = parse_policy({"rdma_ports": {"mlx5_4/1": {"up": True}}})
    verdict = Node(tmp_path, fault=fault, policy=policy).read(6)
    assert verdict.findings == () and verdict.unobserved == ("rdma",)


@pytest.mark.parametrize("section,message", [
    ([1], "rdma_ports: must be a mapping of port pattern"),
    ({"mlx5_0/1": True}, "rdma_ports.mlx5_0/1: must be a mapping with up and/or rate_gbps"),
    ({"mlx5_0/1": {"upp": True}}, "rdma_ports.mlx5_0/1: unknown key 'upp'; valid keys: up, rate_gbps"),
    ({"mlx5_0/1": {"up": "yes"}}, "rdma_ports.mlx5_0/1.up: 'yes' is not true or false"),
    ({"mlx5_0/1": {"rate_gbps": "400G"}}, "rdma_ports.mlx5_0/1.rate_gbps: '400G' is not a number"),
    ({"mlx5_0/1": {"rate_gbps": 0}}, "rdma_ports.mlx5_0/1.rate_gbps: 0 is out of range"),
    ({"mlx5_0/1": {"rate_gbps": 1e9}}, "rate_gbps: 1e+09 is out of range"),
    ({"": {"up": True}}, "rdma_ports: '' is not a port pattern"),
    ({"a\nb": {"up": True}}, "is not a port pattern"),
])
def test_a_bad_rdma_ports_section_is_one_line_naming_the_key(section, message):
    with pytest.raises(PolicyError) as caught:
        parse_policy({"rdma_ports": section})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_no_port_down_within_the_grace_after_a_boot(tmp_path):
    node = Node(tmp_path, boot_time=T0 - 60)
    node.read()
    node.tree.set_state("mlx5_1", "2: INIT", LINK_UP)
    assert node.read(6).findings == ()  # 1 to 2 minutes after the boot: the SM is still at work
    node.tree.set_state("mlx5_1", ACTIVE, LINK_UP)
    node.t = T0 + 600
    node.read()
    node.tree.set_state("mlx5_1", DOWN, DISABLED)
    assert ("RDMA_PORT_DOWN", "mlx5_1/1") in codes(node.read(5))


def test_a_rate_downgrade_is_degraded(tmp_path):
    node = Node(tmp_path)
    node.read()
    node.tree.set_rate("mlx5_5", HDR)
    finding = codes(node.read())[("RDMA_PORT_DEGRADED", "mlx5_5/1")]
    assert finding.action is Action.MONITOR
    assert "rate 200 Gb/sec (4X HDR)" in finding.evidence and "400 Gb/sec" in finding.evidence


def test_a_port_that_came_up_slow_is_caught_by_its_siblings(tmp_path):
    node = Node(tmp_path)
    node.tree.set_rate("mlx5_2", HDR)
    finding = codes(node.read())[("RDMA_PORT_DEGRADED", "mlx5_2/1")]
    assert "its sibling ports of the same card model run at 400 Gb/sec" in finding.evidence
    # The RoCE ports run at 200 and are another card model: not degraded.
    assert {s for c, s in codes(node.read()) if c == "RDMA_PORT_DEGRADED"} == {"mlx5_2/1"}


def test_five_link_downed_steps_in_a_minute_are_flapping(tmp_path):
    node = Node(tmp_path)
    node.read()
    for _ in range(4):
        node.tree.bump("mlx5_6", "link_downed", 1)
        assert ("RDMA_LINK_FLAPPING", "mlx5_6/1") not in codes(node.read())
    node.tree.bump("mlx5_6", "link_downed", 1)
    finding = codes(node.read())[("RDMA_LINK_FLAPPING", "mlx5_6/1")]
    assert finding.action is Action.REBOOT_NODE and "link_downed +1 now (+5 in 50 s" in finding.evidence


def test_four_flaps_then_a_quiet_minute_are_not_flapping(tmp_path):
    node = Node(tmp_path)
    node.read()
    node.tree.bump("mlx5_6", "link_downed", 4)
    node.read(7)
    node.tree.bump("mlx5_6", "link_downed", 1)
    assert node.read().findings == ()


def test_error_rates_over_their_limits(tmp_path):
    node = Node(tmp_path)
    node.read()
    node.tree.bump("mlx5_0", "symbol_error", 400)
    node.tree.bump("mlx5_1", "port_rcv_errors", 50)
    node.tree.bump("mlx5_1", "port_xmit_discards", 50)  # under its limit of 100
    found = codes(node.read())
    assert found[("RDMA_SYMBOL_ERRORS", "mlx5_0/1")].evidence.startswith("symbol_error +400 in 10 s (limit 10/min)")
    assert found[("RDMA_RCV_ERRORS", "mlx5_1/1")].action is Action.MONITOR
    assert ("RDMA_XMIT_DISCARDS", "mlx5_1/1") not in found


def test_an_unreadable_port_is_unobserved_never_down(tmp_path):
    blind = {"on": False}

    def fault(path: str) -> None:
        if blind["on"] and path.endswith("mlx5_4/ports/1/state"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    node = Node(tmp_path, fault=fault)
    node.read()
    blind["on"] = True
    verdict = node.read(6)
    assert verdict.findings == () and verdict.action is Action.NONE
    assert verdict.unobserved == ("rdma",)


def test_a_device_gone_is_missing(tmp_path):
    node = Node(tmp_path)
    node.read()
    node.tree.remove_device("mlx5_7")
    finding = codes(node.read())[("RDMA_DEVICE_MISSING", "node")]
    assert finding.action is Action.REBOOT_NODE and "not seen any more: mlx5_7" in finding.evidence


def test_what_a_port_was_survives_a_restart(tmp_path):
    node = Node(tmp_path)
    node.read()
    saved = node.classifier.export_state()
    node.classifier = Classifier(Policy(), load_catalog(Policy()))
    node.classifier.restore_state(saved)
    assert node.classifier.restore_errors == 0
    node.tree.set_state("mlx5_0", DOWN, DISABLED)
    assert ("RDMA_PORT_DOWN", "mlx5_0/1") in codes(node.read(5))
