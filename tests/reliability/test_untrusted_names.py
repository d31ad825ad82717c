"""Names that come from text are bounded: a kernel log naming 6,000 ConnectX adapters is a bounded
number of series and findings, bounded memory, a state file under its cap, and the XID 94 that
follows is still saved and survives a restart. Real parts: the kernel-log source over a host
root's dev/kmsg, the classifier, the loop (``AgentRuntime``, dry-run), the state file.
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from pathlib import Path

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from healthagent.agent import AdapterTally
from healthagent.bounded_names import (MLX5_ADAPTERS, OVERFLOW, SXID_SWITCHES, XID_UNMATCHED_PCI, NameBound,
                                       keep_first)
from healthagent.config import load_settings
from healthagent.effects.state import DEFAULT_MAX_BYTES
from healthagent.model import Action, AdapterEvent, Collection, XidEvent
from healthagent.policy.adapters import ADAPTER_EVENT
from healthagent.wiring import AgentRuntime, build_classifier
from tests.support.kmsg_host import make_host, record, xid_text

NAMES = 6_000
MEMORY_NAMES = 1_500  # well past MLX5_ADAPTERS (256), small enough to trace cheaply
PCIS = [f"{1 + i // 256:04x}:{i % 256:02x}:00.0" for i in range(2 * NAMES)]


def fatal(pci: str) -> str:
    return f"mlx5_core {pci}: poll_health:785:(pid 0): Fatal error 1 detected"


def settings_for(host: Path, state: Path):
    return load_settings(env={}, flags={
        "host_root": str(host), "kube": "dry-run", "listen": "127.0.0.1:0", "nvml": "false",
        "state_file": str(state), "node_name": "n1", "training_intake": "off"})


def families(running: AgentRuntime) -> dict[str, list]:
    text = generate_latest(running.telemetry.registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_6000_adapters_are_bounded_series_and_findings_and_the_xid_94_after_them_survives_a_restart(tmp_path):
    usec = int(time.monotonic() * 1e6)  # stamped as the kernel stamps /dev/kmsg: now, on the decision clock
    text = "".join(record(n + 1, fatal(pci), usec=usec + n, priority=3) for n, pci in enumerate(PCIS[:NAMES]))
    text += record(NAMES + 1, xid_text(94), usec=usec + NAMES, priority=3)
    host = make_host(tmp_path / "host", kmsg_text=text)
    state = tmp_path / "state.json"
    running = AgentRuntime(settings_for(host, state))
    try:
        verdict = running.agent.cycle()
        adapters = [f for f in verdict.findings if f.code == ADAPTER_EVENT]
        assert len(adapters) == MLX5_ADAPTERS + 1
        [folded] = [f for f in adapters if f.subject == OVERFLOW]
        assert folded.action is Action.REBOOT_NODE  # the worst of what it folded, never escalated
        assert folded.count == NAMES - MLX5_ADAPTERS
        assert verdict.action is Action.REPLACE_NODE
        assert [(f.code, f.action) for f in verdict.findings if f.code == "GPU_XID"] == [("GPU_XID",
                                                                                          Action.REPLACE_NODE)]
        exported = families(running)
        assert len(exported["healthagent_mlx5_events"]) == MLX5_ADAPTERS + 1
        assert {s.labels["source"]: s.value for s in exported["healthagent_names_folded"]}["mlx5_adapter"] \
            == NAMES - MLX5_ADAPTERS
        assert 0 < state.stat().st_size < DEFAULT_MAX_BYTES // 4
        assert "too_large" not in running.agent.state.errors
    finally:
        running.agent.shutdown(grace_seconds=5)
        running.server.stop()
    restarted = AgentRuntime(settings_for(host, state))
    try:
        again = restarted.agent.cycle()
        assert [(f.code, f.action) for f in again.findings if f.code == "GPU_XID"] == [("GPU_XID",
                                                                                        Action.REPLACE_NODE)]
        assert again.action is Action.REPLACE_NODE
    finally:
        restarted.agent.shutdown(grace_seconds=5)
        restarted.server.stop()


def adapter_events(pcis: list[str], t: float) -> tuple[AdapterEvent, ...]:
    return tuple(AdapterEvent(event="fatal_error", pci_bus_id=pci, message=fatal(pci), line=fatal(pci),
                              timestamp=t, source="kmsg") for pci in pcis)


def test_memory_and_the_saved_state_stop_growing_at_the_bound():
    """The classifier and the counter's tally hold as much after 3,000 distinct names as after
    1,500 (the bound is 256): past the bound, a new name costs a count, not memory."""
    classifier = build_classifier(load_settings(env={}, flags={}))
    tally = AdapterTally()
    now = 1_800_000_000.0

    def feed(pcis: list[str]) -> None:
        for start in range(0, len(pcis), 500):
            assessment = classifier.observe(Collection(timestamp=now, boot_id="b1",
                                                       adapter_events=adapter_events(pcis[start:start + 500], now)))
            tally.add(assessment.adapter_events)

    tracemalloc.start()
    try:
        feed(PCIS[:MEMORY_NAMES])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        saved = len(json.dumps(classifier.export_state()))
        feed(PCIS[MEMORY_NAMES:2 * MEMORY_NAMES])
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - held
    finally:
        tracemalloc.stop()
    assert len(json.dumps(classifier.export_state())) <= saved * 1.05
    assert grown < 64 * 1024, grown  # 1,500 more names: far less than one finding's evidence each
    assert len(tally.counts) == MLX5_ADAPTERS + 1


def test_xids_of_pci_ids_no_gpu_has_and_sxids_fold_under_their_own_bounds():
    classifier = build_classifier(load_settings(env={}, flags={}))
    now = 1_800_000_000.0
    xids = [XidEvent(xid=13, pci_bus_id=pci, message="", line="", timestamp=now, source="kmsg")
            for pci in PCIS[:XID_UNMATCHED_PCI + 50]]
    xids.append(XidEvent(xid=94, pci_bus_id=PCIS[XID_UNMATCHED_PCI + 60], message="", line="", timestamp=now,
                         source="kmsg"))
    sxids = [XidEvent(xid=20034, pci_bus_id=pci, message="", line="", timestamp=now, source="kmsg", kind="sxid")
             for pci in PCIS[:SXID_SWITCHES + 10]]
    assessment = classifier.observe(Collection(timestamp=now, xids=tuple(xids + sxids)))
    subjects = {(f.code, f.subject) for f in assessment.verdict.findings}
    assert len([s for s in subjects if s[0] == "GPU_XID"]) == XID_UNMATCHED_PCI + 1
    assert len([s for s in subjects if s[0] == "NVSWITCH_SXID"]) == SXID_SWITCHES + 1
    [overflow] = [f for f in assessment.verdict.findings if f.code == "GPU_XID" and f.subject == OVERFLOW]
    assert overflow.action is Action.REPLACE_NODE  # the XID 94 folded in is not lost
    assert {x.pci_bus_id for x in assessment.counted_xids} <= set(PCIS[:XID_UNMATCHED_PCI + 10]) | {OVERFLOW}


def test_the_bound_keeps_the_first_names_and_folds_the_rest():
    bound = NameBound("test_source", 2)
    assert [bound.admit(n) for n in ("a", "b", "a", "c", "", "b", "d")] == ["a", "b", "a", OVERFLOW, "", "b",
                                                                             OVERFLOW]
    assert bound.folded == 2
    bound.forget()  # an operator's clear: the names start again, the fold count stays a total
    assert bound.admit("e") == "e" and bound.folded == 2
    assert keep_first(range(5), 3) == ([0, 1, 2], [3, 4])


def test_xid_numbers_no_catalog_names_fold_and_a_known_one_after_them_still_acts():
    """A log inventing 500 XID numbers: the unmapped ones past the bound are one ``~other`` series
    (monitor, as each was), while the catalog's XID 94 after them keeps its number and its action."""
    from healthagent.bounded_names import UNMAPPED_NUMBERS
    from healthagent.model import AgentSnapshot, XidCount
    from healthagent.telemetry.metrics import render_snapshot

    classifier = build_classifier(load_settings(env={}, flags={}))
    now = 1_800_000_000.0
    invented = [XidEvent(xid=100_000 + n, pci_bus_id="0000:a8:00.0", message="", line="", timestamp=now,
                         source="kmsg") for n in range(500)]
    real = XidEvent(xid=94, pci_bus_id="0000:a8:00.0", message="", line="", timestamp=now, source="kmsg")
    assessment = classifier.observe(Collection(timestamp=now, xids=tuple(invented) + (real,)))
    numbers = {x.xid for x in assessment.counted_xids}
    assert len(numbers) == UNMAPPED_NUMBERS + 2 and 94 in numbers
    assert assessment.verdict.action is Action.REPLACE_NODE
    counts = tuple(XidCount(xid=x.xid, count=1, pci_bus_id=x.pci_bus_id) for x in assessment.counted_xids)
    [family] = [f for f in render_snapshot(AgentSnapshot(timestamp=now, xid_counts=counts)) if f.name == "healthagent_xid_errors"]
    labels = {s.labels["xid"] for s in family.samples if s.name.endswith("_total")}
    assert len(labels) == UNMAPPED_NUMBERS + 2 and {"94", OVERFLOW} <= labels


def test_gpu_uuids_no_gpu_has_fold_too():
    """A fallen-off-the-bus line names its GPU's UUID: made-up UUIDs of GPUs NVML does not list are
    label values too (``xid_errors_total{uuid}``), bounded with the unmatched PCI ids."""
    classifier = build_classifier(load_settings(env={}, flags={}))
    now = 1_800_000_000.0
    uuids = [f"GPU-{n:08x}-0000-0000-0000-000000000000" for n in range(XID_UNMATCHED_PCI + 40)]
    xids = tuple(XidEvent(xid=79, pci_bus_id="", uuid=uuid, message="", line="", timestamp=now, source="kmsg",
                          kind="fallen_off_bus") for uuid in uuids)
    assessment = classifier.observe(Collection(timestamp=now, xids=xids))
    assert len({x.uuid for x in assessment.counted_xids}) == XID_UNMATCHED_PCI + 1
    assert assessment.verdict.action is Action.REBOOT_NODE  # XID 79's, folded or not
