"""``healthagent explain XID`` says what a replacement engine does with the verdict, for the
condition vocabulary and HyperPod labels the agent is configured with (--set, the environment)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from healthagent.cli import main
from healthagent.model import Action
from healthagent.present.engine_words import NMA_FATAL_XIDS, engine_lines

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


@pytest.fixture(autouse=True)
def no_agent_environment(monkeypatch):
    """The test process's own HEALTHAGENT_* variables must not choose the vocabulary."""
    import os

    for key in [k for k in os.environ if k.startswith("HEALTHAGENT_")]:
        monkeypatch.delenv(key)


def explained(capsys, *argv: str) -> str:
    assert main(["explain", *argv]) == 0
    return capsys.readouterr().out


def test_the_default_vocabulary_says_no_engine_acts_and_how_to_get_one(capsys):
    out = explained(capsys, "94")
    assert "Engines (condition_vocabulary=healthagent): GpuHealthy turns False" in out
    assert "no engine acts on GpuHealthy or NetworkHealthy by itself" in out
    assert "condition_vocabulary=eks" in out and "hyperpod_labels=true" in out
    assert "Karpenter node repair" not in out


def test_under_eks_karpenter_replaces_for_any_node_action_and_reads_no_reason(capsys):
    replace = explained(capsys, "94", "--set", "condition_vocabulary=eks")
    assert "AcceleratedHardwareReady turns False with reason NvidiaXID94Error" in replace
    assert ("Karpenter node repair (feature gate NodeRepair, v1.14.1) replaces the node once "
            "AcceleratedHardwareReady has been False for 10 minutes") in replace
    assert "this replace_node verdict is a replacement under Karpenter" in replace
    assert "managed node groups' node auto repair acts after 10 minutes: reboot or replace" in replace
    reboot = explained(capsys, "79", "--set", "condition_vocabulary=eks")
    assert "this reboot_node verdict is a replacement under Karpenter" in reboot


def test_under_eks_it_says_whether_the_monitoring_agent_flags_the_xid(capsys):
    assert "XID 94 is not one of its fatal XIDs (an Event only)" in explained(
        capsys, "94", "--set", "condition_vocabulary=eks")
    assert "XID 79 is one of its fatal XIDs, so it sets the condition False itself" in explained(
        capsys, "79", "--set", "condition_vocabulary=eks")


def test_the_environment_chooses_the_vocabulary_as_it_does_for_the_agent(capsys, monkeypatch):
    monkeypatch.setenv("HEALTHAGENT_CONDITION_VOCABULARY", "eks")
    assert "Engines (condition_vocabulary=eks)" in explained(capsys, "79")


def test_a_verdict_below_a_node_action_reaches_no_engine(capsys):
    out = explained(capsys, "13", "--set", "condition_vocabulary=eks")
    assert "AcceleratedHardwareReady stays True (FindingsWithoutNodeAction): no engine acts" in out
    assert engine_lines(13, Action.NONE, "eks") == [
        "Engines (condition_vocabulary=eks): no finding, so no condition or label changes; no engine acts."]


def test_hyperpod_labels_name_the_value_hyperpod_acts_on(capsys):
    out = explained(capsys, "94", "--set", "hyperpod_labels=true")
    assert "node-health-status becomes UnschedulablePendingReplacement" in out
    assert "HyperPod replaces the node at once" in out and "another writer" in out
    assert "hyperpod_labels=true (SageMaker HyperPod)" not in out  # no hint to set what is set
    assert "UnschedulablePendingReboot" in "\n".join(engine_lines(79, Action.REBOOT_NODE, "eks", True))


def test_xid_154_says_what_happens_when_the_driver_asks_for_a_reboot(capsys):
    out = explained(capsys, "154", "--set", "condition_vocabulary=eks")
    assert "When the message says 'Node Reboot Required' (reboot_node):" in out
    assert "this reboot_node verdict is a replacement under Karpenter" in out


def test_a_bad_vocabulary_is_one_line_and_exit_3(capsys):
    assert main(["explain", "94", "--set", "condition_vocabulary=karpenter"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "condition_vocabulary" in err


def test_the_monitoring_agents_fatal_xids_are_the_ones_the_docs_name():
    text = OPERATIONS.read_text(encoding="utf-8")
    found = re.search(r"fatal XIDs in\s+v1\.7\.0 are ([0-9,\sand]+)", text)
    assert found, "docs/operations.md names no list of the monitoring agent's fatal XIDs"
    assert {int(n) for n in re.findall(r"\d+", found.group(1))} == NMA_FATAL_XIDS


def test_under_eks_karpenter_v115_is_paced_by_budgets_and_reboots_by_reason(capsys):
    """Karpenter v1.15.0 repairs within the NodePool's disruption budget and, with RebootForRepair,
    reboots where the EKS User Guide's table does: XID 94 reboots (and a reboot does not end the
    agent's replace_node verdict), XID 79 is a replacement either way."""
    xid94 = explained(capsys, "94", "--set", "condition_vocabulary=eks")
    assert "Karpenter node repair v1.15.0: after the same 10 minutes" in xid94
    assert "within its NodePool's disruption budget" in xid94 and "karpenter.sh/do-not-repair=true" in xid94
    assert "RebootForRepair gate on, NvidiaXID94Error is a reboot" in xid94
    assert "A reboot does not end this replace_node verdict" in xid94
    xid79 = explained(capsys, "79", "--set", "condition_vocabulary=eks")
    assert "NvidiaXID79Error is a replacement by the EKS User Guide's table, RebootForRepair or not" in xid79
    xid95 = explained(capsys, "95", "--set", "condition_vocabulary=eks")
    assert "NvidiaXID95Error is a reboot" in xid95
    assert "EKS node monitoring agent v1.7.2" in xid94


def test_the_install_guide_says_per_engine_and_version_what_explain_says():
    """explain and docs/install.md name the same releases, each engine with its own paragraph."""
    from healthagent.present.engine_words import KARPENTER_V115, KARPENTER_VERSION, NMA_VERSION

    text = (OPERATIONS.parent / "install.md").read_text(encoding="utf-8")
    section = text.split("### Per engine and version", 1)[1].split("\n## ", 1)[0]
    for engine in (f"**Karpenter {KARPENTER_VERSION}**", f"**Karpenter {KARPENTER_V115}**",
                   "**EKS managed node groups' node auto repair**", "**SageMaker HyperPod**",
                   f"**The EKS node monitoring agent {NMA_VERSION}**", "**NVSentinel**"):
        assert engine in section, engine
    assert "RebootForRepair" in section and "karpenter.sh/do-not-repair" in section
