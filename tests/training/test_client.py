"""The client ranks import: never blocks, never raises, bounded, and delivers when the agent is back.

Everything runs against real HTTP servers on 127.0.0.1: the agent's own server (stopped and
restarted on the same port) and a TCP server that accepts connections and never answers (a wedged
agent, shared with the benchmark). Non-blocking is shown structurally: all calls return while the sender is stuck inside a
request, and the queue bound caps what was accepted. Latency figures live in
bench/bench_training_client.py, not here.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.bench_training_client import NeverAnswers
from healthagent.training.access import job_token
from healthagent.training.client import (
    TrainingReporter,
    agent_base_url,
    default_job,
)
from tests.support.wait import wait_for
from tests.telemetry.harness import RunningAgent, start_agent

REPO = Path(__file__).resolve().parents[2]
STEPS = 10_000


def steps_counted(agent: RunningAgent, job: str = "llama") -> int:
    line = f'healthagent_training_steps_total{{job="{job}"}} '
    for row in agent.scrape().text.splitlines():
        if row.startswith(line):
            return int(float(row[len(line):]))
    return 0


@pytest.mark.integration
def test_ten_thousand_steps_through_an_agent_stop_and_restart():
    first = start_agent()
    port = first.server.intake_port
    reporter = TrainingReporter(job="llama", url=first.intake_url, rank=0, world_size=8, queue_size=2000,
                                batch_size=200, timeout_seconds=5.0, min_backoff_seconds=0.01,
                                max_backoff_seconds=0.05)
    stopped, restarted = threading.Event(), threading.Event()
    phase_one_done, phase_two_done = threading.Event(), threading.Event()
    returned: list[bool] = []
    raised: list[BaseException] = []

    def training_loop() -> None:
        try:
            for n in range(STEPS):
                if n == 3000:
                    phase_one_done.set()
                    assert stopped.wait(60)
                if n == 7000:
                    phase_two_done.set()
                    assert restarted.wait(60)
                returned.append(reporter.report_step(n, tokens=4096, samples=8, step_seconds=0.5))
        except BaseException as exc:  # the client must never raise into the loop
            raised.append(exc)

    loop = threading.Thread(target=training_loop)
    loop.start()
    second = None
    try:
        assert phase_one_done.wait(60)
        wait_for(lambda: steps_counted(first) > 0, what="the first agent to count steps")
        first.server.stop()
        stopped.set()
        assert phase_two_done.wait(60)  # 4,000 steps reported while nothing listens
        # On a loaded machine the sender thread may not have run yet: let it meet the outage
        # before the agent comes back (a bound on a hang, not a timing).
        wait_for(lambda: reporter.stats().send_errors >= 1, timeout=120,
                 what="the sender to notice the stopped agent")
        second = start_agent(intake_port=port)  # the restarted agent listens where the first one did
        restarted.set()
        loop.join(120)
        assert not loop.is_alive()
        wait_for(lambda: reporter.stats().pending == 0, what="the backlog to drain")
        for n in range(STEPS, STEPS + 10):  # later reports arrive at the restarted agent
            assert reporter.report_step(n, tokens=4096, samples=8, step_seconds=0.5)
        wait_for(lambda: second.intake.jobs() == ["llama"] and steps_counted(second) > 0)
        reporter.close(timeout=30)
        last_step = [row for row in second.scrape().text.splitlines()
                     if row.startswith('healthagent_training_last_step_timestamp_seconds{job="llama"}')]
        assert last_step, "the restarted agent has the job"
        stats = reporter.stats()
        counted = steps_counted(second)
    finally:
        first.server.stop()
        if second is not None:
            second.server.stop()

    assert raised == []
    assert len(returned) == STEPS
    assert stats.pending == 0 and stats.rejected == 0 and stats.failed == 0
    assert stats.delivered + stats.dropped == STEPS + 10  # every report is accounted for
    assert stats.dropped >= 4000 - 2000 - 200  # the queue stayed bounded while the agent was down
    assert stats.send_errors >= 1  # it noticed the outage and backed off
    assert counted >= 10  # the last ten at least, counted by the new agent


@pytest.mark.integration
def test_calls_return_while_the_sender_is_wedged_in_a_request():
    wedged = NeverAnswers()
    reporter = TrainingReporter(job="llama", url=f"http://127.0.0.1:{wedged.port}", rank=0, world_size=8,
                                queue_size=100, batch_size=10, timeout_seconds=60.0)
    try:
        assert reporter.report_step(0, step_seconds=1.0)
        assert wedged.request_seen.wait(30), "the sender never reached the wedged agent"
        results = [reporter.report_step(n, step_seconds=1.0) for n in range(1, STEPS + 1)]
        # Every call returned although the sender is still blocked inside that first request.
        assert len(wedged.connections) == 1
        assert sum(results) <= 100  # the queue bound: the rest were dropped, not buffered
        stats = reporter.stats()
        assert stats.dropped == STEPS - sum(results)
        assert stats.delivered == 0
        reporter.close(timeout=0.2)  # returns although the sender cannot finish
        assert reporter.report_step(99_999, step_seconds=1.0) is False  # closed: dropped, no raise
    finally:
        wedged.close()


def test_a_down_agent_costs_nothing_but_drops():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens here once the probe is closed
    reporter = TrainingReporter(job="j", url=f"http://127.0.0.1:{port}", queue_size=10, batch_size=5,
                                min_backoff_seconds=0.01, max_backoff_seconds=0.02)
    results = [reporter.report_step(n, step_seconds=0.1) for n in range(1000)]
    wait_for(lambda: reporter.stats().send_errors >= 2, what="two failed attempts")
    reporter.close(timeout=5)
    stats = reporter.stats()
    assert sum(results) <= 10 + 5
    assert stats.delivered == 0 and stats.pending == 0
    assert stats.dropped == 1000  # queued ones are dropped at close when the agent never came


@pytest.mark.integration
def test_rejected_reports_are_counted_not_retried(agent):
    reporter = TrainingReporter(job="bad\tjob", url=agent.intake_url, rank=0, world_size=2)
    reporter.report_step(1, step_seconds=1.0)
    reporter.report_step(2, step_seconds=1.0, job="good")
    reporter.close(timeout=30)
    stats = reporter.stats()
    assert (stats.delivered, stats.rejected, stats.pending) == (1, 1, 0)
    assert agent.intake.jobs() == ["good"]


@pytest.mark.integration
def test_every_report_kind_reaches_the_agent(agent):
    reporter = TrainingReporter(job="llama", url=agent.intake_url, rank=3, world_size=16)
    assert reporter.report_rendezvous(16, reason="scale_up")
    assert reporter.report_step(1, tokens=100, samples=2, step_seconds=1.5)
    assert reporter.report_step(2, tokens=100, samples=2)  # timed by the client
    assert reporter.report_rendezvous(24, reason="hpa")
    assert reporter.report_end()
    reporter.close(timeout=30)
    assert reporter.stats().delivered == 5
    text = agent.scrape().text
    assert 'healthagent_training_steps_total{job="llama"} 2.0' in text
    assert 'healthagent_training_world_size{job="llama"} 24.0' in text
    assert 'healthagent_scaling_events_total{direction="up",job="llama",reason="capacity"} 1.0' in text
    assert 'healthagent_training_rendezvous_total{job="llama"} 2.0' in text


@pytest.mark.parametrize("args", [
    {"step": "seven"},
    {"step": 1, "tokens": object()},
    {"step": 1, "step_seconds": "fast"},
    {"step": 1, "rank": [0]},
])
def test_bad_arguments_return_false_and_are_counted(args):
    reporter = TrainingReporter(job="j", url="http://127.0.0.1:9", queue_size=10)
    try:
        assert reporter.report_step(**args) is False
        assert reporter.stats().dropped == 1
    finally:
        reporter.close(timeout=0.1)


def test_unusable_constructor_arguments_fall_back_to_defaults():
    reporter = TrainingReporter(job="j", url="http://127.0.0.1:9", rank="zero", world_size=None,
                                queue_size="big", timeout_seconds=object(), env={"WORLD_SIZE": "x"})
    try:
        assert (reporter.rank, reporter.world_size, reporter.queue_size, reporter.timeout_seconds) == (
            0, 1, 10_000, 1.0)
        assert reporter.report_step(1, step_seconds=1.0) is True
    finally:
        reporter.close(timeout=0.1)


def test_the_first_auto_timed_step_reports_zero_seconds():
    reporter = TrainingReporter(job="j", url="http://127.0.0.1:9", queue_size=10, batch_size=1,
                                timeout_seconds=0.01)
    try:
        reporter._closing.set()  # keep reports in the queue where the test can read them
        reporter._sender.join(5)
        reporter.report_step(1)
        reporter.report_step(2)
        first, second = reporter._queue.get_nowait(), reporter._queue.get_nowait()
        assert first["step_seconds"] == 0.0
        assert second["step_seconds"] >= 0.0 and second["type"] == "step"
        assert first["rank"] == 0 and first["world_size"] == 1 and first["job"] == "j"
    finally:
        reporter.close(timeout=0.1)


@pytest.mark.parametrize("env,url", [
    ({"HEALTHAGENT_URL": "http://10.1.2.3:9999/", "HEALTHAGENT_HOST_IP": "10.9.9.9"}, "http://10.1.2.3:9999"),
    ({"HEALTHAGENT_HOST_IP": "10.0.0.5"}, "http://10.0.0.5:9412"),
    ({"HEALTHAGENT_HOST_IP": "fd00::5"}, "http://[fd00::5]:9412"),
    ({}, "http://127.0.0.1:9412"),
])
def test_agent_url_from_the_environment(env, url):
    assert agent_base_url(env) == url
    reporter = TrainingReporter(env=env, url=None)
    try:
        assert reporter.endpoint == url + "/v1/training"
    finally:
        reporter.close(timeout=0.1)


@pytest.mark.parametrize("env,job", [
    ({"HEALTHAGENT_JOB": "llama", "TORCHELASTIC_RUN_ID": "abc"}, "llama"),
    ({"TORCHELASTIC_RUN_ID": "abc"}, "abc"),
    ({"TORCHELASTIC_RUN_ID": "none"}, "default"),
    ({}, "default"),
])
def test_job_from_the_environment(env, job):
    assert default_job(env) == job


def test_rank_and_world_size_from_torchrun_environment():
    reporter = TrainingReporter(job="j", url="http://127.0.0.1:9", env={"RANK": "5", "WORLD_SIZE": "16"})
    try:
        assert (reporter.rank, reporter.world_size) == (5, 16)
    finally:
        reporter.close(timeout=0.1)


def test_ranks_import_only_the_standard_library():
    code = (
        "import sys\n"
        "import healthagent.training as t\n"
        "r = t.TrainingReporter(job='j', url='http://127.0.0.1:9')\n"
        "r.report_step(1, step_seconds=0.1)\n"
        "r.close(0.1)\n"
        "bad = sorted(m for m in ('prometheus_client', 'requests', 'torch', 'kubernetes', 'pynvml', 'yaml')"
        " if m in sys.modules)\n"
        "print(bad)\n"
        "intake = t.TrainingIntake\n"  # the agent side is still reachable, lazily
        "print(intake.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "TrainingIntake"]


def test_close_is_idempotent_and_never_raises():
    reporter = TrainingReporter(job="j", url="http://127.0.0.1:9")
    reporter.close(timeout=0.1)
    reporter.close(timeout=0.1)
    reporter.close(timeout="not a number")  # type: ignore[arg-type]
    with TrainingReporter(job="j", url="http://127.0.0.1:9") as other:
        assert other.report_end() is True
    assert json.dumps(reporter.stats().__dict__)


@pytest.mark.integration
def test_the_client_sends_the_job_token_from_the_environment():
    """The stdlib client, unchanged, against an agent that is closed by default: the job's token
    from HEALTHAGENT_TRAINING_TOKEN opens it for that job; no token is a clean 401 and another
    job's token a clean 403 (each read by the client, not a reset), counted as rejected."""
    protected = start_agent(intake="token", key="cluster-key-0123456789")
    try:
        url = protected.intake_url
        token = job_token("cluster-key-0123456789", "llama")
        with_token = TrainingReporter(job="llama", url=url, rank=0, world_size=2,
                                      env={"HEALTHAGENT_TRAINING_TOKEN": token})
        without = TrainingReporter(job="other", url=url, rank=0, world_size=2, env={})
        wrong_job = TrainingReporter(job="other", url=url, rank=0, world_size=2,
                                     env={"HEALTHAGENT_TRAINING_TOKEN": token})
        for reporter in (with_token, without, wrong_job):
            for step in range(1, 300):  # a body of tens of KiB behind the 401: read, not reset
                reporter.report_step(step, tokens=4096, samples=8, step_seconds=1.0)
            reporter.close(timeout=30)
        assert with_token.stats().delivered == 299 and with_token.stats().rejected == 0
        for refused in (without, wrong_job):
            assert refused.stats().delivered == 0 and refused.stats().rejected == 299
            assert refused.stats().send_errors == 0  # a clean 4xx, not a reset connection
        assert protected.intake.jobs() == ["llama"]
    finally:
        protected.server.stop()
