"""Failed credentials per client address: a burst, then 429 until the bucket refills."""

from __future__ import annotations

import json

import pytest

from healthagent.training.access import job_token
from healthagent.training.throttle import FailureThrottle
from tests.telemetry.harness import start_agent
from tests.telemetry.test_server import KEY, post_as


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_one_a_second_per_address():
    clock = Clock()
    throttle = FailureThrottle(burst=3, per_second=1.0, clock=clock)
    for _ in range(3):
        assert throttle.retry_after("10.0.0.1") == 0
        throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == pytest.approx(1.0)
    assert throttle.retry_after("10.0.0.2") == 0  # another address is not held back
    clock.now += 0.5
    assert throttle.retry_after("10.0.0.1") == pytest.approx(0.5)
    clock.now += 0.5
    assert throttle.retry_after("10.0.0.1") == 0
    clock.now += 3600
    for _ in range(3):  # refilled to the burst, never above it
        throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") > 0


def test_the_addresses_remembered_are_bounded_and_the_fullest_forgotten():
    clock = Clock()
    throttle = FailureThrottle(burst=2, per_second=0.001, max_clients=3, clock=clock)
    throttle.failed("empty")
    throttle.failed("empty")
    for address in ("a", "b", "c", "d"):
        throttle.failed(address)
    assert throttle.clients == 3 and throttle.retry_after("empty") > 0  # the held-back one is kept


@pytest.mark.parametrize("bad", [dict(burst=0), dict(per_second=0), dict(max_clients=0)])
def test_nonsense_settings_are_refused(bad):
    with pytest.raises(ValueError):
        FailureThrottle(**bad)


def test_the_intake_answers_429_after_ten_failed_credentials_and_counts_it():
    agent = start_agent(intake="token", key=KEY)
    try:
        statuses = [post_as(agent, f"Bearer guess-{n}").status for n in range(10)]
        assert statuses == [401] * 10
        reply = post_as(agent, f"Bearer {job_token(KEY, 'j')}")  # even a right one: not looked at now
        assert reply.status == 429 and int(reply.headers["Retry-After"]) >= 1
        assert json.loads(reply.body)["reason"] == "rate_limited" and agent.intake.jobs() == []
        assert 'healthagent_training_reports_rejected_total{reason="rate_limited"} 1.0' in agent.scrape().text
        assert agent.request("/healthz").status == 200  # the agent's own port is not throttled
    finally:
        agent.server.stop()
