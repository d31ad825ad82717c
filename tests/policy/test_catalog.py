"""The XID catalog: every row's action against the documented rule, read independently of the code.

The rule is restated here from docs/findings.md (not imported from catalog.py), so a wrong row in
the CSV and a wrong rule in the code cannot agree with each other by accident.
"""

import csv
from pathlib import Path

import pytest

from healthagent.model import Action
from healthagent.policy.catalog import load_catalog, read_bundled_rows, recovery_action
from healthagent.policy.classify import classify_event
from healthagent.present.explain import explain
from healthagent.policy.settings import Policy, parse_policy
from tests.support.policy import xid

REFERENCE = Path(__file__).parents[1] / "fixtures" / "policy" / "nvidia-xid-catalog.csv"

# docs/findings.md, "The XID catalog and the mapping rule".
RULE = {
    "RESTART_APP": "restart_app", "RESET_GPU": "reset_gpu", "RESTART_BM": "reboot_node",
    "RESTART_VM": "reboot_node", "IGNORE": "monitor", "CONTACT_SUPPORT": "monitor",
    "UPDATE_SWFW": "monitor", "CHECK_MECHANICALS": "monitor", "CHECK_UVM": "monitor",
    "WORKFLOW_XID_48": "reset_gpu", "WORKFLOW_NVLINK_ERR": "reset_gpu", "WORKFLOW_NVLINK5_ERR": "reset_gpu",
    "WORKFLOW_XID_45": "monitor", "XID_154": "monitor",
}
PRODUCT_PROMISE = {63: "replace_node", 64: "replace_node", 94: "replace_node", 95: "replace_node"}
# NVIDIA k8s-device-plugin internal/rm/health.go ignoredXids: application errors.
APPLICATION_XIDS = {13, 31, 43, 45, 68, 109}
BLANK_BUCKET = {162: "monitor", 163: "monitor", 164: "monitor", 165: "monitor", 166: "monitor",
                167: "reset_gpu", 168: "reboot_node", 169: "reset_gpu", 170: "monitor",
                171: "reset_gpu", 172: "reset_gpu"}
SEVERITY = [a.value for a in Action]


def bucket(resolution: str) -> str:
    return resolution.split(" ")[0].split("(")[0]


def expected_action(number: int, resolution: str) -> str:
    if number in PRODUCT_PROMISE:
        return PRODUCT_PROMISE[number]
    action = BLANK_BUCKET[number] if number in BLANK_BUCKET else RULE[bucket(resolution)]
    if number in APPLICATION_XIDS and SEVERITY.index(action) > SEVERITY.index("restart_app"):
        action = "restart_app"
    return action


ROWS = read_bundled_rows()


def test_catalog_has_every_nvidia_row_unchanged():
    reference = {int(r["xid"]): r for r in csv.DictReader(REFERENCE.open(encoding="utf-8"))}
    ours = {int(r["xid"]): r for r in ROWS}
    assert sorted(ours) == list(range(1, 173)) == sorted(reference)
    for number, row in ours.items():
        assert row["name"] == reference[number]["mnemonic_and_description"], number
        assert row["nvidia_resolution"] == reference[number]["nvidia_resolution"], number


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"xid{r['xid']}")
def test_every_row_follows_the_rule(row):
    number = int(row["xid"])
    assert row["action"] == expected_action(number, row["nvidia_resolution"])
    rule = RULE.get(bucket(row["nvidia_resolution"]))
    if rule != row["action"]:
        assert row["note"], f"XID {number} departs from the rule without a note"


@pytest.mark.parametrize("number,action,note_says", [
    (13, "restart_app", "application-caused"),
    (31, "restart_app", "application-caused"),
    (43, "monitor", "application-caused"),
    (45, "monitor", "application-caused"),
    (68, "restart_app", "application-caused"),
    (109, "restart_app", "the default policy restarts the application, where NVIDIA's catalog says RESET_GPU"),
    (48, "reset_gpu", "GPU reset or node reboot"),
    (63, "replace_node", "the default policy replaces the node, where NVIDIA's catalog says IGNORE"),
    (64, "replace_node", "the default policy replaces the node, where NVIDIA's catalog says RESET_GPU"),
    (94, "replace_node", "the default policy replaces the node, where NVIDIA's catalog says RESTART_APP"),
    (95, "replace_node", "the default policy replaces the node, where NVIDIA's catalog says RESET_GPU"),
    (79, "reboot_node", "fell off the PCIe bus"),
    (154, "monitor", "recovery action"),
])
def test_named_rows(number, action, note_says):
    entry = load_catalog(Policy()).lookup(number)
    assert entry.action.value == action
    assert note_says in entry.note


def test_entry_fields_split_nvidia_name():
    entry = load_catalog(Policy()).lookup(45)
    assert entry.name == "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL"
    assert entry.description.startswith("Preemptive cleanup, due to previous errors")
    assert entry.bucket == "WORKFLOW_XID_45"


def test_unknown_xid_is_monitor_with_its_number():
    entry = load_catalog(Policy()).lookup(999)
    assert (entry.name, entry.action, entry.known) == ("UNKNOWN_XID_999", Action.MONITOR, False)


