"""The generated dashboards: never drifting from their sources, and built to the project's rules.

Grafana itself cannot run here, so these tests check the JSON Grafana would import: the schema
version, the variables, that every panel and query uses the datasource variable, the layout, and
that every query filters by the variables and only names metrics of the contract.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml

from dashboards import generate
from dashboards.common import DATASOURCE, SCHEMA_VERSION
from tests.support.observability import (
    DASHBOARD_DIR,
    REPO,
    contract_metric_names,
    dashboard_queries,
    iter_panels,
    load_dashboards,
    metric_names_in,
    per_job_metric_names,
)

EXPECTED_DASHBOARDS = {
    "fleet-gpu-health.json": ("healthagent-fleet", {"cluster", "node"}),
    "node-drilldown.json": ("healthagent-node", {"cluster", "node"}),
    "efa-network.json": ("healthagent-efa", {"cluster", "node"}),
    "elastic-training.json": ("healthagent-training", {"cluster", "node", "job"}),
    "remediation.json": ("healthagent-remediation", {"cluster", "node"}),
    "rdma-fabric.json": ("healthagent-rdma", {"cluster", "node"}),
}

# The panels each dashboard must have (title -> a metric its queries must use).
REQUIRED_PANELS = {
    "fleet-gpu-health.json": {
        "Nodes by verdict": "healthagent_node_action",
        "Nodes tainted": "healthagent_node_taint_applied",
        "Budget holding back": "healthagent_budget_holding_taint",
        "XIDs by code": "healthagent_xid_errors_total",
        "Uncorrectable (DBE) ECC errors / s": "healthagent_gpu_ecc_errors_total",
        "Correctable (SBE) ECC errors / s": "healthagent_gpu_ecc_errors_total",
        "Row remapping pending / failed": "healthagent_gpu_row_remap_pending",
        "GPUs lost or missing": "healthagent_gpu_up",
        "Top offending nodes": "healthagent_findings",
    },
    "node-drilldown.json": {
        "ECC errors / s by GPU": "healthagent_gpu_ecc_errors_total",
        "Row remapping": "healthagent_gpu_remapped_rows",
        "XIDs by GPU": "healthagent_xid_errors_total",
        "Throttle reasons": "healthagent_gpu_throttle_reasons",
        "Temperature": "healthagent_gpu_temperature_celsius",
        "Power": "healthagent_gpu_power_watts",
        "NVLink errors / s": "healthagent_nvlink_errors_total",
        "Open findings": "healthagent_findings",
    },
    "efa-network.json": {
        "Transmit throughput": "healthagent_efa_tx_bytes_total",
        "Receive throughput": "healthagent_efa_rx_bytes_total",
        "Retransmitted packets / s": "healthagent_efa_retrans_pkts_total",
        "Retransmit timeouts": "healthagent_efa_retrans_timeout_events_total",
        "Unresponsive / impaired remote peers": "healthagent_efa_unresponsive_remote_events_total",
        "Port state": "healthagent_efa_port_up",
    },
    "elastic-training.json": {
        "World size": "healthagent_training_world_size",
        "Scaling events": "healthagent_scaling_events_total",
        "Tokens / s": "healthagent_training_tokens_total",
        "Step time quantiles": "healthagent_training_step_seconds_bucket",
        "Goodput": "healthagent_training_productive_seconds_total",
    },
    "rdma-fabric.json": {
        "Port state": "healthagent_infiniband_port_up",
        "Port rate": "healthagent_infiniband_rate_bytes_per_second",
        "Throughput per port": "healthagent_infiniband_port_data_transmitted_bytes_total",
        "Link flaps and errors": "healthagent_infiniband_link_downed_total",
        "Congestion": "healthagent_infiniband_port_transmit_wait_total",
        "ConnectX adapter events": "healthagent_mlx5_events_total",
        "Nodes with a fatal adapter event": "healthagent_mlx5_events_total",
    },
    "remediation.json": {
        "Nodes per stage": "healthagent_remediation_stage",
        "Nodes in the pipeline": "healthagent_remediation_stage_info",
        "Time in stage, p50": "healthagent_remediation_stage_duration_seconds_bucket",
        "Time in stage, p99": "healthagent_remediation_stage_duration_seconds_bucket",
        "Budget per scope": "healthagent_budget_slots_held",
        "Hand-offs per engine": "healthagent_remediation_stage_info",
        "Clears and conditions owned elsewhere": "healthagent_conditions_owned_elsewhere",
    },
}

DASHBOARDS = load_dashboards()


# -- drift --------------------------------------------------------------------------------------

def test_committed_json_matches_a_fresh_generation():
    assert generate.stale() == [], "dashboard JSON is stale: run python -m dashboards.generate"


def test_every_source_has_its_json_and_no_json_is_orphaned():
    sources = {generate.json_path(s).name for s in generate.sources()}
    assert sources == set(EXPECTED_DASHBOARDS) == set(DASHBOARDS)


def test_generation_in_a_fresh_interpreter_is_byte_identical(tmp_path):
    """Sorted keys and computed ids: another process (another hash seed) writes the same bytes."""
    copy = tmp_path / "dashboards"
    shutil.copytree(DASHBOARD_DIR, copy, ignore=shutil.ignore_patterns("*.json", "__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "dashboards.generate", "--dir", str(copy)], cwd=REPO, capture_output=True,
        text=True, timeout=120, env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    for name in EXPECTED_DASHBOARDS:
        assert (copy / name).read_bytes() == (DASHBOARD_DIR / name).read_bytes(), name


def test_check_mode_names_a_stale_file_and_fails(tmp_path, capsys):
    copy = tmp_path / "dashboards"
    shutil.copytree(DASHBOARD_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert generate.main(["--check", "--dir", str(copy)]) == 0
    edited = copy / "efa-network.json"
    edited.write_text(edited.read_text().replace('"Transmit throughput"', '"Hand-edited"'))
    (copy / "node-drilldown.json").unlink()
    assert generate.main(["--check", "--dir", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "efa-network.json" in err and "node-drilldown.json" in err
    assert "fleet-gpu-health.json" not in err


# -- structure ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(EXPECTED_DASHBOARDS))
def test_dashboard_identity_and_schema(name):
    dash = DASHBOARDS[name]
    uid, _ = EXPECTED_DASHBOARDS[name]
    assert dash["uid"] == uid
    assert dash["schemaVersion"] == SCHEMA_VERSION >= 36  # Grafana 9+ panel schema
    assert dash["title"].startswith("healthagent / ")
    assert "healthagent" in dash["tags"]
    assert dash["id"] is None  # import assigns it; a fixed id would overwrite another dashboard


@pytest.mark.parametrize("name", sorted(EXPECTED_DASHBOARDS))
def test_template_variables(name):
    variables = {v["name"]: v for v in DASHBOARDS[name]["templating"]["list"]}
    _, expected = EXPECTED_DASHBOARDS[name]
    assert set(variables) == {"datasource"} | expected
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for var_name in expected:
        var = variables[var_name]
        assert var["type"] == "query"
        assert var["datasource"] == DATASOURCE
        assert re.fullmatch(r"label_values\(healthagent_[a-z_]+(\{[^}]*\})?, " + var_name + r"\)", var["query"])
    # cluster may be absent (single cluster): "All" must be a regex that also matches no label.
    assert variables["cluster"]["includeAll"] and variables["cluster"]["allValue"] == ".*"
    if name == "node-drilldown.json":
        assert not variables["node"]["includeAll"] and not variables["node"]["multi"]
    else:
        assert variables["node"]["includeAll"] and variables["node"]["allValue"] == ".*"


@pytest.mark.parametrize("name", sorted(EXPECTED_DASHBOARDS))
def test_every_panel_and_query_uses_the_datasource_variable(name):
    panels = list(iter_panels(DASHBOARDS[name]))
    assert panels
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == DATASOURCE, panel["title"]
    for annotation in DASHBOARDS[name]["annotations"]["list"]:
        if "expr" in annotation:
            assert annotation["datasource"] == DATASOURCE


@pytest.mark.parametrize("name", sorted(EXPECTED_DASHBOARDS))
def test_panels_have_unique_ids_titles_descriptions_and_do_not_overlap(name):
    panels = list(iter_panels(DASHBOARDS[name]))
    ids = [p["id"] for p in panels]
    assert ids == list(range(1, len(panels) + 1))
    assert len({p["title"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        assert p["description"], p["title"]
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps at {(x, y)}"
                cells.add((x, y))
    refs = [[t["refId"] for t in p["targets"]] for p in panels]
    assert all(len(r) == len(set(r)) for r in refs)


@pytest.mark.parametrize("name,title,metric", [
    (name, title, metric) for name, panels in REQUIRED_PANELS.items() for title, metric in panels.items()])
def test_required_panel_exists_and_queries_its_metric(name, title, metric):
    panels = {p["title"]: p for p in iter_panels(DASHBOARDS[name])}
    assert title in panels
    assert any(metric in t["expr"] for t in panels[title]["targets"])


def test_the_fatal_adapter_table_lists_the_events_the_alert_fires_on():
    """Both come from the mlx5 catalog's rows that take the node out (the alert's list is held to
    the catalog in tests/policy/test_mlx5_events.py, the table's is generated from it): the table
    shows exactly the adapters HealthagentRdmaAdapterFatal fires for."""
    rules = yaml.safe_load((REPO / "alerts" / "healthagent.rules.yaml").read_text(encoding="utf-8"))
    [rule] = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "HealthagentRdmaAdapterFatal"]
    panels = {p["title"]: p for p in iter_panels(DASHBOARDS["rdma-fabric.json"])}
    [fatal] = panels["Nodes with a fatal adapter event"]["targets"]
    events = [re.search(r'event=~"([^"]+)"', expr).group(1) for expr in (fatal["expr"], rule["expr"])]
    assert events[0] == events[1] and "health_compromised" in events[0].split("|")
    assert fatal["instant"] and fatal["format"] == "table"


def test_goodput_is_productive_over_wall_time():
    panels = {p["title"]: p for p in iter_panels(DASHBOARDS["elastic-training.json"])}
    expr = panels["Goodput"]["targets"][0]["expr"]
    productive, _, wall = expr.partition(" / ")
    assert "healthagent_training_productive_seconds_total" in productive
    assert "healthagent_training_wall_seconds_total" in wall
    assert panels["Goodput"]["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_scaling_events_are_an_annotation():
    annotations = {a["name"]: a for a in DASHBOARDS["elastic-training.json"]["annotations"]["list"]}
    scaling = annotations["Scaling events"]
    assert scaling["enable"] is True
    assert "changes(" in scaling["expr"] and "healthagent_training_world_size" in scaling["expr"]


# -- queries ------------------------------------------------------------------------------------

QUERIES = dashboard_queries()
PER_JOB_METRICS = per_job_metric_names()
SELECTOR_RE = re.compile(r"(healthagent_[a-z0-9_]+)(\{[^}]*\})?")


def test_queries_were_found():
    assert len(QUERIES) > 60
    assert {q.dashboard for q in QUERIES} == set(EXPECTED_DASHBOARDS)


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: f"{q.dashboard}:{q.where}")
def test_query_names_only_contract_metrics(query):
    unknown = metric_names_in(query.expr) - contract_metric_names()
    assert not unknown, f"not in the metric contract: {sorted(unknown)}"


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: f"{q.dashboard}:{q.where}")
def test_every_selector_filters_by_the_dashboard_variables(query):
    """A query that ignores $cluster/$node/$job shows other clusters' data under a filter."""
    _, variables = EXPECTED_DASHBOARDS[query.dashboard]
    selectors = SELECTOR_RE.findall(query.expr)
    assert selectors
    for metric, matchers in selectors:
        assert 'cluster=~"$cluster"' in matchers, metric
        assert 'node=~"$node"' in matchers, metric
        if metric in PER_JOB_METRICS:
            assert 'job=~"$job"' in matchers, metric
