"""Event naming, bodies and the bounded ledger."""

import re

from healthagent.effects.events import (
    EventLedger,
    EventSpec,
    clip_note,
    escalation_event,
    event_body,
    event_name,
    finding_event,
    micro_time,
)
from healthagent.model import Action
from tests.effects.helpers import T0, finding

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def spec(key, at=T0):
    return EventSpec(key=key, type="Warning", reason="GPU_XID", action="Detected", note="n", at=at)


def test_event_name_is_deterministic_valid_and_distinct():
    a = event_name("ip-10-1-2-3.ec2.internal", "finding/GPU_XID/0000:53:00.0/1.000")
    assert a == event_name("ip-10-1-2-3.ec2.internal", "finding/GPU_XID/0000:53:00.0/1.000")
    assert a != event_name("ip-10-1-2-3.ec2.internal", "finding/GPU_XID/0000:53:00.0/2.000")
    assert DNS_SUBDOMAIN.match(a)
    long = event_name("n" * 300, "k")
    assert len(long) <= 253 and DNS_SUBDOMAIN.match(long)


def test_micro_time_has_six_digits_and_never_a_zero_fraction():
    assert micro_time(T0) == "2023-11-14T22:13:20.000001Z"
    assert micro_time(T0 + 0.25) == "2023-11-14T22:13:20.250000Z"


def test_note_is_clipped_to_the_api_limit_in_bytes():
    text = "é" * 1000  # two bytes each
    clipped = clip_note(text)
    assert len(clipped.encode("utf-8")) <= 1024 and clipped.endswith("...")
    assert clip_note("short") == "short"


def test_finding_event_and_body():
    f = finding()
    ev = finding_event(f, T0 + 1)
    assert (ev.key, ev.type, ev.reason, ev.action) == (f"finding/{f.key}", "Warning", "GPU_XID", "Detected")
    assert "[replace_node]" in ev.note and "Xid (PCI:0000:53:00): 95" in ev.note
    body = event_body(ev, "gpu-node-0", "uid-1")
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-0", "uid": "uid-1"}
    assert (body["reportingController"], body["reportingInstance"]) == ("healthagent.io/agent", "gpu-node-0")
    assert body["metadata"] == {"name": event_name("gpu-node-0", ev.key), "namespace": "default"}


def test_ledger_once_per_key_bounded_and_restored_tolerantly():
    ledger = EventLedger(max_emitted=3, max_outbox=2)
    ledger = ledger.want([spec("a"), spec("a"), spec("b")])
    assert [s.key for s in ledger.outbox] == ["a", "b"]
    ledger = ledger.want([spec("c")])  # over the outbox bound: the oldest is dropped and counted
    assert [s.key for s in ledger.outbox] == ["b", "c"] and ledger.dropped == 1
    for n, s in enumerate(ledger.outbox):
        ledger = ledger.delivered(s, T0 + n)
    before = ledger
    ledger = ledger.want([spec("b")])
    assert ledger.outbox == () and ledger == before  # delivered once, never again
    for n, key in enumerate(["d", "e", "f"]):
        ledger = ledger.delivered(spec(key), T0 + 10 + n)
    assert sorted(ledger.emitted) == ["d", "e", "f"]  # the oldest keys are forgotten first
    restored = EventLedger(**ledger.to_state())
    assert restored.emitted == ledger.emitted
    broken = EventLedger(emitted={"x": "not-a-time", "y": 1.0}, outbox=[{"key": "only"}, "junk"])
    assert broken.emitted == {"y": 1.0} and broken.outbox == ()


def test_finding_action_is_in_the_note():
    assert "[monitor]" in finding_event(finding(action=Action.MONITOR), T0).note


def test_escalation_event_names_both_actions_and_its_own_key():
    f = finding(action=Action.REPLACE_NODE)
    ev = escalation_event(f, Action.REBOOT_NODE, T0 + 2)
    assert (ev.key, ev.type, ev.reason, ev.action) == (
        f"finding/{f.key}/replace_node", "Warning", "GPU_XID", "Escalated")
    assert ev.note.startswith("[replace_node] escalated from reboot_node to replace_node: GPU_XID on ")
    assert "Evidence: NVRM: Xid (PCI:0000:53:00): 95" in ev.note and ev.at == T0 + 2
    # every (finding, action) has its own Event name: the first report, each escalation
    names = {event_name("n", s.key) for s in (finding_event(f, T0), ev,
                                               escalation_event(f, Action.MONITOR, T0))}
    assert len(names) == 2  # the escalation to replace_node is one Event whatever it came from
