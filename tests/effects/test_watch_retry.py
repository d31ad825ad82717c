"""When a failed watch is tried again (``effects/watch_retry.py``), for the node watch and the
budget's: the policy itself, and the delays each watch draws against the fake API server over
real HTTP on 127.0.0.1. The watches wait through an injected ``pause`` that records each delay
and returns at once, and draw from an injected random source, so the tests assert the sequence of
delays, never a time on a clock.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from healthagent.common import ErrorTally
from healthagent.effects.backend import ApiBackend, ApiUnavailable, classify_status
from healthagent.effects.budget import FLEET, new_lease, slot_name
from healthagent.effects.budget_leases import LeaseStore
from healthagent.effects.budget_watch import SlotWatch
from healthagent.effects.node_watch import NodeCache, NodeWatch
from healthagent.effects.watch_retry import RetryPolicy, Run, retry_after
from tests.effects.budget_helpers import NAMESPACE
from tests.effects.helpers import wait_for
from tests.support.gated_source import LONG

NODE = "gpu-node-0"
SLOT_LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"


class Widest(random.Random):
    """Every jittered draw is the top of its window: the delays are the windows."""

    def uniform(self, a: float, b: float) -> float:
        return b


class Narrowest(random.Random):
    """Every jittered draw is the bottom of its window."""

    def uniform(self, a: float, b: float) -> float:
        return a


class Pauses:
    """The watch's ``pause``: records each delay and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, stopping: threading.Event, seconds: float) -> None:
        with self._lock:
            self.delays.append(round(seconds, 6))

    def snapshot(self) -> list[float]:
        with self._lock:
            return list(self.delays)


# -- the policy ------------------------------------------------------------------------------------------

def test_the_window_doubles_from_0_8_s_to_a_30_s_cap():
    policy = RetryPolicy()
    assert [policy.window(n) for n in range(9)] == [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0, 30.0]
    assert policy.window(10_000) == 30.0  # a failure run of days does not overflow


def test_after_a_live_stream_is_lost_every_window_is_at_least_the_spread():
    policy = RetryPolicy()
    assert [policy.window(n, lost=True) for n in range(7)] == [10.0, 10.0, 10.0, 10.0, 12.8, 25.6, 30.0]
    assert RetryPolicy(0.05, 0.5).window(0, lost=True) == 0.5  # the spread never exceeds the cap


def test_full_jitter_draws_anywhere_in_the_window_and_never_before_retry_after():
    policy = RetryPolicy()
    assert policy.delay(3, Narrowest()) == 0.0 and policy.delay(3, Widest()) == 6.4
    assert policy.delay(0, Narrowest(), retry_after=5) == 5.0  # Retry-After is a floor
    assert policy.delay(0, Widest(), retry_after=5) == 5.8  # the jitter goes on top of it


def test_a_fleet_cut_in_the_same_second_comes_back_spread_over_seconds():
    """10,000 agents lose their streams together: no second of the first retries holds more than
    an eighth of the fleet (uniform over 10 s: a tenth each)."""
    policy = RetryPolicy()
    first = Run().failed(opened=True)
    seconds = Counter(int(first.delay(policy, random.Random(i))) for i in range(10_000))
    assert first.lost and sorted(seconds) == list(range(10))
    assert max(seconds.values()) < 10_000 / 8


def test_a_run_of_failures_starts_again_only_after_a_stream_that_lived():
    run = Run().failed(opened=False)  # refused at the door: no spread
    assert run == Run(1, lost=False)
    run = run.failed(opened=True)  # answered, then cut within seconds: the same run goes on, spread
    assert run == Run(2, lost=True)
    assert Run(5).failed(opened=True, progressed=True) == Run(1, lost=True)  # a stream that lived, lost


def test_retry_after_is_read_from_a_429_reply():
    assert retry_after(classify_status(429, "TooManyRequests", "", 3.0)) == 3.0
    assert retry_after(classify_status(503, "ServiceUnavailable", "")) == 0.0
    assert retry_after(classify_status(403, "Forbidden", "")) == 0.0  # a rejection carries none
    assert isinstance(classify_status(429, "TooManyRequests", "", 3.0), ApiUnavailable)


# -- the node watch against the fake API server -----------------------------------------------------------

@pytest.fixture
def node_watch(fake):
    """A NodeWatch on gpu-node-0 over the fake, watching from a listed version, with recorded
    pauses; started by the test (``start()``) after it set up the fault."""
    fake.seed_nodes(3)
    made = []

    def make(rng: random.Random):
        pauses, tally = Pauses(), ErrorTally("kube")
        watch = NodeWatch(ApiBackend(fake.api_client(), NODE), NodeCache(), owned=lambda node: None,
                          on_change=lambda: None, tally=tally, rng=rng, pause=pauses)
        made.append(watch)
        return watch, pauses, tally

    yield make
    for watch in made:
        watch.stop()


def listed(fake) -> str:
    return str(fake.resource_version)


def test_a_watch_refused_with_403_after_a_restart_backs_off_exponentially_not_for_minutes(fake, node_watch):
    watch, pauses, tally = node_watch(Widest())
    fake.fail_next(4, status=403)
    watch.start(listed(fake))
    wait_for(lambda: len(fake.watches()) == 5 and fake.watches()[-1].status == 200 and watch.live, LONG,
             "the watch after four refusals")
    assert [r.status for r in fake.watches()] == [403, 403, 403, 403, 200]
    assert pauses.snapshot() == [0.8, 1.6, 3.2, 6.4]  # the windows: no 300 s wait
    assert tally.snapshot() == {"watch_rejected_403": 4}


