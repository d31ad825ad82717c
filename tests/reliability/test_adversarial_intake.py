"""A hostile client against the training intake, through the real HTTP server on 127.0.0.1.

Two shapes of input a pod that can reach the intake may send on purpose:

- a body nested past what the JSON decoder can recurse into (60,000 ``[``): the reply is a 400
  that names the problem (``malformed_json``), never a 500 or an "internal error", and the
  agent's error tally stays clean;
- 20,000 distinct job names, each new name evicting the least recently active job: eviction is
  counted in full, but the log gets one WARNING line per kind per minute (as every other
  rate-limited part of the agent), not one line per name.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import pytest

from healthagent.training.schema import MAX_BATCH
from tests.telemetry.harness import RunningAgent, start_agent

pytestmark = [pytest.mark.reliability, pytest.mark.integration]


@pytest.fixture
def agent():
    running = start_agent(intake="open")
    yield running
    running.server.stop()


def post(agent: RunningAgent, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(agent.intake_url + "/v1/training", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metric(agent: RunningAgent, sample: str) -> float:
    for line in agent.scrape().text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not exported")


def test_a_body_nested_60000_deep_is_malformed_json_not_an_internal_error(agent):
    status, reply = post(agent, b"[" * 60_000)
    assert status == 400
    assert reply["reason"] == "malformed_json" and reply["accepted"] == 0
    assert "nested" in reply["error"] and "internal" not in reply["error"]
    assert agent.server.errors == {}  # no handler failure (a 500) was counted
    assert metric(agent, 'healthagent_training_reports_rejected_total{reason="malformed_json"}') == 1
    assert post(agent, b'{"type":"end","job":"after"}')[0] == 202  # the intake still works


def test_20000_distinct_job_names_log_one_eviction_warning_not_one_per_name(agent, caplog):
    max_jobs = agent.intake.max_jobs
    names = [f"job-{n:05d}" for n in range(20_000)]
    with caplog.at_level(logging.INFO, logger="healthagent"):
        for first in range(0, len(names), MAX_BATCH):
            batch = [{"type": "end", "job": name} for name in names[first:first + MAX_BATCH]]
            status, reply = post(agent, json.dumps(batch).encode())
            assert (status, reply["accepted"]) == (202, len(batch))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings[:5]
    assert "evicted" in warnings[0] and "total=1 " in warnings[0]
    # Every eviction is still counted, and the newest jobs are the ones kept.
    assert metric(agent, "healthagent_training_jobs_evicted_total") == len(names) - max_jobs
    assert agent.intake.jobs() == names[-max_jobs:]
