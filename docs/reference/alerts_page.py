"""docs/reference/alerts.md: every alert and recording rule of alerts/healthagent.rules.yaml, and
the Alertmanager routes of alerts/alertmanager.yaml, with the receivers each alert reaches.

The receivers are worked out from the route tree as Alertmanager walks it (first matching branch,
``continue`` goes on), so the table says where an alert lands without a reader walking the tree;
tests/test_references_current.py checks that walk against the amtool cases of
alerts/routes-tests.yaml.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from page_text import anchor, code, first_line, generated_note, item, row, wrap

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "healthagent.rules.yaml"
ALERTMANAGER = REPO / "alerts" / "alertmanager.yaml"
TARGET = Path(__file__).with_name("alerts.md")
SOURCES = "`alerts/healthagent.rules.yaml` and `alerts/alertmanager.yaml`"
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"?(.*?)"?\s*$')
_METRIC = re.compile(r"(?<![\w:])(healthagent_[a-z0-9_]+)(?![\w:])")


@dataclass(frozen=True)
class Rule:
    """One rule of the file: an alert or a recording rule, with its expression as written."""

    group: str
    body: dict
    expr: str  # the expression's lines as the file lays them out, dedented

    @property
    def name(self) -> str:
        return self.body.get("alert") or self.body["record"]

    @property
    def is_alert(self) -> bool:
        return "alert" in self.body


def _written(text: str, node: yaml.Node) -> str:
    """A scalar as the file lays it out: a block scalar keeps its lines (folded ones would run
    into one long line), a plain or quoted one is one line."""
    if node.style in (">", "|"):
        lines = text.splitlines()[node.start_mark.line + 1:node.end_mark.line]
        return textwrap.dedent("\n".join(lines)).strip()
    return " ".join(str(node.value).split())


def _value(mapping: yaml.MappingNode, key: str) -> yaml.Node | None:
    return next((v for k, v in mapping.value if k.value == key), None)


def rules() -> list[Rule]:
    """Every rule of every group, in the file's order."""
    text = RULES.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    tree = yaml.compose(text)
    out = []
    for group, group_node in zip(data["groups"], _value(tree, "groups").value):
        for body, rule_node in zip(group["rules"], _value(group_node, "rules").value):
            out.append(Rule(group["name"], body, _written(text, _value(rule_node, "expr"))))
    return out


def metrics_of(rule: Rule) -> set[str]:
    """The agent's metric names a rule's expression reads (recording rules' names excluded)."""
    return set(_METRIC.findall(rule.expr))


# -- Alertmanager's route tree ---------------------------------------------------------------------

def _matches(matcher: str, labels: dict[str, str]) -> bool:
    found = _MATCHER.fullmatch(matcher)
    if found is None:
        raise ValueError(f"alerts/alertmanager.yaml: matcher {matcher!r} is not NAME OP \"VALUE\"")
    name, op, value = found.groups()
    have = labels.get(name, "")
    if op in ("=~", "!~"):
        hit = re.fullmatch(value, have) is not None
        return hit if op == "=~" else not hit
    return (have == value) if op == "=" else (have != value)


def _route_matches(route: dict, labels: dict[str, str]) -> bool:
    matchers = list(route.get("matchers", []))
    matchers += [f'{k}="{v}"' for k, v in route.get("match", {}).items()]
    matchers += [f'{k}=~"{v}"' for k, v in route.get("match_re", {}).items()]
    return all(_matches(m, labels) for m in matchers)


def receivers_for(labels: dict[str, str], route: dict | None = None) -> list[str]:
    """The receivers an alert with ``labels`` reaches, as Alertmanager routes it."""
    route = route if route is not None else yaml.safe_load(ALERTMANAGER.read_text(encoding="utf-8"))["route"]
    found: list[str] = []
    for child in route.get("routes", []):
        if _route_matches(child, labels):
            child = {"receiver": route.get("receiver"), **child}
            found += receivers_for(labels, child)
            if not child.get("continue", False):
                break
    return found or [route["receiver"]]


INHERITED = ("receiver", "group_by", "group_wait", "group_interval", "repeat_interval")


def _branches(route: dict, depth: int = 0) -> Iterator[tuple[int, dict]]:
    """Every branch under ``route``, depth first, with what it inherits from its parents filled in."""
    for child in route.get("routes", []):
        child = {**{k: route[k] for k in INHERITED if k in route}, **child}
        yield depth, child
        yield from _branches(child, depth + 1)


# -- the page --------------------------------------------------------------------------------------