def test_a_watch_answered_429_waits_at_least_its_retry_after(fake, node_watch):
    watch, pauses, tally = node_watch(Narrowest())
    fake.fail_next(2, status=429, retry_after=7)
    watch.start(listed(fake))
    wait_for(lambda: len(fake.watches()) == 3 and watch.live, LONG, "the watch after two 429s")
    assert pauses.snapshot() == [7.0, 7.0]  # the jitter's floor is the server's Retry-After
    assert tally.snapshot() == {"watch_unavailable": 2}


def test_a_live_stream_cut_comes_back_after_a_spread_delay(fake, node_watch):
    watch, pauses, tally = node_watch(Widest())
    watch.start(listed(fake))
    wait_for(lambda: fake.open_watches() == 1 and watch.live, LONG, "the watch")
    fake.drop_watches()
    wait_for(lambda: len(fake.watches()) == 2 and fake.open_watches() == 1, LONG, "the resumed watch")
    assert pauses.snapshot() == [10.0]  # the first retry is spread over the whole 10 s
    assert tally.snapshot() == {"watch_unavailable": 1}


def test_a_stream_the_server_ends_before_its_time_is_resumed_after_a_spread_delay(fake, node_watch):
    """The API server going away, or shedding watchers it cannot keep up with, ends streams
    cleanly but early: the watch goes down (the effects read meanwhile) and comes back spread."""
    watch, pauses, tally = node_watch(Widest())
    watch.start(listed(fake))
    wait_for(lambda: fake.open_watches() == 1 and watch.live, LONG, "the watch")
    fake.end_watches()
    wait_for(lambda: len(fake.watches()) == 2 and fake.open_watches() == 1, LONG, "the resumed watch")
    assert pauses.snapshot() == [10.0]
    assert fake.watches()[1].query["resourceVersion"] == fake.watches()[0].query["resourceVersion"]
    assert tally.snapshot() == {"watch_unavailable": 1}


def test_a_server_shedding_the_watch_again_and_again_meets_ever_longer_delays(fake, node_watch):
    """Streams that carry events but end within seconds each time (a server too busy to keep its
    watchers) are one run of failures: the delays grow to the cap instead of a re-open at once."""
    watch, pauses, tally = node_watch(Widest())
    watch.start(listed(fake))
    for opened in range(1, 7):
        wait_for(lambda: len(fake.watches()) == opened and fake.open_watches() == 1, LONG, f"watch {opened}")
        fake.update_node(NODE, lambda n: n["metadata"]["labels"].update({"step": str(opened)}))
        wait_for(lambda: watch.resume_version == str(fake.resource_version), LONG, "the event")
        fake.end_watches()
    wait_for(lambda: len(fake.watches()) == 7, LONG, "the seventh watch")
    assert pauses.snapshot() == [10.0, 10.0, 10.0, 10.0, 12.8, 25.6]
    assert tally.snapshot() == {"watch_unavailable": 6}


def test_a_stream_that_runs_its_full_term_is_followed_at_once(fake, node_watch):
    pauses, tally = Pauses(), ErrorTally("kube")
    watch = NodeWatch(ApiBackend(fake.api_client(), NODE), NodeCache(), owned=lambda node: None,
                      on_change=lambda: None, tally=tally, rng=Widest(), pause=pauses, timeout_seconds=(1, 1))
    try:
        watch.start(listed(fake))
        wait_for(lambda: len(fake.watches()) >= 3, LONG, "two watches after their timeoutSeconds")
        assert pauses.snapshot() == [] and tally.snapshot() == {}
    finally:
        watch.stop()


# -- the budget's watch -----------------------------------------------------------------------------------

def test_the_budget_watch_backs_off_the_same_way(fake):
    fake.seed_nodes(3)
    pauses, tally = Pauses(), ErrorTally("kube")
    watch = SlotWatch(LeaseStore(ApiBackend(fake.api_client(), NODE), NAMESPACE), node_name=NODE, tally=tally,
                      rng=Widest(), pause=pauses)
    fake.fail_next(3, status=403)
    try:
        watch.follow(FLEET)
        wait_for(lambda: len(fake.watches(SLOT_LEASES)) == 4 and fake.open_watches() == 1, LONG,
                 "the slot watch after three refusals")
        assert pauses.snapshot() == [0.8, 1.6, 3.2]
        fake.put_lease(NAMESPACE, new_lease(slot_name(0), NAMESPACE, "slot"))  # a free slot: the stream is live
        wait_for(watch.freed.is_set, LONG, "the free slot heard")
        fake.fail_next(1, status=429, retry_after=4)
        fake.drop_watches()  # a live stream lost, and the first retry answered 429
        wait_for(lambda: len(fake.watches(SLOT_LEASES)) == 6 and fake.open_watches() == 1, LONG,
                 "the slot watch after the cut and the 429")
        assert pauses.snapshot()[3:] == [10.0, 16.8]  # the run goes on, spread; then Retry-After + 12.8
        assert tally.snapshot() == {"watch_rejected_403": 3, "watch_unavailable": 2}
    finally:
        watch.stop()
