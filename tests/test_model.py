"""Shared records: PCI id canonical form and action ordering are contracts other code relies on."""

import pytest

from healthagent.model import Action, Finding, Verdict, canonical_pci_bus_id


@pytest.mark.parametrize(
    "raw,want",
    [
        ("00000000:53:00.0", "0000:53:00.0"),
        ("PCI:0000:53:00", "0000:53:00.0"),
        ("PCI:0000:A8:00", "0000:a8:00.0"),
        ("0000:c5:00.1", "0000:c5:00.1"),
        ("53:00.0", "0000:53:00.0"),
        ("pci:0001:0A:1f.7", "0001:0a:1f.7"),
    ],
)
def test_canonical_pci(raw, want):
    assert canonical_pci_bus_id(raw) == want


@pytest.mark.parametrize("raw", ["", "GPU-123", "0000:zz:00.0", "PCI:", "123456789:00:00.0"])
def test_canonical_pci_rejects(raw):
    assert canonical_pci_bus_id(raw) is None


def test_action_order_and_exit_codes():
    assert [a.value for a in Action] == [
        "none", "monitor", "restart_app", "reset_gpu", "reboot_node", "replace_node"]
    assert Action.most_severe([Action.MONITOR, Action.REPLACE_NODE, Action.RESET_GPU]) is Action.REPLACE_NODE
    mk = lambda a: Finding(code="X", action=a, summary="", evidence="", next_steps="")
    assert Verdict.of([], 0).exit_code == 0
    assert Verdict.of([mk(Action.RESET_GPU)], 0).exit_code == 1
    assert Verdict.of([mk(Action.MONITOR), mk(Action.REBOOT_NODE)], 0).exit_code == 2
    with pytest.raises(ValueError, match="replace_node"):
        Action.parse("replace")
