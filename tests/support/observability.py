"""Test helpers for dashboards/ and alerts/: the metric contract, the PromQL in the dashboards, and
the real Prometheus tools (promtool, amtool, prometheus, alertmanager) the tests drive.

One place for these because the unit tests (syntax, contract) and the integration test against a
live Prometheus look at the same expressions the same way.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import pytest
import yaml

from tests.support import wait

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = REPO / "dashboards"
ALERTS_DIR = REPO / "alerts"
RULES_FILE = ALERTS_DIR / "healthagent.rules.yaml"
RULE_TESTS_DIR = ALERTS_DIR / "tests"
ALERTMANAGER_FILE = ALERTS_DIR / "alertmanager.yaml"
ROUTE_CASES_FILE = ALERTS_DIR / "routes-tests.yaml"
FINDINGS_DOC = REPO / "docs" / "findings.md"
OPERATIONS_DOC = REPO / "docs" / "operations.md"
TOOL_TIMEOUT_SECONDS = 120

# -- the metric contract ------------------------------------------------------------------------

def contract_metric_names() -> set[str]:
    """Every series name the agent exports: the product's metric table (healthagent/telemetry/spec.py,
    the metric contract) plus one ``efa_<counter>_total`` per EFA driver counter of the reference
    (never ``lifespan``) and the InfiniBand/RoCE families; histograms with their _bucket/_sum/_count
    series."""
    from healthagent.telemetry import spec
    from tests.support.efa_reference import efa_counter_facts

    specs = [*spec.HEALTH, *spec.TRAINING, spec.COLLECT_DURATION, spec.BUILD_INFO]
    series = set()
    for metric in specs:
        if metric.type == "histogram":
            series |= {f"{metric.full_name}_{s}" for s in ("bucket", "sum", "count")}
        else:
            series.add(metric.full_name)
    counters = set(efa_counter_facts()) - {"lifespan"}
    return series | {f"{spec.PREFIX}efa_{c}_total" for c in counters} | rdma_metric_names()


def rdma_metric_names() -> set[str]:
    """The InfiniBand/RoCE families: the fixed ones and a counter per PortCounter and driver counter
    node_exporter names (telemetry/rdma_metrics.py)."""
    from healthagent.telemetry import rdma_metrics

    counters = {*rdma_metrics.PMA_NAMES.values(), *rdma_metrics.HW_NAMES.values()}
    return {m.full_name for m in rdma_metrics.RDMA} | {rdma_metrics.NS + c for c in counters}


def per_job_metric_names() -> set[str]:
    """Training series that carry the training job's ``job`` label."""
    from healthagent.telemetry import spec

    names = set()
    for metric in spec.TRAINING:
        if "job" in metric.labels:
            suffixes = ("_bucket", "_sum", "_count") if metric.type == "histogram" else ("",)
            names |= {metric.full_name + s for s in suffixes}
    return names


FINDING_CODES = {
    "GPU_XID", "NVSWITCH_SXID", "GPU_ECC_DBE", "GPU_SBE_STORM", "GPU_ROW_REMAP_FAILURE",
    "GPU_ROW_REMAP_PENDING", "GPU_RETIRED_PAGES", "GPU_RETIRED_PAGES_PENDING", "GPU_LOST", "GPU_MISSING",
    "GPU_NVLINK_ERRORS", "GPU_PCIE_REPLAY", "GPU_THERMAL_THROTTLE", "GPU_POWER_THROTTLE",
    "EFA_DEVICE_MISSING", "EFA_ADMIN_QUEUE_STUCK", "EFA_CMD_ERRORS", "EFA_UNRESPONSIVE_REMOTE",
    "EFA_IMPAIRED_REMOTE", "EFA_RETRANS_TIMEOUT", "EFA_RX_DROPS", "EFA_WR_ERRORS",
}

# A metric name, not part of a recording rule's level:metric:operation name.
METRIC_NAME_RE = re.compile(r"(?<![\w:])healthagent_[a-z0-9_]+(?![\w:])")


def metric_names_in(expr: str) -> set[str]:
    return set(METRIC_NAME_RE.findall(expr))


# -- dashboards --------------------------------------------------------------------------------

@dataclass(frozen=True)
class DashboardQuery:
    """One PromQL expression of a generated dashboard and where it sits."""

    dashboard: str  # file name
    where: str  # panel title / refId, or "annotation: <name>"
    expr: str


def load_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def iter_panels(dashboard: Mapping) -> Iterator[Mapping]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


def dashboard_queries() -> list[DashboardQuery]:
    """Every ``expr`` of every generated dashboard: panel targets and Prometheus annotations."""
    queries = []
    for name, dash in load_dashboards().items():
        for panel in iter_panels(dash):
            for t in panel.get("targets", []):
                queries.append(DashboardQuery(name, f"{panel['title']} / {t['refId']}", t["expr"]))
        for annotation in dash["annotations"]["list"]:
            if "expr" in annotation:
                queries.append(DashboardQuery(name, f"annotation: {annotation['name']}", annotation["expr"]))
    return queries


