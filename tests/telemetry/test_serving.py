"""Serving that a hostile pod cannot take down, on real listeners on 127.0.0.1.

The intake is open to every pod that reaches the node, so these tests attack it as such a pod
would: many slow clients (each from its own loopback address, 127.0.x.y, as pods have their own
IPs), one byte at a time, many connections from one address, a huge body without a token. The
kubelet's probes and Prometheus' scrape are on the agent's own listener and must keep answering.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.bench_serving import SLOW_REQUEST, SlowClients
from healthagent.config import TRAINING_PORT, load_settings
from healthagent.telemetry.http_listener import Limits
from healthagent.telemetry.server import AGENT_LIMITS, INTAKE_LIMITS
from healthagent.training.client import DEFAULT_PORT
from tests.support.wait import wait_for
from tests.telemetry.harness import start_agent
from tests.telemetry.snapshots import demo_snapshot

pytestmark = pytest.mark.integration

SLOW_CLIENTS = 200
GOOD_REPORT = b'{"type":"end","job":"good"}'


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def post(url: str, body: bytes = GOOD_REPORT) -> int:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def answer_of(sock: socket.socket) -> bytes:
    """What the server sends back before it closes (b"" when it closed without a word)."""
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_200_slow_clients_on_the_intake_leave_probes_and_scrapes_answering():
    agent = start_agent()
    attack = None
    try:
        agent.telemetry.publish(demo_snapshot())
        attack = SlowClients(agent.server.intake_port, SLOW_CLIENTS)
        # The attack has taken every intake slot: the clients past the cap are being turned away,
        # or (each from an address of its own) take the oldest slot of another.
        def turned_away() -> int:
            errors = agent.server.errors
            return errors.get("intake_refused", 0) + errors.get("intake_evicted", 0)

        wait_for(lambda: turned_away() >= SLOW_CLIENTS - INTAKE_LIMITS.max_connections,
                 what="the slow clients to fill the intake")
        for _ in range(20):
            assert get(agent.url + "/healthz") == 200
            assert get(agent.url + "/readyz") in (200, 503)
            assert get(agent.url + "/metrics") == 200
        assert not any(kind.startswith(("refused", "deadline")) for kind in agent.server.errors), \
            agent.server.errors  # the agent's own port refused and cut off nobody
    finally:
        if attack is not None:
            attack.stop()
    try:
        # Once the attackers are gone the intake serves reports again.
        wait_for(lambda: post(agent.intake_url + "/v1/training") == 202, what="the intake to recover")
        assert "good" in agent.intake.jobs()
    finally:
        agent.server.stop()


@pytest.mark.parametrize("request_head", [
    b"POST /v1/training HTTP/1.1\r\nHost: agent\r\nX-Slow: ",  # headers that never end
    b"POST /v1/training HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n[",  # a body that never arrives
], ids=["headers", "body"])
def test_a_request_trickled_one_byte_at_a_time_is_cut_off_at_its_deadline(request_head):
    """Each byte arrives well inside any per-read timeout; the deadline is for the whole request."""
    agent = start_agent(intake_limits=Limits(max_connections=4, max_per_client=4, deadline_seconds=1.0))
    try:
        with socket.create_connection(("127.0.0.1", agent.server.intake_port), timeout=10) as conn:
            conn.sendall(request_head)
            cut = False
            for _ in range(300):  # up to a minute of trickling; the deadline is one second
                try:
                    conn.send(b"x")
                    conn.settimeout(0.2)
                    if conn.recv(4096) == b"":
                        cut = True
                        break
                except socket.timeout:
                    continue
                except OSError:  # reset or broken pipe: the server closed it
                    cut = True
                    break
            assert cut, "the server kept a trickling request open past its deadline"
        assert agent.server.errors.get("intake_deadline", 0) >= 1
        assert post(agent.intake_url + "/v1/training") == 202  # the slot was freed
    finally:
        agent.server.stop()


def test_one_address_cannot_take_every_slot():
    agent = start_agent(intake_limits=Limits(max_connections=64, max_per_client=3, deadline_seconds=30.0))
    idle = [socket.create_connection(("127.0.0.1", agent.server.intake_port), timeout=10) for _ in range(3)]
    try:
        with socket.create_connection(("127.0.0.1", agent.server.intake_port), timeout=10) as fourth:
            fourth.sendall(SLOW_REQUEST)
            assert answer_of(fourth) == b""  # closed unanswered: this address holds 3 already
        other = socket.socket()
        other.bind(("127.0.0.2", 0))
        other.settimeout(10)
        with other:
            other.connect(("127.0.0.1", agent.server.intake_port))
            other.sendall(SLOW_REQUEST)
            assert answer_of(other).startswith(b"HTTP/1.0 202")  # another address is served
        assert agent.server.errors.get("intake_refused_per_client", 0) >= 1
    finally:
        for conn in idle:
            conn.close()
        agent.server.stop()


def test_the_token_is_checked_before_a_body_is_waited_for():
    """A request without a token announcing a huge body is answered 401 at once: the agent does
    not wait for, read or parse the body (with a long deadline, waiting would hang this test)."""
    agent = start_agent(intake="token", key="k" * 32,
                        intake_limits=Limits(max_connections=4, max_per_client=4, deadline_seconds=120.0))
    try:
        with socket.create_connection(("127.0.0.1", agent.server.intake_port), timeout=20) as conn:
            conn.sendall(b"POST /v1/training HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 50000000\r\n\r\n")
            reply = answer_of(conn)
        assert reply.startswith(b"HTTP/1.0 401")
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["reason"] == "unauthorized"
        assert agent.intake.jobs() == []
    finally:
        agent.server.stop()


def test_both_listeners_have_a_backlog_that_absorbs_a_burst():
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) not installed: cannot read a listening socket's backlog")
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    agent = start_agent()
    try:
        for port, limits in ((agent.server.port, AGENT_LIMITS), (agent.server.intake_port, INTAKE_LIMITS)):
            row = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                                 check=True).stdout.split()
            assert int(row[2]) == min(limits.backlog, somaxconn) > 5  # Send-Q of a LISTEN socket
    finally:
        agent.server.stop()


def test_the_clients_default_port_is_the_intakes():
    assert DEFAULT_PORT == TRAINING_PORT


# -- the agent as ``healthagent run`` builds it: closed by default, open only when asked ---------

def runtime_for(tmp_path: Path, **flags):
    from healthagent.wiring import AgentRuntime

    values = {"host_root": str(tmp_path), "nvml": "false", "kube": "off", "listen": "127.0.0.1:0",
              "state_file": str(tmp_path / "state.json"), "log_level": "WARNING", **flags}
    return AgentRuntime(load_settings(env={}, flags=values))


def test_by_default_the_intake_refuses_every_report_and_says_so_at_start(tmp_path, caplog):
    runtime = runtime_for(tmp_path)
    with caplog.at_level(logging.INFO, logger="healthagent.telemetry.server"):
        runtime.start()
    try:
        assert any("training intake is closed" in r.getMessage() and r.levelno == logging.WARNING
                   for r in caplog.records)
        url = f"http://127.0.0.1:{runtime.server.intake_port}/v1/training"
        assert runtime.server.intake_port != runtime.server.port
        assert post(url) == 401 and runtime.intake.jobs() == []
    finally:
        runtime.stop()


def test_an_open_intake_is_the_operators_explicit_choice_and_is_warned_about(tmp_path, caplog):
    runtime = runtime_for(tmp_path, training_intake="open")
    with caplog.at_level(logging.INFO, logger="healthagent.telemetry.server"):
        runtime.start()
    try:
        assert any("training intake is open" in r.getMessage() and r.levelno == logging.WARNING
                   for r in caplog.records)
        assert post(f"http://127.0.0.1:{runtime.server.intake_port}/v1/training") == 202
    finally:
        runtime.stop()


def test_an_intake_turned_off_has_no_listener(tmp_path):
    runtime = runtime_for(tmp_path, training_intake="off")
    runtime.start()
    try:
        assert runtime.server.intake_port is None
        reply = post(f"http://127.0.0.1:{runtime.server.port}/v1/training")
        assert reply == 404
    finally:
        runtime.stop()
