"""ConnectX (mlx5) kernel-log events judged: real lines through the real parser into the real
classifier, the catalog and its policy-file overrides, the repeat-after-reboot rule, the state, the
metric and the alert's list of fatal events.
"""

from __future__ import annotations

import csv
import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from healthagent.agent import AdapterTally
from healthagent.common import ErrorTally
from healthagent.effects.node_desired import NETWORK_CONDITION, condition_of
from healthagent.model import Action, AdapterEvent, AgentSnapshot, Collection, RdmaPort
from healthagent.policy.adapters import ADAPTER_EVENT, MAX_ADAPTERS
from healthagent.policy.catalog import load_catalog
from healthagent.policy.classify import Classifier
from healthagent.policy.mlx5_catalog import bundled_rows, event_ids, load_mlx5_catalog
from healthagent.policy.settings import Policy, PolicyError, load_policy, parse_policy
from healthagent.sources.kernel_log.parser import XidLineParser
from healthagent.telemetry.mlx5_metrics import mlx5_families

REPO = Path(__file__).resolve().parents[2]
BTIME = 1_795_150_000.0
T0 = 1_795_176_000.0
BOOT_A, BOOT_B = "boot-a", "boot-b"
PCI = "0000:41:00.0"
FATAL = f"mlx5_core {PCI}: poll_health:785:(pid 0): Fatal error 5 detected"
MISS = f"mlx5_core {PCI}: poll_health:801:(pid 0): device's health compromised - reached miss count"
HOT = f"mlx5_core {PCI}: temp_warn:176:(pid 0): High temperature on sensors with bit set 0 1"
BAD_CABLE = (f"mlx5_core {PCI}: port_module:258:(pid 0): Port module event[error]: module 0, Cable error, "
             "Bad or shorted cable/module")
PLUGGED = f"mlx5_core {PCI}: Port module event: module 0, Cable plugged"
PORT = RdmaPort(device="mlx5_2", port=1, state_id=4, phys_state_id=5, pci_bus_id=PCI, driver="mlx5_core")


def events(*messages: str, at: float = T0 - 10, previous_boot: bool = False) -> tuple[AdapterEvent, ...]:
    """The real parser's events for dmesg lines of this boot stamped ``at``; ``previous_boot``: as
    a kernel-log file's line of an earlier boot is read (its time kept)."""
    parser = XidLineParser(ErrorTally("kmsg"), boot_time=BTIME, now=T0)
    found = tuple(parser.scan([f"[{max(0.0, at - BTIME):12.6f}] {m}" for m in messages]))
    assert len(found) == len(messages) and all(isinstance(e, AdapterEvent) for e in found)
    return tuple(replace(e, timestamp=at, previous_boot=previous_boot) for e in found)


def judge(policy: Policy | None = None) -> Classifier:
    policy = policy or Policy()
    return Classifier(policy, load_catalog(policy))


def observe(classifier: Classifier, found, now: float = T0, boot_id: str = BOOT_A, rdma=(PORT,)):
    return classifier.observe(Collection(timestamp=now, adapter_events=found, rdma=rdma, boot_id=boot_id))


def counts(family) -> dict[tuple[str, str, str], float]:
    """The counter's samples by (device, pci_bus_id, event)."""
    return {(s.labels["device"], s.labels["pci_bus_id"], s.labels["event"]): s.value for s in family.samples
            if s.name.endswith("_total")}


def the_finding(assessment):
    [finding] = [f for f in assessment.verdict.findings if f.code == ADAPTER_EVENT]
    return finding


# -- judged ---------------------------------------------------------------------------------------

def test_a_fatal_adapter_takes_the_node_out_on_the_networking_condition():
    assessment = observe(judge(), events(FATAL))
    finding = the_finding(assessment)
    assert assessment.verdict.action is Action.REBOOT_NODE and finding.action is Action.REBOOT_NODE
    assert (finding.pci_bus_id, finding.fabric_device, finding.gpu_index) == (PCI, "mlx5_2", None)
    assert FATAL in finding.evidence and "mlx5 catalog: fatal_error -> reboot_node" in finding.evidence
    assert "mlx5_2 (0000:41:00.0)" in finding.summary and "sensor 5" in finding.summary
    assert "docs/findings.md#rdma_adapter_event" in finding.next_steps
    assert condition_of(finding.code) == NETWORK_CONDITION  # the networking condition, with the ports
    assert [(e.event, e.device) for e in assessment.adapter_events] == [("fatal_error", "mlx5_2")]