# Grafana's global variables, replaced by what Grafana would send for a short time range.
GRAFANA_MACROS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "10m"}


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """Replace Grafana macros and dashboard variables (``$node``, ``${node}``) by concrete values."""
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value)
        expr = re.sub(r"\$" + re.escape(name) + r"\b", lambda _m: value, expr)
    if "$" in expr:
        raise ValueError(f"unsubstituted variable left in {expr!r}")
    return expr


# -- binaries ----------------------------------------------------------------------------------

def require_binary(name: str) -> str:
    """Path of a Debian-packaged tool, or skip the test naming it (CI installs it)."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian package prometheus / prometheus-alertmanager; .ci/run installs it)")
    return path


def run_tool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=TOOL_TIMEOUT_SECONDS, cwd=cwd)


def promtool_check_expressions(exprs: Mapping[str, str], workdir: Path) -> subprocess.CompletedProcess:
    """Parse expressions with ``promtool check rules``: each becomes a recording rule named by its key.

    promtool has no offline "parse this query" command (``promtool query`` needs a server), but
    ``check rules`` parses every rule's expression and names the rule that fails.
    """
    promtool = require_binary("promtool")
    rules = [{"record": key, "expr": expr} for key, expr in exprs.items()]
    path = workdir / "expressions.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "expressions", "rules": rules}]}, sort_keys=False),
                    encoding="utf-8")
    return run_tool(promtool, "check", "rules", str(path))


# -- alert rules -------------------------------------------------------------------------------

def load_rules(path: Path = RULES_FILE) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def alert_rules(rules: Mapping | None = None) -> list[dict]:
    rules = rules if rules is not None else load_rules()
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def recording_rules(rules: Mapping | None = None) -> list[dict]:
    rules = rules if rules is not None else load_rules()
    return [r for g in rules["groups"] for r in g["rules"] if "record" in r]


def duration_seconds(text: str) -> float:
    """Prometheus duration (``90s``, ``5m``, ``1h30m``) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * units[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds % 60 == 0 and seconds:
        return f"{seconds // 60}m"
    return f"{seconds}s"


# -- real servers ------------------------------------------------------------------------------

def free_port() -> int:
    """A loopback port that was free a moment ago (the binaries take no port 0)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, payload=None, timeout: float = 10.0, headers: dict[str, str] | None = None):
    """GET (or POST ``payload`` as JSON) and decode the JSON reply."""
    import urllib.request

    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        body = reply.read()
    return json.loads(body) if body else None


def wait_for(predicate, *, timeout: float, interval: float = 0.25, what: str = "condition"):
    """``tests.support.wait.wait_for`` for real servers: any exception means "not yet" (a server
    still starting refuses connections). Deadlines only bound a hang, never a measurement."""
    return wait.wait_for(predicate, timeout, what, interval=interval, retry_on=(Exception,))


class ServerProcess:
    """A real binary (prometheus, alertmanager) on 127.0.0.1, stopped and reaped by ``stop``."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self._log = open(log_path, "wb")
        self.log_path = log_path
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)
        self._log.close()


def start_alertmanager(config: Path, workdir: Path) -> tuple[ServerProcess, str]:
    return _start("prometheus-alertmanager", workdir, [
        f"--config.file={config}", f"--storage.path={workdir / 'am-data'}", "--cluster.listen-address="])


def start_prometheus(config: Path, workdir: Path) -> tuple[ServerProcess, str]:
    return _start("prometheus", workdir, [
        f"--config.file={config}", f"--storage.tsdb.path={workdir / 'prom-data'}",
        "--rules.alert.resend-delay=1s"])


def _start(name: str, workdir: Path, flags: list[str]) -> tuple[ServerProcess, str]:
    """Start ``name`` on a free loopback port and wait until its /-/ready says so."""
    binary = require_binary(name)
    port = free_port()
    server = ServerProcess([binary, *flags, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                           workdir / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    _wait_ready(server, url, name)
    return server, url


def _wait_ready(server: ServerProcess, url: str, name: str) -> None:
    import urllib.request

    def ready() -> bool:
        if server.process.poll() is not None:
            pytest.fail(f"{name} exited with {server.process.returncode}:\n{server.log_tail()}")
        with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as reply:
            return reply.status == 200

    try:
        wait_for(ready, timeout=60, what=f"{name} to become ready")
    except BaseException:
        server.stop()
        raise


def write_scrape_config(path: Path, agent_port: int, node: str, rules: Path) -> Path:
    """A Prometheus config that scrapes the agent on 127.0.0.1 every second with ``rules`` loaded,
    as the ServiceMonitor does (``honor_labels``: a training job's ``job`` label is its own; a
    static ``node`` label, as relabelling gives it)."""
    path.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "healthagent", "honor_labels": True, "static_configs": [
            {"targets": [f"127.0.0.1:{agent_port}"], "labels": {"node": node}}]}],
    }), encoding="utf-8")
    return path