def test_overrides_merge_into_known_and_unknown_rows():
    catalog = load_catalog(parse_policy({"xid": {94: "restart_app", 999: "reboot_node"}}))
    assert catalog.lookup(94).action is Action.RESTART_APP
    assert catalog.lookup(94).catalog_action is Action.REPLACE_NODE
    assert "operator override" in catalog.lookup(94).decided_by()
    assert catalog.lookup(999).action is Action.REBOOT_NODE
    assert catalog.lookup(95).action is Action.REPLACE_NODE


@pytest.mark.parametrize("text,action", [
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", Action.REBOOT_NODE),
    ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", Action.RESET_GPU),
    ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", Action.RESET_GPU),
    ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", Action.RESTART_APP),
    ("GPU recovery action changed from 0x2 (Node Reboot Required) to 0x0 (None)", Action.MONITOR),
    ("GPU recovery action changed from 0x0 (None) to 0x2 (OS Reboot)", Action.REBOOT_NODE),
    ("GPU recovery action changed from 0x0 (None) to 0x1 (PF FLR)", Action.RESET_GPU),
    ("GPU recovery action changed from 0x0 to 0x2", Action.REBOOT_NODE),
    ("GPU recovery action changed from 0x0 (None) to 0x9 (Frobnicate)", Action.MONITOR),
    ("garbage", Action.MONITOR),
    ("", Action.MONITOR),
])
def test_xid154_takes_the_drivers_recommendation(text, action):
    got, why = recovery_action(text)
    assert got is action
    assert why.startswith("XID 154")


def test_xid154_unreadable_text_is_quoted():
    _, why = recovery_action("to 0x9 (Frobnicate)")
    assert "Frobnicate" in why and "monitor" in why


def test_xid154_event_decides_through_catalog_unless_overridden():
    event = xid(154, message="GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)")
    assert load_catalog(Policy()).decide(event)[1] is Action.REBOOT_NODE
    overridden = load_catalog(parse_policy({"xid": {154: "monitor"}}))
    assert overridden.decide(event)[1] is Action.MONITOR


def test_classify_event_shape():
    got = classify_event(xid(94, index=3), load_catalog(Policy()))
    assert got == {"xid": 94, "pci_bus_id": "0000:86:00.0", "name": "ROBUST_CHANNEL_CONTAINED_ERROR",
                   "action": "replace_node", "line": "NVRM: Xid (PCI:0000:86:00): 94, test"}


def test_classify_event_sxid_and_fallen_off_bus():
    catalog = load_catalog(parse_policy({"sxid": {12028: "reboot_node"}}))
    sxid = classify_event(xid(12028, kind="sxid", pci="0000:05:00.0"), catalog)
    assert (sxid["sxid"], sxid["name"], sxid["action"]) == (12028, "SXID_12028", "reboot_node")
    assert "xid" not in sxid
    fallen = classify_event(xid(0, kind="fallen_off_bus"), catalog)
    assert (fallen["xid"], fallen["action"]) == (79, "reboot_node")


def test_explain_names_row_bucket_action_rule_and_steps():
    policy = Policy()
    text = explain(94, load_catalog(policy), policy)
    assert "ROBUST_CHANNEL_CONTAINED_ERROR" in text
    assert "RESTART_APP (investigatory: IGNORE (sympathetic))" in text
    assert "Our action: replace_node" in text
    assert "Decided by: the default policy replaces the node, where NVIDIA's catalog says RESTART_APP" in text
    assert "What to do:" in text and "nvidia-bug-report.sh" in text
    assert "docs/findings.md#gpu_xid" in text


def test_explain_override_and_unknown():
    policy = parse_policy({"xid": {13: "reset_gpu"}}, source="/etc/healthagent/policy.yaml")
    catalog = load_catalog(policy)
    text = explain(13, catalog, policy)
    assert "Our action: reset_gpu" in text
    assert "operator override" in text and "the catalog says restart_app" in text
    assert "/etc/healthagent/policy.yaml" in text
    unknown = explain(4242, catalog, policy)
    assert "UNKNOWN_XID_4242" in unknown and "Our action: monitor" in unknown


def test_explain_154_describes_the_text_rule():
    policy = Policy()
    text = explain(154, load_catalog(policy), policy)
    assert "Node Reboot Required' -> reboot_node" in text


@pytest.mark.parametrize("row", [r for r in ROWS if r["note"]], ids=lambda r: f"xid{r['xid']}")
def test_notes_speak_to_the_reader(row):
    """A note is what an operator reads in check, the Events and explain: what the default policy
    does and what NVIDIA's catalog says, never words meant for the people who wrote it."""
    for words in ("promise", "product", "departs"):
        assert words not in row["note"], row["note"]


def test_explain_what_to_do_names_no_unknown_gpu_and_never_itself():
    policy = Policy()
    catalog = load_catalog(policy)
    for number in (48, 74, 109, 154, 94, 13, 92):
        steps = explain(number, catalog, policy).split("What to do: ", 1)[1].split("\n", 1)[0]
        assert "unknown GPU" not in steps and "healthagent explain" not in steps, (number, steps)
    assert "the GPU that logged it" in explain(48, catalog, policy)
    assert "Node Reboot Required" in explain(154, catalog, policy).split("What to do: ", 1)[1]
