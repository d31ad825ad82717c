"""DeadlineSource: a periodic source's ``collect`` can never hold the loop past its deadline.

The slow source here is real code that blocks on an Event (as a wedged driver call blocks), not a
mock of the wrapper's internals; the deadline is short only so the suite is quick, and nothing
asserts how long anything took: a stuck call stays stuck until the test releases it.
"""

from __future__ import annotations

import threading

import pytest

from healthagent.model import SourceHealth
from healthagent.sources.base import DeadlineSource
from tests.support.gated_source import LONG, GatedSource
from tests.support.wait import wait_for

SHORT = 0.05  # the deadline used where a call is meant to overrun it


def collect_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "healthagent-gated-collect"]


def test_an_answer_within_the_deadline_passes_through_unchanged():
    inner = GatedSource()
    source = DeadlineSource(inner, LONG)
    result = source.collect(1.0)
    assert result.health == SourceHealth(source="gated", up=True, detail="call 1", errors={"parse": 1})
    assert source.name == "gated" and not source.stuck


def test_a_hung_collect_reports_down_once_per_episode_and_starts_no_second_worker():
    inner = GatedSource()
    source = DeadlineSource(inner, SHORT)
    source.collect(1.0)  # one good answer: its error tally is the one to keep
    inner.gate.clear()
    try:
        answers = [source.collect(2.0 + n) for n in range(3)]
        for answer in answers:
            assert answer.health.up is False
            assert answer.health.detail.startswith("collect hung for ")
            assert answer.health.errors == {"parse": 1, "hung": 1}  # counted once, tally kept
            assert answer.gpus == () and answer.efa == () and answer.xids == ()
        assert inner.calls == 2  # the stuck call only: later calls started nothing
        # Any worker started while the gate is closed blocks for good, so "one thread" holds
        # only if no second worker was started (the first good call's thread may still be exiting).
        wait_for(lambda: len(collect_threads()) == 1, what="a single collect worker")
        assert source.stuck
    finally:
        inner.gate.set()
    wait_for(lambda: not source.stuck, what="the stuck call to return")
    recovered = source.collect(10.0)
    assert recovered.health.up is True and recovered.health.detail == "call 3"
    # Cumulative: the source's own kinds as it reports them now, plus the hung episode.
    assert recovered.health.errors == {"parse": 3, "hung": 1}
    # A second episode counts again.
    inner.gate.clear()
    try:
        assert source.collect(11.0).health.errors["hung"] == 2
    finally:
        inner.gate.set()


def test_an_exception_in_the_wrapped_collect_is_raised_to_the_caller():
    inner = GatedSource()
    inner.raise_next = ValueError("binding surprise")
    source = DeadlineSource(inner, LONG)
    with pytest.raises(ValueError, match="binding surprise"):
        source.collect(1.0)
    assert source.collect(2.0).health.up is True  # the next call is served normally


def test_close_does_not_wait_for_a_stuck_call_and_closes_when_it_returns():
    inner = GatedSource()
    source = DeadlineSource(inner, SHORT)
    inner.gate.clear()
    try:
        assert source.collect(1.0).health.up is False
        closer = threading.Thread(target=source.close)
        closer.start()
        closer.join(LONG)
        assert not closer.is_alive(), "close() blocked on the stuck worker"
        assert not inner.closed.is_set()  # closing under a stuck call would race it
    finally:
        inner.gate.set()
    assert inner.closed.wait(LONG)  # the worker closes the source once its call returned


def test_close_of_an_idle_source_closes_it_at_once():
    inner = GatedSource()
    source = DeadlineSource(inner, LONG)
    source.collect(1.0)
    source.close()
    assert inner.closed.is_set()


def test_what_only_the_wrapped_source_has_is_read_on_source_not_through_the_wrapper():
    inner = GatedSource()
    source = DeadlineSource(inner, LONG)
    assert source.source is inner
    assert source.source.take_events() == ["event"]
    # No proxy: a caller holding the wrapper cannot reach the driver past the deadline by accident.
    for name in ("take_events", "tally", "no_such_attribute"):
        with pytest.raises(AttributeError):
            getattr(source, name)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_the_deadline_must_be_positive(timeout):
    with pytest.raises(ValueError, match="timeout_seconds"):
        DeadlineSource(GatedSource(), timeout)
