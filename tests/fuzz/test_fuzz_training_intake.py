"""Fuzz the training intake with the bodies any pod on the node could send (``POST /v1/training``).

The intake is reachable from every pod (hostPort), so its input is untrusted: whatever the body,
``TrainingIntake.submit`` answers 202 or 400 with a JSON reply naming a known reason, never raises,
and the metrics it renders afterwards still parse. A smaller run goes through the real HTTP server
with random content types and lengths.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from healthagent.training.intake import TrainingIntake
from healthagent.training.schema import MAX_BATCH, REJECT_REASONS

pytestmark = pytest.mark.reliability

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=200))
FIELDS = ("type", "job", "rank", "world_size", "step", "tokens", "samples", "step_seconds", "timestamp", "reason")
report = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)),
                         st.one_of(scalars, st.sampled_from(["step", "rendezvous", "end", "llama"]),
                                   st.lists(scalars, max_size=3)), max_size=12)
documents = st.one_of(report, st.lists(report, max_size=20), scalars,
                      st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                          st.text(max_size=6), inner, max_size=4), max_leaves=20))


def as_body(document) -> bytes:
    return json.dumps(document, allow_nan=True).encode()


def check_reply(reply) -> None:
    assert reply.status in (202, 400)
    json.dumps(reply.body)
    if reply.status == 400:
        assert reply.body["reason"] in REJECT_REASONS
        assert isinstance(reply.body["error"], str) and "\n" not in reply.body["error"]
    else:
        assert reply.body["accepted"] >= 1 or reply.body == {"accepted": 0}


def check_renders(intake: TrainingIntake) -> None:
    registry = CollectorRegistry()
    registry.register(intake)
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    assert any(f.name == "healthagent_training_reports_rejected" for f in families)


@FUZZ
@given(st.lists(st.one_of(documents.map(as_body), st.binary(max_size=300)), min_size=1, max_size=6))
def test_any_body_is_answered_and_never_raises(bodies):
    intake = TrainingIntake(max_jobs=4, idle_seconds=60)
    for body in bodies:
        check_reply(intake.submit(body))
    check_renders(intake)
    assert len(intake.jobs()) <= 4


@FUZZ
@given(st.lists(st.fixed_dictionaries({
    "type": st.just("step"), "job": st.text(min_size=1, max_size=20), "rank": st.integers(-1, 10),
    "world_size": st.integers(0, 10), "step": st.integers(-1, 10**6),
    "tokens": st.integers(-1, 10**9), "samples": st.integers(-1, 10**6),
    "step_seconds": st.floats(min_value=-1, max_value=1e5, allow_nan=False)}), min_size=1, max_size=MAX_BATCH // 100))
def test_nearly_valid_batches_count_every_valid_report(batch):
    intake = TrainingIntake(max_jobs=64, idle_seconds=60)
    reply = intake.submit(as_body(batch))
    check_reply(reply)
    accepted = reply.body["accepted"]
    rejected = reply.body.get("rejected", 0)
    assert accepted + rejected == len(batch)
    check_renders(intake)


FUZZ_KEY = "fuzz-training-key"


@pytest.fixture(scope="module")
def server():
    from healthagent.training.access import IntakeAccess
    from healthagent.telemetry.metrics import Telemetry
    from healthagent.telemetry.server import AgentServer

    telemetry = Telemetry("fuzz")
    intake = TrainingIntake()
    telemetry.registry.register(intake)
    agent = AgentServer(telemetry, intake, "127.0.0.1", 0, intake_listen=("127.0.0.1", 0),
                        access=IntakeAccess("token", FUZZ_KEY))
    agent.start()
    yield agent
    agent.stop()


@pytest.mark.integration
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(documents.map(as_body), st.binary(max_size=2000)),
       content_type=st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                                     "", "application/x-www-form-urlencoded"]))
def test_random_posts_to_the_real_server(server, body, content_type):
    headers = {"Authorization": f"Bearer {FUZZ_KEY}"}
    if content_type:
        headers["Content-Type"] = content_type
    request = urllib.request.Request(f"http://127.0.0.1:{server.intake_port}/v1/training", data=body,
                                     method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            status, text = reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read()
    assert status in (202, 400, 415)
    assert json.loads(text)["accepted"] >= 0
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as reply:
        assert reply.status in (200, 503)
