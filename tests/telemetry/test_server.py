"""The agent's HTTP server, started for real on 127.0.0.1: the agent's port and the intake's."""

from __future__ import annotations

import json
import socket

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from healthagent.telemetry.http_listener import Limits
from healthagent.training.access import job_token
from healthagent.telemetry.metrics import Telemetry
from healthagent.telemetry.server import AgentServer
from tests.support.wait import wait_for
from tests.telemetry.harness import start_agent
from tests.telemetry.snapshots import demo_snapshot

pytestmark = pytest.mark.integration


def test_port_zero_binds_a_free_port_and_stop_releases_it(agent):
    port = agent.server.port
    assert port > 0
    assert agent.request("/healthz").status == 200
    agent.server.stop()
    agent.server.stop()  # idempotent
    with socket.socket() as again:  # the port is free again: a new listener can take it
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_healthz_follows_the_loop_heartbeat(agent):
    limit = agent.server.heartbeat_timeout_seconds
    reply = agent.request("/healthz")
    assert (reply.status, reply.text.startswith("ok: starting")) == (200, True)
    agent.monotonic.advance(limit + 1)  # no cycle completed since start
    reply = agent.request("/healthz")
    assert reply.status == 503 and "has not completed a cycle" in reply.text
    agent.server.heartbeat(agent.clock())
    assert agent.request("/healthz").status == 200
    agent.monotonic.advance(limit - 1)
    assert agent.request("/healthz").status == 200
    agent.monotonic.advance(2)
    reply = agent.request("/healthz")
    assert reply.status == 503 and f"limit {limit:.0f}s" in reply.text


def test_readyz_follows_set_ready(agent):
    reply = agent.request("/readyz")
    assert reply.status == 503 and "not ready" in reply.text
    agent.server.set_ready(True)
    assert (agent.request("/readyz").status, agent.request("/readyz").text) == (200, "ready\n")
    agent.server.set_ready(False)
    assert agent.request("/readyz").status == 503


def test_metrics_content_type_and_openmetrics_negotiation(agent):
    agent.telemetry.publish(demo_snapshot(gpus=(), efa=()))
    plain = agent.scrape()
    assert plain.status == 200
    assert plain.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    om = agent.scrape("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")
    assert om.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert om.text.endswith("# EOF\n") and om.text.count("# EOF") == 1
    assert "healthagent_node_action" in om.text


def test_openmetrics_output_parses(agent):
    """The whole OpenMetrics document parses with prometheus_client's strict OpenMetrics parser
    (no two families share a name: the budget gauge is ``budget_holding_taint`` for that reason)."""
    agent.telemetry.publish(demo_snapshot())
    text = agent.scrape("application/openmetrics-text; version=1.0.0").text
    names = {family.name for family in parse_openmetrics(text)}
    assert {"healthagent_gpu_info", "healthagent_efa_rx_drops", "healthagent_node_action",
            "healthagent_budget_holding_taint", "healthagent_budget_blocked"} <= names


def test_gzip_when_asked(agent):
    agent.telemetry.publish(demo_snapshot())
    reply = agent.request("/metrics", headers={"Accept-Encoding": "gzip"})
    assert reply.headers.get("Content-Encoding") == "gzip"
    assert "healthagent_gpu_info" in reply.text  # the fixture decompressed it


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/nope", 404),
    ("GET", "/v1/training", 404),
    ("POST", "/metrics", 405),
    ("DELETE", "/healthz", 405),
    ("PUT", "/readyz", 405),
])
def test_unknown_paths_and_methods_on_the_agents_port(agent, method, path, status):
    reply = agent.request(path, method=method, body=b"" if method in ("POST", "PUT") else None)
    assert reply.status == status
    if status == 405:
        assert reply.headers["Allow"] == "GET"


def test_the_agents_port_points_reports_to_the_intakes_port(agent):
    reply = agent.request("/v1/training", method="POST", body=b"{}", headers={"Content-Type": "application/json"})
    assert reply.status == 404 and f"port {agent.server.intake_port}" in reply.text
    assert agent.intake.jobs() == []


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/metrics", 404),
    ("GET", "/healthz", 404),
    ("GET", "/v1/training", 405),
    ("PUT", "/v1/training", 405),
])
def test_the_intakes_port_serves_only_reports(agent, method, path, status):
    reply = agent.request(path, method=method, body=b"" if method == "PUT" else None, base=agent.intake_url)
    assert reply.status == status
    if status == 405:
        assert reply.headers["Allow"] == "POST"
    else:
        assert "only POST /v1/training" in reply.text


def test_query_strings_are_ignored(agent):
    assert agent.request("/healthz?verbose=1").status == 200


