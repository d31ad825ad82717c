"""The PCIe AER rules through the real source and the real classifier, on a node's PCI functions
(two GPUs, a ConnectX and an EFA adapter) under a host root: only growth counts, a fatal error is
a node action, a non-fatal one and a sustained corrected rate are warnings, and nothing that is
not growth (counts already there, a counter going backwards, garbage) ever opens a finding."""

from __future__ import annotations

from healthagent.model import Action, Collection
from healthagent.policy.catalog import load_catalog
from healthagent.policy.classify import Classifier
from healthagent.policy.settings import Policy
from healthagent.sources.pcie_aer import PcieAerSource
from tests.support.pcie_tree import set_aer, write_node

T0 = 1_700_000_000.0
STEP = 10.0  # the RDMA ports' reading interval, on which the AER files are read
GPU, NIC = "0000:3a:00.0", "0000:4b:00.0"


class Node:
    def __init__(self, root, policy: Policy | None = None) -> None:
        self.functions = write_node(root)
        self.source = PcieAerSource(str(root))
        self.policy = policy or Policy()
        self.classifier = Classifier(self.policy, load_catalog(self.policy))
        self.t = T0

    def read(self, steps: int = 1):
        verdict = None
        for _ in range(steps):
            result = self.source.collect(self.t)
            verdict = self.classifier.observe(Collection(timestamp=self.t, aer=result.aer,
                                                         health=(result.health,))).verdict
            self.t += STEP
        return verdict


def codes(verdict) -> dict[tuple[str, str], object]:
    return {(f.code, f.subject): f for f in verdict.findings}


def test_a_healthy_node_has_no_findings(tmp_path):
    verdict = Node(tmp_path).read(3)
    assert verdict.findings == () and verdict.action is Action.NONE


def test_a_fatal_error_on_a_gpu_is_a_node_action_as_a_gpu_off_the_bus_is(tmp_path):
    node = Node(tmp_path)
    node.read(2)
    set_aer(node.functions[GPU], fatal=1)
    verdict = node.read()
    finding = codes(verdict)[("PCIE_AER_FATAL", GPU)]
    assert finding.action is Action.REBOOT_NODE and verdict.action is Action.REBOOT_NODE
    assert "fatal AER errors 0 -> 1" in finding.evidence and "CmpltTO 1" in finding.evidence
    assert load_catalog(node.policy).lookup(79).action is finding.action  # XID 79: fallen off the bus


def test_a_non_fatal_error_on_an_adapter_is_a_warning_naming_it(tmp_path):
    node = Node(tmp_path)
    node.read(2)
    set_aer(node.functions[NIC], nonfatal=3)
    verdict = node.read()
    finding = codes(verdict)[("PCIE_AER_NONFATAL", "mlx5_0")]
    assert finding.action is Action.MONITOR and verdict.action is Action.MONITOR
    assert "mlx5_0 (0000:4b:00.0)" in finding.summary


def test_counts_already_there_at_first_sight_are_the_baseline(tmp_path):
    node = Node(tmp_path)
    set_aer(node.functions[GPU], correctable=500, nonfatal=4, fatal=2)
    assert node.read(3).findings == ()


def test_a_counter_going_backwards_is_a_new_baseline_then_growth_counts_again(tmp_path):
    node = Node(tmp_path)
    set_aer(node.functions[GPU], fatal=5)
    node.read(2)
    set_aer(node.functions[GPU], fatal=0)  # the function was enumerated again
    assert node.read(2).findings == ()
    set_aer(node.functions[GPU], fatal=1)
    assert ("PCIE_AER_FATAL", GPU) in codes(node.read())


def test_a_count_no_kernel_reaches_is_never_growth(tmp_path):
    node = Node(tmp_path)
    node.read(2)
    (node.functions[GPU] / "aer_dev_fatal").write_text(f"CmpltTO 0\nTOTAL_ERR_FATAL {2**64 - 1}\n")
    assert node.read(2).findings == ()
    set_aer(node.functions[GPU], fatal=0)
    assert node.read(2).findings == ()


def test_corrected_errors_open_a_warning_only_when_the_rate_is_sustained(tmp_path):
    node = Node(tmp_path)
    node.read(2)
    set_aer(node.functions[GPU], correctable=300)  # one burst: over the rate for a minute only
    assert all(code != "PCIE_AER_CORRECTABLE" for code, _ in codes(node.read(12)))
    count = 300
    for _ in range(29):  # 120 a minute at every reading, for under five minutes
        count += 20
        set_aer(node.functions[GPU], correctable=count)
        assert ("PCIE_AER_CORRECTABLE", GPU) not in codes(node.read())
    opened = None
    for _ in range(4):
        count += 20
        set_aer(node.functions[GPU], correctable=count)
        opened = codes(node.read()).get(("PCIE_AER_CORRECTABLE", GPU)) or opened
    assert opened is not None and opened.action is Action.MONITOR
    assert "correctable AER errors +" in opened.evidence and "RxErr" in opened.evidence


def test_the_baseline_survives_a_restart_of_the_agent(tmp_path):
    node = Node(tmp_path)
    set_aer(node.functions[GPU], fatal=2)
    node.read(2)
    state = node.classifier.export_state()
    restarted = Classifier(node.policy, load_catalog(node.policy))
    restarted.restore_state(state)
    node.classifier = restarted
    assert node.read(2).findings == ()  # the same two fatal errors: nothing new
    set_aer(node.functions[GPU], fatal=3)
    assert ("PCIE_AER_FATAL", GPU) in codes(node.read())
