"""docs/reference/metrics.md: every metric family the agent exports, from the telemetry's own
declaration of them (``healthagent/telemetry/spec.py``, ``rdma_metrics.py``) and, for each, the
alerts and recording rules of alerts/healthagent.rules.yaml that read it.

The counter families that follow the files a driver exposes (EFA, InfiniBand/RoCE) are listed from
the tables that name them: the EFA driver's counter files and node_exporter's names.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from alerts_page import metrics_of, rules
from page_text import anchor, code, first_line, generated_note, item, row, wrap

from healthagent import bounded_names
from healthagent.config import Settings
from healthagent.demo.node import EFA_DEVICE_COUNTERS, EFA_PORT_COUNTERS
from healthagent.policy import rules_efa, rules_rdma
from healthagent.policy.finding_catalog import catalog_rows
from healthagent.policy.findings import FINDING_CODES
from healthagent.telemetry import rdma_metrics, spec
from healthagent.telemetry.metrics import efa_family_name
from healthagent.training.schema import MAX_JOB_LENGTH

TARGET = Path(__file__).with_name("metrics.md")
SOURCES = "`healthagent/telemetry/spec.py` and `healthagent/telemetry/rdma_metrics.py`"
# What `healthagent demo` serves on its healthy start; tests/telemetry/test_docs.py counts the
# series of the running demo agent and fails when this figure is not what it serves.
DEMO_SERIES = 1639
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _default(name: str) -> object:
    return next(f.default for f in fields(Settings) if f.name == name)


def _header() -> list[str]:
    facts = (
        f"Served on `GET /metrics` of the agent's own port (setting `listen`, default "
        f"`{_default('listen')}`; on the pod's IP, never the node's). Conventions: prefix `{spec.PREFIX}`, "
        "base units (`_seconds`, `_celsius`, `_watts`), counters end in `_total`, small fixed label sets. "
        "The agent never adds `node` or `cluster`: Prometheus does (the ServiceMonitor relabels the pod's "
        "node name to `node`; `cluster` comes from external labels). A value the hardware or driver does "
        "not report is absent, never `0`: `0` always means supported and zero.",
        f"Series per node: `healthagent demo`'s healthy node (8 GPUs, 32 EFA devices) serves **{DEMO_SERIES:,} "
        f"series**. Beyond that, bounded by what can happen on one node: one `xid_errors_total` per "
        f"(GPU, XID) seen, one `sxid_errors_total` per (switch, SXid), one `findings` per (code, action) open "
        f"({len(FINDING_CODES)} codes), and the per-job training series for at most `training_max_jobs` "
        f"(default {_default('training_max_jobs')}) jobs of names up to {MAX_JOB_LENGTH} characters. Names "
        f"read from text or sysfs are capped: {bounded_names.RDMA_PORTS} InfiniBand/RoCE ports, "
        f"{bounded_names.XID_UNMATCHED_PCI} unmatched XID PCI ids, {bounded_names.SXID_SWITCHES} NVSwitches, "
        f"{bounded_names.UNMAPPED_NUMBERS} unnamed XID/SXid numbers; the rest fold into "
        f"`\"{bounded_names.OVERFLOW}\"` (`healthagent_names_folded_total`). No metric has a per-pod, per-rank "
        "or per-request label.",
    )
    return [first_line(SOURCES), "", "# Metrics", "", generated_note(SOURCES), ""] + [
        line for fact in facts for line in (wrap(fact), "")]


def _targets() -> dict[str, str]:
    """Link label -> address, for the short ``[label]`` links the page uses (a table row stays
    readable with a name where an address would double it): alerts, recording rules, findings."""
    out = {rule.name: "alerts.md#" + (anchor(rule.name) if rule.is_alert else anchor(f"Group `{rule.group}`"))
           for rule in rules()}
    out.update({row.code: "../" + row.runbook.removeprefix("docs/") for row in catalog_rows()})
    return out


def _definitions(text: str) -> list[str]:
    """The link definitions of the labels the page uses, in the order of the labels."""
    targets = _targets()
    used = sorted({label for label in re.findall(r"\[([^\]\[]+)\](?![(\[:])", text) if label in targets})
    return [f"[{label}]: {targets[label]}" for label in used]


def _readers() -> dict[str, list[str]]:
    """Metric family -> the alerts and recording rules that read it, as links into alerts.md."""
    out: dict[str, list[str]] = {}
    for rule in rules():
        for name in sorted(metrics_of(rule)):
            for suffix in HISTOGRAM_SUFFIXES:
                name = name.removesuffix(suffix) if name.endswith(suffix) else name
            out.setdefault(name, []).append(f"[{rule.name}]")
    return out


def _rules_reading(rate_rules: tuple[tuple[str, tuple[str, ...], str], ...]) -> dict[str, str]:
    """Counter file -> the finding codes whose rate rules read it, as links to their runbooks."""
    out: dict[str, list[str]] = {}
    for finding, counters, _ in rate_rules:
        for counter in counters:
            out.setdefault(counter, []).append(f"[{finding}]")
    return {counter: ", ".join(codes) for counter, codes in out.items()}


def _family(metric: spec.MetricSpec, readers: dict[str, list[str]]) -> str:
    labels = ", ".join(code(label) for label in metric.labels) or "no labels"
    read_by = readers.get(metric.full_name, [])
    text = metric.help + (f" Read by {', '.join(read_by)}." if read_by else "")
    return item(f"{code(metric.full_name)} ({metric.type}; {labels}):", text)


def _record_groups(metrics: tuple[spec.MetricSpec, ...]) -> list[str]:
    """The rule groups whose recording rules read any of ``metrics``, in the file's order."""
    names = {m.full_name for m in metrics}
    found = [rule.group for rule in rules() if not rule.is_alert and any(
        name.removesuffix(suffix) in names for name in metrics_of(rule) for suffix in HISTOGRAM_SUFFIXES)]
    return list(dict.fromkeys(found))