def test_a_bad_cable_is_an_alert_and_a_plugged_cable_only_a_count():
    classifier = judge()
    cable = observe(classifier, events(BAD_CABLE))
    assert the_finding(cable).action is Action.MONITOR and cable.verdict.action is Action.MONITOR
    plug = judge()
    plugged = observe(plug, events(PLUGGED))
    assert plugged.verdict.findings == () and [e.event for e in plugged.adapter_events] == ["module_plugged"]


def test_a_burst_is_one_finding_with_the_words_of_its_worst_event():
    classifier = judge()
    observe(classifier, events(MISS, FATAL))
    later = observe(classifier, events(HOT, at=T0 + 90), now=T0 + 100)
    finding = the_finding(later)
    assert finding.action is Action.REBOOT_NODE and finding.count == 3
    assert "fatal_error" in finding.summary and "temp_warn" not in finding.summary


def test_the_device_name_is_kept_once_the_adapter_is_gone():
    classifier = judge()
    observe(classifier, events(HOT))
    gone = observe(classifier, events(FATAL, at=T0 + 90), now=T0 + 100, rdma=())
    assert [e.device for e in gone.adapter_events] == ["mlx5_2"]
    unknown = observe(judge(), events(FATAL), rdma=())
    assert [e.device for e in unknown.adapter_events] == [""] and the_finding(unknown).fabric_device == ""


def test_an_earlier_boots_events_are_history_not_findings_nor_counts():
    assessment = observe(judge(), events(FATAL, previous_boot=True))
    assert assessment.verdict.findings == () and assessment.adapter_events == ()


# -- the repeat after a reboot ------------------------------------------------------------------

def test_a_fatal_adapter_again_after_the_reboot_must_be_replaced():
    classifier = judge()
    observe(classifier, events(FATAL))
    again_same_boot = observe(classifier, events(MISS, at=T0 + 190), now=T0 + 200)
    assert the_finding(again_same_boot).action is Action.REBOOT_NODE
    rebooted = observe(classifier, (), now=T0 + 3600, boot_id=BOOT_B)
    assert rebooted.verdict.findings == ()  # the reboot closed it
    back = observe(classifier, events(FATAL, at=T0 + 3690), now=T0 + 3700, boot_id=BOOT_B)
    finding = the_finding(back)
    assert finding.action is Action.REPLACE_NODE and "came back after a reboot" in finding.evidence


def test_the_repeat_rule_has_a_window_and_can_be_off():
    late = judge()
    observe(late, events(FATAL))
    week = Policy().mlx5_repeat_seconds
    later = events(FATAL, at=T0 + week + 50)
    assert the_finding(observe(late, later, now=T0 + week + 60, boot_id=BOOT_B)).action is Action.REBOOT_NODE
    off = judge(parse_policy({"thresholds": {"mlx5_repeat_seconds": 0}}))
    observe(off, events(FATAL))
    again = events(FATAL, at=T0 + 50)
    assert the_finding(observe(off, again, now=T0 + 60, boot_id=BOOT_B)).action is Action.REBOOT_NODE


def test_an_earlier_boot_in_a_file_feeds_the_repeat_rule_and_a_clear_forgets_it():
    classifier = judge()
    history = events(FATAL, at=T0 - 86_400, previous_boot=True)
    assert the_finding(observe(classifier, history + events(FATAL))).action is Action.REPLACE_NODE
    forgetful = judge()
    observe(forgetful, events(FATAL, at=T0 - 86_400, previous_boot=True))
    forgetful.clear(T0, "operator clear")
    assert the_finding(observe(forgetful, events(FATAL))).action is Action.REBOOT_NODE


