"""Another writer of a condition: noticed, left alone while it writes, released once quiet for
three of its longest gaps (at least a minute, at most the setting), noticed again when it returns."""

from __future__ import annotations

import pytest

from healthagent.effects.conditions import vocabulary
from healthagent.effects.other_writers import MIN_QUIET_SECONDS, OtherWriter, evidence_of, left_alone, track

EKS = vocabulary("eks")
T0 = 1_800_000_000.0
MAX_QUIET = 660.0


def node(heartbeat: str, reason: str = "NvidiaGPUIsReady", stamps: tuple[str, ...] | None = None) -> dict:
    cond = {"type": "AcceleratedHardwareReady", "status": "True", "reason": reason, "message": "active",
            "lastHeartbeatTime": heartbeat}
    meta: dict = {"name": "n"}
    if stamps is not None:
        meta["managedFields"] = [{"manager": "eks-node-monitoring-agent", "operation": "Update", "subresource": "status",
                                  "time": stamp, "fieldsV1": {"f:status": {"f:conditions": {
                                      'k:{"type":"AcceleratedHardwareReady"}': {"f:status": {}, "f:reason": {}}}}}}
                                 for stamp in stamps]
    return {"metadata": meta, "status": {"conditions": [cond]}}


@pytest.mark.parametrize("gap,quiet", [(0.0, MAX_QUIET), (5.0, MIN_QUIET_SECONDS), (100.0, 300.0), (300.0, MAX_QUIET)])
def test_the_quiet_time_is_three_of_the_longest_gaps_within_bounds(gap, quiet):
    writer = OtherWriter("AcceleratedHardwareReady", "r", "w", (), T0, longest_gap=gap)
    assert writer.quiet_seconds(MAX_QUIET) == quiet
    assert writer.quiet_seconds(30.0) == 30.0  # the setting below a minute bounds it


def run(looks: list[tuple[float, dict]]):
    writers: tuple = ()
    history = []
    for now, n in looks:
        writers, changes = track(writers, n, EKS, now, MAX_QUIET)
        history.append((now, left_alone(writers), [c.kind for c in changes]))
    return writers, history


def test_a_writer_every_5_s_is_left_alone_then_released_a_minute_after_it_stops():
    looks = [(T0 + 5 * k, node(f"hb-{k}")) for k in range(6)]  # writes every 5 s
    looks += [(T0 + 25 + 5 * k, node("hb-5")) for k in range(1, 15)]  # then silence
    _, history = run(looks)
    assert history[0][2] == ["noticed"] and all(h[1] == {"AcceleratedHardwareReady"} for h in history[:6])
    released = [now for now, _, kinds in history if kinds == ["released"]]
    assert released == [T0 + 25 + 60]
    assert all(h[1] == frozenset() for h in history if h[0] >= T0 + 85)


def test_a_writer_seen_once_waits_out_the_whole_maximum():
    _, history = run([(T0 + s, node("hb")) for s in (0, 300, 659, 660)])
    assert [kinds for _, _, kinds in history] == [["noticed"], [], [], ["released"]]


def test_a_released_writer_that_writes_again_is_noticed_again():
    looks = [(T0, node("a")), (T0 + MAX_QUIET, node("a")), (T0 + MAX_QUIET + 5, node("b"))]
    writers, history = run(looks)
    assert [kinds for _, _, kinds in history] == [["noticed"], ["released"], ["noticed"]]
    assert left_alone(writers) == {"AcceleratedHardwareReady"} and writers[0].longest_gap == MAX_QUIET + 5


def test_managed_fields_times_are_the_evidence_where_the_server_keeps_them():
    """Where the server keeps managedFields, the other manager's time is what moves; the condition's
    content, which the agent itself rewrites once it takes the condition back, is not looked at."""
    from healthagent.effects.conditions import foreign_conditions

    first = node("hb-1", stamps=("2026-11-26T10:00:00Z",))
    rewritten = node("hb-by-the-agent", reason="NvidiaXID94Error", stamps=("2026-11-26T10:00:00Z",))
    (a,), (b,) = foreign_conditions(first, EKS), foreign_conditions(rewritten, EKS)
    assert evidence_of(first, a) == evidence_of(rewritten, b)
    moved = node("hb-1", stamps=("2026-11-26T10:05:00Z",))
    (c,) = foreign_conditions(moved, EKS)
    assert evidence_of(moved, c) != evidence_of(first, a)


def test_a_condition_the_agent_writes_again_is_forgotten():
    writers, _ = run([(T0, node("a"))])
    ours = node("x", reason="AllChecksPassed")
    after, changes = track(writers, ours, EKS, T0 + 1, MAX_QUIET)
    assert after == () and changes == ()
