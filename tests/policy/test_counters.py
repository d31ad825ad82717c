"""Cumulative counter histories: what ``CounterSeries`` keeps, and which values count as numbers."""

import enum
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthagent.policy.counters import MAX_POINTS, CounterSeries, finite, rate_over


def kept_by_the_rule(points: list[tuple[float, float]], now: float, horizon: float) -> list[tuple[float, float]]:
    """The documented rule, written out plainly: the points inside the horizon plus the latest one
    at or before it (the window's baseline), at most ``MAX_POINTS`` of the newest."""
    at_or_before = [i for i, (t, _) in enumerate(points) if t <= now - horizon]
    kept = points[at_or_before[-1]:] if at_or_before else list(points)
    return kept[-MAX_POINTS:]


steps = st.lists(st.tuples(st.floats(min_value=-50, max_value=400, allow_nan=False),
                           st.integers(min_value=0, max_value=40)), max_size=120)


@settings(max_examples=200, deadline=None)
@given(steps=steps, horizon=st.sampled_from([0.0, 1.0, 30.0, 60.0, 600.0]))
def test_the_history_keeps_what_the_rule_says_after_every_sample(steps, horizon):
    series, t, value = CounterSeries(), 1000.0, 0
    for dt, grow in steps:  # times mostly forward, sometimes back; values mostly up, sometimes reset
        t += dt
        value = value + grow if grow < 35 else grow  # a reset now and then
        before = list(series.points)
        growth = series.add(t, value, horizon)
        if growth is None:
            assert series.points == before
            continue
        if growth.seconds == 0.0 and before and (growth.reset or t < before[-1][0]):
            assert series.points == [(t, float(value))]  # a reset or a clock step starts again
            continue
        assert series.points == kept_by_the_rule(before + [(t, float(value))], t, horizon)


def test_the_history_is_bounded_whatever_the_sample_rate():
    series = CounterSeries()
    for i in range(3 * MAX_POINTS):
        series.add(1000.0 + i * 0.001, i, 3600.0)
    assert len(series.points) == MAX_POINTS and series.points[-1][1] == 3 * MAX_POINTS - 1


class Level(enum.IntEnum):
    ONE = 1


@pytest.mark.parametrize("value,expected", [
    (0, True), (2**64 - 1, True), (-3, True), (1.5, True), (Level.ONE, True),
    (math.nan, False), (math.inf, False), (-math.inf, False), (True, False), (False, False),
    (None, False), ("5", False), (b"5", False), ([5], False),
])
def test_finite_is_a_real_number_only(value, expected):
    assert finite(value) is expected


def test_rate_over_says_when_a_counter_grew_faster_than_its_limit():
    series = CounterSeries()
    assert rate_over(series, 1000.0, 0.0, 60.0, 100.0) is None  # the first sample: no rate yet
    assert rate_over(series, 1030.0, 60.0, 60.0, 100.0) is None  # +60 in 30 s: within 100 a minute
    assert rate_over(series, 1030.0, 500.0, 60.0, 100.0) is None  # the same time again says nothing new
    assert rate_over(series, 1060.0, 250.0, 60.0, 100.0) == (250.0, 60.0)  # +250 in a minute


def test_a_sum_whose_parts_change_is_a_new_baseline_never_growth():
    series = CounterSeries()
    both, one = ("link_error_recovery", "local_link_integrity_errors"), ("link_error_recovery",)
    assert series.add(0.0, 212.0, 600.0, both).increase == 0.0
    lost = series.add(10.0, 200.0, 600.0, one)  # one part unreadable for a reading
    assert lost.reset and lost.increase == 0.0
    back = series.add(20.0, 212.0, 600.0, both)  # the part back: +12 would be a false rate
    assert back.reset and back.increase == 0.0
    assert series.add(30.0, 215.0, 600.0, both).increase == 3.0
    again = CounterSeries.from_dict(series.to_dict())
    assert again.basis == both and again.add(40.0, 216.0, 600.0, both).increase == 1.0


@pytest.mark.parametrize("basis", [7, "link_downed", {"a": 1}, None])
def test_a_saved_basis_that_is_no_list_is_dropped(basis):
    assert CounterSeries.from_dict({"points": [[1.0, 2.0]], "basis": basis}).basis == ()