def test_the_history_survives_a_restart_through_the_state_file():
    classifier = judge()
    observe(classifier, events(FATAL))
    saved = json.loads(json.dumps(classifier.export_state()))
    restarted = judge()
    restarted.restore_state(saved)
    assert restarted.restore_errors == 0
    back = observe(restarted, events(FATAL, at=T0 + 590), now=T0 + 600, boot_id=BOOT_B, rdma=())
    assert the_finding(back).action is Action.REPLACE_NODE and the_finding(back).fabric_device == "mlx5_2"


def test_garbage_history_in_the_state_is_dropped_and_counted():
    classifier = judge()
    classifier.restore_state({"version": 1, "adapters": {"names": {PCI: 3}, "fatal": {PCI: ["b", "soon"], "x": 1}}})
    assert classifier.restore_errors == 3 and classifier.adapters.fatal == {} and classifier.adapters.names == {}
    for index in range(MAX_ADAPTERS + 5):
        classifier.adapters._repeat(f"0000:{index // 256:02x}:{index % 256:02x}.0", BOOT_A, T0)
    assert len(classifier.adapters.fatal) == MAX_ADAPTERS


# -- the operator's policy file --------------------------------------------------------------------

def test_the_policy_file_overrides_an_events_action(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("mlx5:\n  module_bad_cable: reboot_node\n  Fatal_Error: monitor\n  module_plugged: monitor\n")
    policy = load_policy(str(path))
    assert policy.mlx5_actions == {"module_bad_cable": Action.REBOOT_NODE, "fatal_error": Action.MONITOR,
                                   "module_plugged": Action.MONITOR}
    cable = the_finding(observe(judge(policy), events(BAD_CABLE)))
    assert cable.action is Action.REBOOT_NODE and "operator override in the policy file" in cable.evidence
    assert the_finding(observe(judge(policy), events(FATAL))).action is Action.MONITOR
    assert the_finding(observe(judge(policy), events(PLUGGED))).action is Action.MONITOR
    silenced = judge(parse_policy({"mlx5": {"fatal_error": "none"}}))
    quiet = observe(silenced, events(FATAL))
    assert quiet.verdict.findings == () and [e.event for e in quiet.adapter_events] == ["fatal_error"]


@pytest.mark.parametrize("section,key,fix", [
    ({"mlx5": {"fatal_eror": "monitor"}}, "mlx5.fatal_eror:", "use one of: health_compromised, fatal_error"),
    ({"mlx5": {"fatal_error": "reboot"}}, "mlx5.fatal_error:", "use one of: none, monitor"),
    ({"mlx5": {"fatal_error": 3}}, "mlx5.fatal_error:", "is not an action; use one of:"),
    ({"mlx5": ["fatal_error"]}, "mlx5:", "must be a mapping of ConnectX event: action"),
    ({"mlx5": {"fatal_error": "monitor", "FATAL_ERROR": "none"}}, "mlx5.fatal_error:", "keep one"),
])
def test_a_bad_mlx5_section_is_one_line_naming_the_key_and_the_fix(section, key, fix):
    with pytest.raises(PolicyError) as error:
        parse_policy(section)
    message = str(error.value)
    assert message.startswith(key) and fix in message and "\n" not in message


# -- catalog, docs, alert, metric -------------------------------------------------------------------

def _documented_events() -> dict[str, list[str]]:
    """docs/findings.md's RDMA_ADAPTER_EVENT section lists the events by action, one item per action:
    ``- `reboot_node`: `fatal_error`, ...`` -> {event: [actions it is listed under]}."""
    doc = (REPO / "docs" / "findings.md").read_text(encoding="utf-8")
    section = doc.split("\n## RDMA_ADAPTER_EVENT\n", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, list[str]] = {}
    for item in re.findall(r"^- (`[a-z_]+`.*?)(?=^- |\Z|^\s*$)", section, re.MULTILINE | re.DOTALL):
        head, _, events = item.partition(":")
        action = head.split("`")[1]
        for event in re.findall(r"`([a-z0-9_]+)`", events):
            listed.setdefault(event, []).append(action)
    return listed


def test_every_row_has_an_action_meaning_and_runbook_and_the_docs_print_the_same_table():
    catalog = load_mlx5_catalog({})
    assert len(catalog) == len(event_ids()) == len(set(event_ids()))
    listed = _documented_events()
    for row in bundled_rows():
        entry = catalog.lookup(row["event"])
        assert entry.meaning and entry.runbook and entry.kernel_text and entry.catalog_action is entry.action
        assert listed.get(row["event"]) == [row["action"]], (row["event"], listed.get(row["event"]))
    assert set(listed) <= set(event_ids()), "the docs list an event the catalog lacks"


def test_the_fatal_alert_names_exactly_the_events_that_take_the_node_out():
    rules = yaml.safe_load((REPO / "alerts" / "healthagent.rules.yaml").read_text(encoding="utf-8"))
    [rule] = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "HealthagentRdmaAdapterFatal"]
    named = set(re.search(r'event=~"([^"]+)"', rule["expr"]).group(1).split("|"))
    with open(REPO / "healthagent" / "policy" / "mlx5_events.csv", encoding="utf-8") as fh:
        fatal = {row["event"] for row in csv.DictReader(fh) if Action.parse(row["action"]).needs_node_action}
    assert named == fatal