def _labels(rule: Rule) -> dict[str, str]:
    return {"alertname": rule.name, **{k: str(v) for k, v in rule.body.get("labels", {}).items()}}


def _runbook(rule: Rule) -> str:
    url = rule.body.get("annotations", {}).get("runbook_url", "")
    if not url:
        return "-"
    return f"[{url}](../{url.removeprefix('docs/')})" if url.startswith("docs/") else url


def _alert_section(rule: Rule) -> list[str]:
    labels = rule.body.get("labels", {})
    annotations = rule.body.get("annotations", {})
    facts = [f"severity {code(labels.get('severity', '-'))}", f"team {code(labels.get('team', '-'))}",
             f"for {code(rule.body.get('for', '0s'))}", f"group {code(rule.group)}",
             "receivers " + ", ".join(code(r) for r in receivers_for(_labels(rule)))]
    return [f"### {rule.name}", "", wrap(annotations.get("summary", "")), "",
            wrap("; ".join(facts) + "; runbook " + _runbook(rule) + "."), "",
            "```promql", rule.expr, "```", ""]


def _summary_table(alerts: list[Rule]) -> list[str]:
    lines = ["| alert | severity | team | for | receivers |", "| --- | --- | --- | --- | --- |"]
    for rule in alerts:
        labels = rule.body.get("labels", {})
        lines.append(row((f"[{rule.name}](#{anchor(rule.name)})", labels.get("severity", "-"),
                          labels.get("team", "-"), rule.body.get("for", "0s"),
                          ", ".join(receivers_for(_labels(rule))))))
    return lines


def _records(records: list[Rule]) -> list[str]:
    lines: list[str] = []
    for group in dict.fromkeys(r.group for r in records):
        lines += [f"### Group `{group}`", ""]
        for rule in (r for r in records if r.group == group):
            lines += [f"- {code(rule.name)}", "", "  ```promql", textwrap.indent(rule.expr, "  "), "  ```", ""]
    return lines


def _routes() -> list[str]:
    config = yaml.safe_load(ALERTMANAGER.read_text(encoding="utf-8"))
    route = config["route"]
    lines = [wrap(f"Alerts that match no branch go to {code(route['receiver'])}, grouped by "
                  + ", ".join(code(g) for g in route.get("group_by", [])) + ". The branches, in the order "
                  "Alertmanager tries them (the first that matches takes the alert unless it says continue):"),
             "", "| matchers | receiver | continue | group_wait | repeat_interval |", "| --- | --- | --- | --- | --- |"]
    for depth, branch in _branches(route):
        matchers = ", ".join(code(m) for m in branch.get("matchers", [])) or "-"
        lines.append(row(("&nbsp;&nbsp;" * depth + matchers, code(branch["receiver"]),
                          "yes" if branch.get("continue") else "no", branch.get("group_wait", "-"),
                          branch.get("repeat_interval", "-"))))
    lines += ["", "Inhibitions:", ""]
    for rule in config.get("inhibit_rules", []):
        lines.append(item(", ".join(code(m) for m in rule.get("source_matchers", [])) + " mutes "
                          + ", ".join(code(m) for m in rule.get("target_matchers", [])),
                          "when " + ", ".join(code(e) for e in rule.get("equal", [])) + " are equal."))
    lines += ["", "Receivers:", ""]
    for receiver in config.get("receivers", []):
        kinds = [k.removesuffix("_configs") for k in receiver if k.endswith("_configs")]
        channels = [c["channel"] for k in receiver if k.endswith("_configs") for c in receiver[k] if "channel" in c]
        lines.append(item(code(receiver["name"]) + ":", (", ".join(kinds) or "sends nowhere")
                          + (" " + ", ".join(code(c) for c in channels) if channels else "")))
    return lines


def render() -> str:
    every = rules()
    alerts = [r for r in every if r.is_alert]
    records = [r for r in every if not r.is_alert]
    lines = [first_line(SOURCES), "", "# Alerts, recording rules and routes", "", generated_note(SOURCES), "",
             wrap("Each alert's receivers are where the example Alertmanager configuration sends it. "
                  "The runbooks are sections of the docs; `python deploy/generate.py --runbook-base URL` "
                  "puts the address of your copy in front of them in the generated PrometheusRule."), "",
             f"## Alerts ({len(alerts)})", ""] + _summary_table(alerts) + [""]
    for rule in alerts:
        lines += _alert_section(rule)
    lines += [f"## Recording rules ({len(records)})", ""] + _records(records)
    lines += ["## Alertmanager routes", ""] + _routes()
    return "\n".join(lines).rstrip("\n") + "\n"
