"""Proof against the real thing: a real Prometheus scrapes the real agent on the demo node with
injected faults and training reports; then every dashboard expression returns data and the
expected alerts fire on ``/api/v1/alerts``.

Nothing here is a mock: the agent is ``AgentRuntime`` (what ``healthagent run`` starts) over the
demo host root (sysfs EFA tree, /dev/kmsg-format log, the stub ``libnvidia-ml.so.1`` compiled from
C), Kubernetes in dry-run; Prometheus is the Debian ``prometheus`` binary on 127.0.0.1 with
``honor_labels: true`` and a static ``node`` label, as the ServiceMonitor gives it, loading
alerts/healthagent.rules.yaml with every ``for:`` set to 0s (the ``for:`` boundaries are the
promtool tests' business; here a test must not wait minutes).

No timing is asserted: every wait polls for a condition with a generous deadline.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from healthagent.training.access import job_token

from tests.support.observability import (
    dashboard_queries,
    free_port,
    http_json,
    load_rules,
    require_binary,
    start_prometheus,
    substitute,
    wait_for,
    write_scrape_config,
)

NODE = "demo-p5-node"
JOB = "llama-70b"
STALLED_JOB = "stalled-job"
VARIABLES = {"cluster": ".*", "node": NODE, "job": JOB}
DEADLINE = 120.0

# Alerts the injected faults must raise (the rest need real time to pass, an unreachable agent or a
# cluster budget, and are covered by the promtool unit tests).
EXPECTED_FIRING = {
    "HealthagentNodeNeedsReplacement",  # XID 94 in the kernel log
    "HealthagentGpuDoubleBitError",  # volatile uncorrected ECC on GPU 1
    "HealthagentGpuRowRemapFailure",  # GPU 4
    "HealthagentGpuRowRemapPending",  # GPU 2
    "HealthagentGpuLost",  # GPU 5 falls off the bus
    "HealthagentGpuMissing",  # the node came up with 7 of its 8 GPUs
    "HealthagentGpuSbeStorm",  # GPU 0's corrected ECC count jumps
    "HealthagentEfaPortDown",  # one of the 32 EFA devices is unbound
    "HealthagentEfaUnresponsiveRemote",  # unresponsive_remote_events jumps by 1000
    "HealthagentFindingOpen",
    "HealthagentSourceFailing",  # dcgm-exporter URL that refuses connections
    "HealthagentTrainingStalled",  # a job whose last step is 20 minutes old
    "HealthagentTrainingWorldSizeBelowMax",  # llama-70b rescales 8 -> 6
}
MUST_NOT_FIRE = {"HealthagentAgentDown", "HealthagentAgentAbsent", "HealthagentLoopStalled",
                 "HealthagentBudgetExhausted"}

# Dashboard expressions that are empty in this setup, each with the reason; the test asserts they
# ARE empty, so when the reason goes away the entry must go too.
# Dashboard queries allowed to be empty on a healthy-but-faulted demo node, with the reason.
KNOWN_EMPTY: dict[tuple[str, str], str] = {
    ("remediation.json", "Budget per scope / A"): "an agent in dry-run never reads the budget's Leases",
    ("remediation.json", "Budget per scope / B"): "an agent in dry-run never reads the budget's Leases",
    ("remediation.json", "Hand-offs per engine / A"): "no engine has the demo node (it is cordoned)",
    ("remediation.json", "Hand-offs per engine / B"): "no engine has the demo node (it is cordoned)",
    ("remediation.json", "GPUs quarantined / A"): "a dry-run agent has no DRA (tests/dashboards/test_live_dra.py)",
    ("remediation.json", "GPU quarantines and fallbacks / A"): "a dry-run agent has no DRA (test_live_dra.py)",
    ("remediation.json", "GPU quarantines and fallbacks / B"): "a dry-run agent has no DRA (test_live_dra.py)",
}


# Dashboards of hardware the demo node (a p5: EFA, no InfiniBand) does not have, with the test that
# proves their queries on a node that has it.
PROVEN_ELSEWHERE = {"rdma-fabric.json": "tests/dashboards/test_live_fabric.py"}


def _rules_without_for(path: Path) -> None:
    rules = load_rules()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "0s"
    path.write_text(yaml.safe_dump(rules, sort_keys=False), encoding="utf-8")


@contextmanager
def scraped_by_prometheus(runtime: Any, node: str, tmp_path: Path) -> Iterator["Prometheus"]:
    """Start the agent (an ``AgentRuntime``), then a real Prometheus scraping it as ``node`` with
    the rule file, every ``for:`` at 0s; both stop on the way out, Prometheus first."""
    runtime.start()
    server = None
    try:
        rules = tmp_path / "rules.yaml"
        _rules_without_for(rules)
        config = write_scrape_config(tmp_path / "prometheus.yml", runtime.server.port, node, rules)
        server, url = start_prometheus(config, tmp_path)
        yield Prometheus(url)
    finally:
        if server is not None:
            server.stop()
        runtime.stop()


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list:
        reply = http_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert reply["status"] == "success", reply
        result = reply["data"]["result"]
        return result if reply["data"]["resultType"] in ("vector", "matrix") else [result]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def alerts(self) -> dict[str, set[str]]:
        states: dict[str, set[str]] = {}
        for alert in http_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]:
            states.setdefault(alert["labels"]["alertname"], set()).add(alert["state"])
        return states

    def label_values(self, label: str, match: str) -> list[str]:
        query = urllib.parse.urlencode({"match[]": match})
        return http_json(f"{self.url}/api/v1/label/{label}/values?{query}")["data"]


TRAINING_KEY = "live-prometheus-training-key-0123456789"


class TrainingRanks:
    """Rank 0 of a job reporting a step every half second, as the rank-side client does."""

    def __init__(self, intake_url: str, token: str) -> None:
        self.url = intake_url
        self.headers = {"Authorization": f"Bearer {token}"}  # the job's own token, as a rank has it
        self.world_size = 8
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-training-ranks", daemon=True)

    def post(self, reports: list[dict]) -> None:
        reply = http_json(self.url, reports, headers=self.headers)
        assert reply["accepted"] == len(reports), reply

    def step_report(self) -> dict:
        self.step += 1
        return {"type": "step", "job": JOB, "rank": 0, "world_size": self.world_size, "step": self.step,
                "tokens": 4096 * self.world_size, "samples": self.world_size, "step_seconds": 0.4}

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        for _ in range(int(DEADLINE * 10)):  # bounded: the test ends long before
            if self._stop.wait(0.5):
                return
            self.post([self.step_report()])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def live_stack(tmp_path, monkeypatch):
    """The agent on a fresh demo node, scraped by a real Prometheus that loads the rules."""
    require_binary("prometheus")
    require_binary("cc")  # the stub libnvidia-ml.so.1 is compiled from C
    from healthagent.config import load_settings
    from healthagent.demo import stub_nvml
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import use_stub_nvml
    from healthagent.wiring import AgentRuntime

    node = build_demo_root(tmp_path / "host")
    # GPU 7 is not there from the start (a GPU that vanishes later is reported lost, not missing).
    stub_nvml.remove_gpu(node.scenario, 7)
    # The stub NVML library reads the scenario named here; scope it to this test.
    monkeypatch.setenv("HEALTHAGENT_STUB_NVML_SCENARIO", str(node.scenario))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    use_stub_nvml(node.scenario)
    settings = load_settings(env={}, flags={
        "host_root": str(node.root), "kube": "dry-run", "listen": "127.0.0.1:0",
        "state_file": str(tmp_path / "state.json"), "node_name": NODE, "expected_gpus": 8,
        "expected_efa_devices": len(node.efa_devices), "nvml_interval_seconds": 1,
        "efa_interval_seconds": 1, "log_level": "WARNING",
        # A dcgm-exporter that is not there: the dcgm source fails, as HealthagentSourceFailing wants.
        "dcgm_url": f"http://127.0.0.1:{free_port()}/metrics", "dcgm_interval_seconds": 1,
        "dcgm_timeout_seconds": 0.5, "training_token": TRAINING_KEY,
    })
    runtime = AgentRuntime(settings)
    with scraped_by_prometheus(runtime, NODE, tmp_path) as prometheus:
        yield node, runtime, prometheus


@pytest.mark.integration
def test_dashboards_return_data_and_alerts_fire(live_stack):
    from healthagent.demo import stub_nvml

    node, runtime, prom = live_stack
    ranks = TrainingRanks(f"http://127.0.0.1:{runtime.server.intake_port}/v1/training",
                          job_token(TRAINING_KEY, JOB))

    def scraped(expr: str, what: str):
        return wait_for(lambda: prom.query(expr), timeout=DEADLINE, what=f"Prometheus to have {what}")

    scraped('up{job="healthagent"} == 1', "scraped the agent")
    scraped(f'healthagent_gpu_ecc_errors_total{{node="{NODE}",gpu="0",type="corrected",scope="volatile"}}',
            "GPU 0's corrected ECC count")
    scraped(f'healthagent_efa_unresponsive_remote_events_total{{node="{NODE}",efa_device="{node.efa_devices[0]}"}}',
            "the EFA counters")

    # Training: 8 ranks, seen by Prometheus and by the recording rule, before anything changes.
    ranks.post([ranks.step_report() for _ in range(3)])
    scraped(f'cluster_job:healthagent_training_world_size:max{{job="{JOB}"}} == 8', "world size 8 recorded")

    # Faults.
    node.inject_xid(3, 94)
    stub_nvml.set_gpu_field(node.scenario, 1, "ecc_volatile_uncorrected", 2)
    stub_nvml.set_gpu_field(node.scenario, 0, "ecc_volatile_corrected", 50_000)
    stub_nvml.set_gpu_field(node.scenario, 2, "remap_pending", True)
    stub_nvml.set_gpu_field(node.scenario, 4, "remap_failure", True)
    stub_nvml.set_gpu_lost(node.scenario, 5, True)
    node.remove_efa_device(node.efa_devices[-1])
    node.bump_efa_counter(node.efa_devices[0], "unresponsive_remote_events", 1000)

    # The job loses two nodes' ranks and goes on at 6; another job stopped stepping long ago.
    ranks.post([{"type": "rendezvous", "job": JOB, "world_size": 6, "reason": "node replaced"}])
    ranks.world_size = 6
    http_json(ranks.url, [{"type": "step", "job": STALLED_JOB, "rank": 0, "world_size": 4, "step": 1, "tokens": 1,
                           "samples": 1, "step_seconds": 1.0, "timestamp": time.time() - 1200}],
              headers={"Authorization": f"Bearer {job_token(TRAINING_KEY, STALLED_JOB)}"})
    ranks.start()
    try:
        _check_alerts(prom)
        _check_variables(prom)
        _check_dashboard_queries(prom)
    finally:
        ranks.stop()


def _firing(prom: Prometheus) -> set[str]:
    return {name for name, states in prom.alerts().items() if "firing" in states}


def _check_alerts(prom: Prometheus) -> None:
    try:
        wait_for(lambda: EXPECTED_FIRING <= _firing(prom), timeout=DEADLINE, what="the expected alerts")
    except pytest.fail.Exception:
        pytest.fail(f"not firing: {sorted(EXPECTED_FIRING - _firing(prom))}; alerts: {prom.alerts()}")
    assert not MUST_NOT_FIRE & _firing(prom), prom.alerts()


def _check_variables(prom: Prometheus) -> None:
    """The variables' queries find this node and the training jobs (honor_labels kept `job`)."""
    assert prom.label_values("node", "healthagent_build_info") == [NODE]
    assert set(prom.label_values("job", "healthagent_training_world_size")) == {JOB, STALLED_JOB}
    assert prom.value(f'max(healthagent_training_world_size{{job="{JOB}"}})') == 6
    assert prom.value(f'sum(healthagent_scaling_events_total{{job="{JOB}",direction="down"}})') == 1


def _check_dashboard_queries(prom: Prometheus) -> None:
    empty, known_but_filled = [], []
    for query in dashboard_queries():
        if query.dashboard in PROVEN_ELSEWHERE:
            continue
        expr = substitute(query.expr, VARIABLES)
        key = (query.dashboard, query.where)
        if key in KNOWN_EMPTY:
            if prom.query(expr):
                known_but_filled.append(key)
            continue
        try:
            wait_for(lambda e=expr: prom.query(e), timeout=30, what=expr)
        except pytest.fail.Exception:
            empty.append(f"{query.dashboard} / {query.where}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    assert not known_but_filled, f"now filled, remove from KNOWN_EMPTY: {known_but_filled}"