def test_the_counter_counts_every_line_by_adapter_and_event_and_only_on_an_rdma_node():
    tally = AdapterTally()
    folded = AdapterEvent("module_bad_cable", PCI, "m", "l", T0, device="mlx5_2", repeats=40)
    tally.add([folded, AdapterEvent("fatal_error", PCI, "m", "l", T0, device="mlx5_2"), folded])
    [family] = mlx5_families(AgentSnapshot(timestamp=T0, adapter_counts=tally.snapshot()))
    assert family.name == "healthagent_mlx5_events" and family.type == "counter"
    assert counts(family) == {("mlx5_2", PCI, "fatal_error"): 1.0, ("mlx5_2", PCI, "module_bad_cable"): 80.0}
    assert list(mlx5_families(AgentSnapshot(timestamp=T0))) == []  # a GPU node with EFA only: nothing
    [empty] = mlx5_families(AgentSnapshot(timestamp=T0, rdma=(PORT,)))
    assert empty.samples == []


# -- the loop, end to end ---------------------------------------------------------------------------

def test_the_agent_reads_judges_counts_and_shows_an_adapter_event(tmp_path):
    """The real loop (``AgentRuntime``, dry-run) over a host root whose /dev/kmsg holds a fatal
    adapter and a flood of one module event: one finding, a False networking condition with its code,
    and the counter by adapter and event, every line counted."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from healthagent.config import load_settings
    from healthagent.effects.node_desired import plan_conditions
    from healthagent.wiring import AgentRuntime
    from tests.support.kmsg_host import make_host, record

    cable = "mlx5_core 0000:0c:00.0: port_module:258:(pid 0): Port module event[error]: module 0, Cable error, " \
            "High Temperature"
    usec = int(time.monotonic() * 1e6)  # stamped as the kernel stamps /dev/kmsg: now, on the decision clock
    text = record(1, FATAL, "SUBSYSTEM=pci", f"DEVICE=+pci:{PCI}", usec=usec, priority=3) + "".join(
        record(seq, cable, usec=usec + seq, priority=3) for seq in range(2, 102))
    host = make_host(tmp_path / "host", kmsg_text=text)
    settings = load_settings(env={}, flags={
        "host_root": str(host), "kube": "dry-run", "listen": "127.0.0.1:0", "nvml": "false",
        "state_file": str(tmp_path / "state.json"), "node_name": "n1", "training_intake": "off"})
    running = AgentRuntime(settings)
    try:
        verdict = running.agent.cycle()
        codes = {(f.code, f.subject, f.action) for f in verdict.findings}
        assert {(ADAPTER_EVENT, PCI, Action.REBOOT_NODE), (ADAPTER_EVENT, "0000:0c:00.0", Action.MONITOR)} <= codes
        networking = {c.type: c for c in plan_conditions(verdict.findings)}[NETWORK_CONDITION]
        assert (networking.status, networking.reason) == ("False", ADAPTER_EVENT)
        [family] = [f for f in text_string_to_metric_families(generate_latest(running.telemetry.registry).decode())
                    if f.name == "healthagent_mlx5_events"]
        assert counts(family) == {("", PCI, "fatal_error"): 1.0, ("", "0000:0c:00.0", "module_high_temperature"): 100.0}
    finally:
        running.server.stop()