@pytest.mark.parametrize("listener", ["agent", "intake"])
def test_garbage_and_half_requests_do_not_kill_the_server(agent, listener):
    port = agent.server.port if listener == "agent" else agent.server.intake_port
    for junk in (b"\x00\xff garbage\r\n\r\n", b"GET", b"POST /v1/training HTTP/1.1\r\nContent-Length: 50\r\n"
                 b"Content-Type: application/json\r\n\r\n{\"type\":"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(junk)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(4096)
    assert agent.request("/healthz").status == 200
    assert agent.post_json('{"type":"end","job":"j"}').status == 202


def test_training_route_checks_content_type_length_and_size(agent):
    reply = agent.post_json('{"type":"end","job":"j"}', content_type="text/plain")
    assert reply.status == 415 and json.loads(reply.body)["reason"] == "content_type"
    big = json.dumps([{"type": "end", "job": "j" * 100}] * 700)
    assert len(big) > agent.server.max_body_bytes
    reply = agent.post_json(big)
    assert reply.status == 413 and "limit" in json.loads(reply.body)["error"]
    with socket.create_connection(("127.0.0.1", agent.server.intake_port), timeout=5) as conn:
        conn.sendall(b"POST /v1/training HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.0 411")
    reply = agent.post_json('{"type":"end","job":"j"}')
    assert reply.status == 202 and json.loads(reply.body) == {"accepted": 1}
    text = agent.scrape().text
    for reason in ("content_type", "body_too_large", "length_required"):
        assert f'healthagent_training_reports_rejected_total{{reason="{reason}"}} 1.0' in text


def test_connections_over_the_cap_are_refused_and_the_server_recovers():
    telemetry = Telemetry("1")
    server = AgentServer(telemetry, None, "127.0.0.1", 0,
                         agent_limits=Limits(max_connections=2, max_per_client=8))
    server.start()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            extra.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            assert extra.recv(4096) == b""  # closed without an answer: both slots are taken
    finally:
        for conn in idle:
            conn.close()
    # The slots free up once the idle connections are gone; a fresh request is answered.
    def answered() -> bool:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
            conn.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            return conn.recv(4096).startswith(b"HTTP/1.0 200")

    try:
        wait_for(answered, what="a free connection slot")
    finally:
        server.stop()
    # Counted (exported as internal_errors_total{component="http"}): the extra connection, and
    # any poll of answered() that came before a slot was free again.
    assert set(server.errors) == {"refused"} and server.errors["refused"] >= 1


KEY = "s3cret-cluster-key-0123456789abcdef"


def post_as(agent, authorization: str | None, body: bytes = b'{"type":"end","job":"j"}'):
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    return agent.request("/v1/training", method="POST", body=body, headers=headers, base=agent.intake_url)


@pytest.fixture
def closed():
    """An intake in its default mode with a training key: job tokens and the key open it."""
    running = start_agent(intake="token", key=KEY)
    yield running
    running.server.stop()


@pytest.mark.parametrize("authorization", [
    None, "Bearer wrong", f"Bearer {KEY}X", KEY, "Basic czNjcmV0LWNsdXN0ZXIta2V5",
    f"Bearer {job_token('another-key', 'j')}",  # a token minted from another cluster's key
    f"Bearer {job_token(KEY, 'j')[:-2]}",  # a job token with its MAC cut short
])
def test_without_a_valid_token_nothing_is_applied(closed, authorization):
    reply = post_as(closed, authorization)
    assert reply.status == 401
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    assert json.loads(reply.body)["reason"] == "unauthorized"
    assert closed.intake.jobs() == []  # nothing applied
    assert 'healthagent_training_reports_rejected_total{reason="unauthorized"} 1.0' in closed.scrape().text
    # /metrics and the probes need no token (the kubelet, Prometheus).
    assert closed.request("/healthz").status == 200 and closed.scrape().status == 200


def test_a_job_token_writes_its_job_and_no_other(closed):
    token = f"Bearer {job_token(KEY, 'llama')}"
    assert post_as(closed, token, b'{"type":"end","job":"llama"}').status == 202
    both = json.dumps([{"type": "end", "job": "llama"}, {"type": "end", "job": "victim"}]).encode()
    reply = post_as(closed, token, both)
    assert reply.status == 403
    assert json.loads(reply.body)["reason"] == "wrong_job" and "'llama'" in json.loads(reply.body)["error"]
    assert closed.intake.jobs() == ["llama"]  # not even the batch's own report was applied
    assert 'healthagent_training_reports_rejected_total{reason="wrong_job"} 1.0' in closed.scrape().text


def test_the_training_key_itself_writes_every_job(closed):
    for job in ("llama", "mistral"):
        assert post_as(closed, f"Bearer {KEY}", json.dumps({"type": "end", "job": job}).encode()).status == 202
    assert closed.intake.jobs() == ["llama", "mistral"]


def test_without_a_key_the_default_intake_accepts_nothing_and_says_why():
    agent = start_agent(intake="token", key="")
    try:
        for authorization in (None, "Bearer anything", f"Bearer {job_token('guess', 'j')}"):
            reply = post_as(agent, authorization)
            assert reply.status == 401
            assert "training key is not set" in json.loads(reply.body)["error"]
            assert "healthagent-training" in json.loads(reply.body)["error"]
        assert agent.intake.jobs() == []
    finally:
        agent.server.stop()


def test_an_open_intake_needs_no_authorization(agent):
    reply = agent.post_json('{"type":"end","job":"j"}')
    assert reply.status == 202
    assert 'healthagent_training_reports_rejected_total{reason="unauthorized"} 0.0' in agent.scrape().text
