"""The state file's cap never costs a node action: a state over ``max_bytes`` is written without
its mildest findings (counted ``trimmed``), never without a ``reboot_node`` or ``replace_node``
finding; only a state whose severe findings alone pass the cap is not written. A real file under
a tmp directory, read back by a fresh store and restored into a real classifier.
"""

from __future__ import annotations

from healthagent.config import load_settings
from healthagent.effects.state import StateStore
from healthagent.model import Action, Collection, XidEvent
from healthagent.wiring import build_classifier

NOW = 1_800_000_000.0


def classifier_with(mild: int, severe: list[int]):
    """A classifier whose book holds ``mild`` restart_app incidents (XID 13 on GPUs no NVML lists)
    and one incident per XID in ``severe``, on PCI ids of their own."""
    classifier = build_classifier(load_settings(env={}, flags={}))
    xids = [XidEvent(xid=13, pci_bus_id=f"0000:{n:02x}:00.0", message="x" * 2000, line="", timestamp=NOW - 100 + n,
                     source="kmsg") for n in range(mild)]
    xids += [XidEvent(xid=x, pci_bus_id=f"0001:{n:02x}:00.0", message="", line="", timestamp=NOW - 200, source="kmsg")
             for n, x in enumerate(severe)]
    classifier.observe(Collection(timestamp=NOW, xids=tuple(xids)))
    return classifier


def actions(state: dict) -> list[str]:
    return sorted(e["action"] for e in state["classifier"]["book"]["entries"].values())


def test_over_the_cap_the_mildest_findings_are_left_out_and_the_severe_ones_written(tmp_path):
    classifier = classifier_with(mild=40, severe=[94, 79])
    store = StateStore(tmp_path / "state.json", max_bytes=20_000)
    store.put("kmsg_cursor", {"seq": 7})
    store.put("classifier", classifier.export_state())
    assert len(actions(store.snapshot())) == 42
    assert store.flush()
    assert (tmp_path / "state.json").stat().st_size <= 20_000
    saved = StateStore(tmp_path / "state.json", max_bytes=20_000).load()
    assert {"reboot_node", "replace_node"} <= set(actions(saved))
    assert len(actions(saved)) < 42 and saved["kmsg_cursor"] == {"seq": 7}
    assert store.errors.get("trimmed") == 1 and "too_large" not in store.errors
    restored = build_classifier(load_settings(env={}, flags={}))
    restored.restore_state(saved["classifier"])
    verdict = restored.observe(Collection(timestamp=NOW + 1)).verdict
    assert verdict.action is Action.REPLACE_NODE
    assert len(actions(store.snapshot())) == 42  # the state in memory stays whole
    assert store.flush() and store.errors.get("trimmed") == 1  # unchanged: not trimmed nor written again


def test_a_state_whose_severe_findings_alone_pass_the_cap_is_not_written(tmp_path):
    store = StateStore(tmp_path / "state.json", max_bytes=600)
    store.put("classifier", classifier_with(mild=0, severe=[94, 79, 94]).export_state())
    assert not store.flush()
    assert not (tmp_path / "state.json").exists()
    assert "too_large" in store.errors
