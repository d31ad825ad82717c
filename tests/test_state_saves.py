"""When the loop writes its state file (``Agent.cycle`` / ``Agent._persist``).

The contract (``healthagent/agent.py`` docstring): the decision is saved *before* effects act
(new XIDs, changed findings, an operator clear), anything else - counter histories, the kernel-log
cursor passing lines without an XID - at most every ``state_save_interval_seconds``, and always at
shutdown. Real parts: ``AgentRuntime`` on the demo host root, the real kernel-log source, state
store and classifier; the loop's clock is a variable so the interval is stepped, not waited for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from healthagent.wiring import AgentRuntime
from healthagent.demo.node import _append, _last_seq, kmsg_record
from tests.test_agent import demo_settings


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(tmp_path: Path):
    node, settings = demo_settings(tmp_path, state_save_interval_seconds="60")
    running = AgentRuntime(settings)
    clock = Clock(1_800_000_000.0)
    running.agent.clock = clock
    yield running.agent, node, clock, Path(settings.state_file)
    running.agent.shutdown(grace_seconds=5)
    running.server.stop()


def saved(path: Path) -> dict:
    return json.loads(path.read_bytes())


def append_noise(node, text: str = "eth0: link becomes ready") -> None:
    log = node.kernel_log.read_text(encoding="utf-8")
    _append(node.kernel_log, kmsg_record(6, _last_seq(log) + 1, 9_000_000_000, text))


def test_quiet_cycles_save_nothing_until_the_interval(setup):
    agent, node, clock, path = setup
    agent.cycle()
    assert agent.state_saves == 1 and path.exists()  # the first cycle is always saved
    first = path.read_bytes()
    for _ in range(30):  # 59 s of cycles: NVML/EFA collected every 10 s, kernel-log noise
        clock.now += 1.9
        append_noise(node)
        agent.cycle()
    assert agent.state_saves == 1
    assert path.read_bytes() == first
    clock.now += 3.0  # past 60 s since the save: the moved cursor (and histories) are saved
    agent.cycle()
    assert agent.state_saves == 2
    assert saved(path)["kmsg_cursor"] == agent.event_sources[0].cursor.to_dict()


def test_a_new_xid_is_saved_in_the_cycle_that_decides(setup):
    agent, node, clock, path = setup
    agent.cycle()
    clock.now += 1.0
    agent.cycle()
    before = agent.state_saves
    node.inject_xid(3, 79)
    clock.now += 1.0
    verdict = agent.cycle()
    assert any(79 in f.xids for f in verdict.findings)
    assert agent.state_saves == before + 1
    # On disk before effects see it: the cursor past the XID and the classifier holding it.
    state = saved(path)
    assert state["kmsg_cursor"] == agent.event_sources[0].cursor.to_dict()
    assert state["classifier"] == json.loads(json.dumps(agent.classifier.export_state()))
    # Nothing new next cycle: no write.
    clock.now += 1.0
    agent.cycle()
    assert agent.state_saves == before + 1


def test_shutdown_saves_what_the_interval_held_back(setup):
    agent, node, clock, path = setup
    agent.cycle()
    append_noise(node)
    clock.now += 1.0
    agent.cycle()
    cursor = agent.event_sources[0].cursor.to_dict()
    assert saved(path)["kmsg_cursor"] != cursor  # held back: only noise moved it
    agent.shutdown(grace_seconds=5)
    assert saved(path)["kmsg_cursor"] == cursor


def test_a_failed_save_is_tried_again_at_the_next_decision(setup, monkeypatch):
    agent, node, clock, path = setup
    agent.cycle()
    real_flush = agent.state.flush
    monkeypatch.setattr(agent.state, "flush", lambda: False)  # the disk refuses (counted inside)
    node.inject_xid(3, 79)
    clock.now += 1.0
    agent.cycle()
    saves = agent.state_saves
    current = json.loads(json.dumps(agent.classifier.export_state()))
    assert saved(path)["classifier"] != current  # the XID's finding is not on disk
    monkeypatch.setattr(agent.state, "flush", real_flush)
    clock.now += 10.0  # the next periodic collection re-decides with the same findings
    agent.cycle()
    assert agent.state_saves == saves + 1
    assert saved(path)["classifier"] == json.loads(json.dumps(agent.classifier.export_state()))


def test_the_interval_is_a_validated_setting(tmp_path):
    from healthagent.config import ConfigError

    with pytest.raises(ConfigError, match="state_save_interval_seconds"):
        demo_settings(tmp_path, state_save_interval_seconds="0")


def test_state_file_exists_after_the_first_cycle_even_when_healthy(setup):
    agent, _, _, path = setup
    assert not path.exists()
    agent.cycle()
    assert {"classifier", "boot_id"} <= set(saved(path))


def test_a_wall_clock_set_back_does_not_hold_the_periodic_save_for_the_jump(setup):
    """The interval is measured on the loop's clock; set back three hours, the held-back save
    is made at once (a negative interval is no reason to wait three hours), then paced again."""
    agent, node, clock, path = setup
    agent.cycle()
    append_noise(node)
    clock.now += 1.0
    agent.cycle()
    assert saved(path)["kmsg_cursor"] != agent.event_sources[0].cursor.to_dict()  # held back
    clock.now -= 3 * 3600.0
    agent.cycle()
    assert saved(path)["kmsg_cursor"] == agent.event_sources[0].cursor.to_dict()
    saves = agent.state_saves
    for _ in range(5):
        clock.now += 1.0
        append_noise(node)
        agent.cycle()
    assert agent.state_saves == saves  # paced by the interval again