def _section(title: str, intro: str, metrics: tuple[spec.MetricSpec, ...], readers: dict[str, list[str]]) -> list[str]:
    groups = _record_groups(metrics)
    if groups:
        intro += " Fleet views of them are the recording rules of " + ", ".join(
            f"[group `{g}`](alerts.md#{anchor(f'Group `{g}`')})" for g in groups) + "."
    return [f"## {title}", ""] + ([wrap(intro), ""] if intro else []) + [
        _family(m, readers) for m in metrics] + [""]


def _efa(readers: dict[str, list[str]]) -> list[str]:
    pattern = spec.MetricSpec("efa_<counter>_total", "counter", spec.EFA_COUNTER_LABELS,
                              spec.EFA_COUNTER_HELP.format(counter="<counter>"))
    lines = ["## EFA driver counters", "", wrap(
        "One counter family per counter file the EFA driver exposes (a port's and its device's "
        "`hw_counters` merged), named from the file. The files of the amzn EFA driver:"), "",
        _family(pattern, {}), "", "| family | counter file | scope | alerts, records | finding rules |",
        "| --- | --- | --- | --- | --- |"]
    findings = _rules_reading(rules_efa.RATE_RULES)
    for scope, counters in (("port", EFA_PORT_COUNTERS), ("device", EFA_DEVICE_COUNTERS)):
        for counter in counters:
            name = efa_family_name(counter)
            lines.append(row((code(name), code(counter), scope, ", ".join(readers.get(name, [])) or "-",
                              findings.get(counter, "-"))))
    return lines + [""]


def _infiniband(readers: dict[str, list[str]]) -> list[str]:
    lines = _section("InfiniBand and RoCE ports", (
        "Every port of an RDMA device that is not an EFA, InfiniBand or Ethernet (RoCE) link layer, named as "
        "node_exporter's infiniband collector names it under the agent's prefix (same labels, same values: "
        "data counters in octets)."), rdma_metrics.RDMA, readers)
    pattern = spec.MetricSpec("infiniband_<counter>_total", "counter", rdma_metrics.LABELS,
                              rdma_metrics.COUNTER_HELP.format(file="<file>"))
    lines += [_family(pattern, {}), "", wrap(
        "One family per counter file: the PortCounters (`counters/`, and `counters_ext/`), and the driver "
        "counters (`hw_counters/`) under node_exporter's name, or `healthagent_infiniband_hw_<file>_total` "
        "for a driver counter node_exporter does not name:"), "",
        "| family | counter file | alerts, records | finding rules |", "| --- | --- | --- | --- |"]
    findings = _rules_reading(rules_rdma.RATE_RULES)
    for hw, table in ((False, rdma_metrics.PMA_NAMES), (True, rdma_metrics.HW_NAMES)):
        for file in table:
            name = rdma_metrics.counter_name(file, hw)
            where = f"hw_counters/{file}" if hw else file
            lines.append(row((code(name), code(where), ", ".join(readers.get(name, [])) or "-",
                              "-" if hw else findings.get(file, "-"))))
    return lines + [""]


def render() -> str:
    readers = _readers()
    lines = _header()
    lines += _section("Node health, verdict and effects", "Rendered from the loop's snapshot after every cycle.",
                      spec.HEALTH, readers)
    lines += _section("The agent itself", "These two exist before the first snapshot.",
                      (spec.COLLECT_DURATION, spec.BUILD_INFO), readers)
    lines += _efa(readers)
    lines += _infiniband(readers)
    lines += _section("Training", "Per job, from the training intake's reports ([training.md](../training.md)).",
                      spec.TRAINING, readers)
    text = "\n".join(lines).rstrip("\n") + "\n"
    return text + "\n" + "\n".join(_definitions(text)) + "\n"
