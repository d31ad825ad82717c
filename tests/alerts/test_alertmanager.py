"""alerts/alertmanager.yaml: amtool accepts it, every route branch resolves as documented, every
alert rule lands where its severity and team say, and a real Alertmanager inhibits a node's
warnings while a critical for the same node fires.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from tests.support.observability import (
    ALERTMANAGER_FILE,
    ROUTE_CASES_FILE,
    alert_rules,
    http_json,
    require_binary,
    run_tool,
    start_alertmanager,
    wait_for,
)

CONFIG = yaml.safe_load(ALERTMANAGER_FILE.read_text(encoding="utf-8"))
CASES = yaml.safe_load(ROUTE_CASES_FILE.read_text(encoding="utf-8"))["cases"]

# Where each (severity, team) of the rule file must land: the contract docs/alerts.md states.
EXPECTED_RECEIVERS = {
    ("critical", "hardware"): ["pagerduty-gpu-oncall", "opsgenie-gpu-oncall"],
    ("critical", "platform"): ["pagerduty-platform"],
    ("warning", "hardware"): ["slack-gpu-health"],
    ("warning", "platform"): ["slack-platform"],
    ("warning", "training"): ["slack-training"],
    ("info", "hardware"): ["null"],
    ("info", "platform"): ["null"],
}


def _amtool() -> str:
    return require_binary("amtool")


def _route_test(labels: dict, receivers: list[str]):
    args = [f"{k}={v}" for k, v in sorted(labels.items())]
    return run_tool(_amtool(), "config", "routes", "test", f"--config.file={ALERTMANAGER_FILE}",
                    "--verify.receivers=" + ",".join(receivers), *args)


@pytest.mark.integration
def test_amtool_check_config():
    result = run_tool(_amtool(), "check-config", str(ALERTMANAGER_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert f"{len(CONFIG['receivers'])} receivers" in result.stdout


@pytest.mark.integration
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_route_case(case):
    result = _route_test(case["labels"], case["receivers"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[0] == ",".join(case["receivers"])


@pytest.mark.integration
def test_verify_receivers_fails_on_a_wrong_expectation():
    """The route cases can fail: amtool exits non-zero when the receivers differ."""
    result = _route_test({"severity": "critical", "team": "hardware"}, ["pagerduty-gpu-oncall"])
    assert result.returncode != 0


def test_every_branch_and_receiver_has_a_route_case():
    branch_receivers = {r["receiver"] for r in CONFIG["route"]["routes"]} | {CONFIG["route"]["receiver"]}
    case_receivers = {r for c in CASES for r in c["receivers"]}
    assert branch_receivers == case_receivers == {r["name"] for r in CONFIG["receivers"]}
    assert len(CASES) >= len(CONFIG["route"]["routes"])


@pytest.mark.integration
@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_every_alert_rule_routes_by_its_severity_and_team(rule):
    labels = {"alertname": rule["alert"], "node": "ip-10-0-1-17", **rule["labels"]}
    expected = EXPECTED_RECEIVERS[(rule["labels"]["severity"], rule["labels"]["team"])]
    result = _route_test(labels, expected)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grouping_inhibition_and_resolved_notifications():
    route = CONFIG["route"]
    assert route["group_by"] == ["alertname", "cluster", "node"]
    [inhibit] = CONFIG["inhibit_rules"]
    assert 'severity="critical"' in inhibit["source_matchers"]
    assert inhibit["target_matchers"] == ['severity="warning"']
    assert "node" in inhibit["equal"]
    for receiver in CONFIG["receivers"]:
        for key, configs in receiver.items():
            if key.endswith("_configs"):
                assert all(c.get("send_resolved") is True for c in configs), receiver["name"]


def test_no_secret_is_inline():
    """Keys and webhook URLs come from files (a mounted Secret), never from this example."""
    secret_keys = {"routing_key", "service_key", "api_key", "api_url", "url", "auth_password"}
    for receiver in CONFIG["receivers"]:
        for key, configs in receiver.items():
            if key.endswith("_configs"):
                for config in configs:
                    assert not secret_keys & set(config), receiver["name"]
                    assert any(k.endswith("_file") for k in config), receiver["name"]


# -- a real Alertmanager ---------------------------------------------------------------------

class WebhookSink:
    """Records what Alertmanager delivers, per receiver (the URL path names the receiver)."""

    def __init__(self) -> None:
        self.received: dict[str, list[dict]] = {}
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with sink._lock:
                    sink.received.setdefault(self.path.strip("/"), []).append(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def alertnames(self, receiver: str) -> set[tuple[str, str]]:
        with self._lock:
            return {(a["labels"]["alertname"], a["labels"].get("node", ""))
                    for body in self.received.get(receiver, []) for a in body["alerts"]}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _with_webhooks(config: dict, sink_url: str) -> dict:
    """The example's routes and inhibition unchanged; every receiver a webhook to the sink, and
    group waits cut to a second so the test does not wait 30 s for the first notification."""
    config = json.loads(json.dumps(config))
    for receiver in config["receivers"]:
        has_configs = any(k.endswith("_configs") for k in receiver)
        for key in [k for k in receiver if k.endswith("_configs")]:
            del receiver[key]
        if has_configs:
            receiver["webhook_configs"] = [{"url": f"{sink_url}/{receiver['name']}", "send_resolved": True}]
    for route in [config["route"], *config["route"]["routes"]]:
        route["group_wait"] = "1s"
        route["group_interval"] = "1s"
    return config


@pytest.fixture
def alertmanager(tmp_path):
    sink = WebhookSink()
    config = tmp_path / "alertmanager.yaml"
    config.write_text(yaml.safe_dump(_with_webhooks(CONFIG, sink.url)), encoding="utf-8")
    server, url = start_alertmanager(config, tmp_path)
    yield url, sink
    server.stop()
    sink.stop()


def _alert(name: str, severity: str, team: str, node: str) -> dict:
    return {"labels": {"alertname": name, "severity": severity, "team": team, "node": node},
            "annotations": {"summary": f"{name} on {node}"}}


@pytest.mark.integration
def test_real_alertmanager_routes_and_inhibits(alertmanager):
    url, sink = alertmanager
    http_json(f"{url}/api/v2/alerts", [
        _alert("HealthagentNodeNeedsReplacement", "critical", "hardware", "n1"),
        _alert("HealthagentGpuRowRemapPending", "warning", "hardware", "n1"),  # inhibited by n1's critical
        _alert("HealthagentGpuRowRemapPending", "warning", "hardware", "n2"),  # another node: delivered
        _alert("HealthagentSourceFailing", "warning", "platform", "n1"),  # inhibited too
        _alert("HealthagentFindingOpen", "info", "hardware", "n2"),  # recorded, sent nowhere
    ])
    wait_for(lambda: ("HealthagentNodeNeedsReplacement", "n1") in sink.alertnames("pagerduty-gpu-oncall")
             and ("HealthagentNodeNeedsReplacement", "n1") in sink.alertnames("opsgenie-gpu-oncall")
             and ("HealthagentGpuRowRemapPending", "n2") in sink.alertnames("slack-gpu-health"),
             timeout=60, what="the critical page and the n2 warning")

    states = {(a["labels"]["alertname"], a["labels"]["node"]): a["status"]
              for a in http_json(f"{url}/api/v2/alerts")}
    assert states[("HealthagentGpuRowRemapPending", "n1")]["state"] == "suppressed"
    assert states[("HealthagentGpuRowRemapPending", "n1")]["inhibitedBy"]
    assert states[("HealthagentSourceFailing", "n1")]["state"] == "suppressed"
    assert states[("HealthagentGpuRowRemapPending", "n2")]["state"] == "active"
    assert states[("HealthagentNodeNeedsReplacement", "n1")]["state"] == "active"
    assert states[("HealthagentFindingOpen", "n2")]["state"] == "active"
    delivered = {a for receiver in sink.received for a in sink.alertnames(receiver)}
    assert ("HealthagentGpuRowRemapPending", "n1") not in delivered
    assert ("HealthagentSourceFailing", "n1") not in delivered
    assert ("HealthagentFindingOpen", "n2") not in delivered
    assert "null" not in sink.received
