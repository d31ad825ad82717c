"""Every PromQL expression in every generated dashboard parses, checked by Prometheus' own parser.

Grafana's macros and the dashboard variables are replaced first, as Grafana does before it sends
a query; then all expressions go through ``promtool check rules`` as recording rules.
"""

from __future__ import annotations

import re

import pytest

from tests.support.observability import dashboard_queries, promtool_check_expressions, substitute

SAMPLE_VARIABLES = {"cluster": ".*", "node": "ip-10-0-1-17", "job": "llama-70b", "datasource": "prom"}


def _record_name(i: int) -> str:
    return f"dashboard_expr_{i:03d}"


@pytest.mark.integration
def test_every_dashboard_expression_parses(tmp_path):
    queries = dashboard_queries()
    exprs = {_record_name(i): substitute(q.expr, SAMPLE_VARIABLES) for i, q in enumerate(queries)}
    result = promtool_check_expressions(exprs, tmp_path)
    failing = [queries[int(n)] for n in re.findall(r"dashboard_expr_(\d{3})", result.stdout + result.stderr)]
    assert result.returncode == 0, f"{failing}\n{result.stdout}{result.stderr}"
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


@pytest.mark.integration
@pytest.mark.parametrize("broken", [
    'sum by (node (healthagent_gpu_up{node=~"x"})',  # unbalanced parenthesis
    "rate(healthagent_xid_errors_total)",  # a range function without a range
    'healthagent_gpu_up{node=~"ip-1"}[1m] + 1',  # arithmetic on a range vector
])
def test_the_check_rejects_broken_expressions(tmp_path, broken):
    """The check above can fail: promtool refuses expressions that do not parse."""
    result = promtool_check_expressions({"good": "vector(1)", "bad": broken}, tmp_path)
    assert result.returncode != 0
    assert "bad" in result.stdout + result.stderr


@pytest.mark.parametrize("expr,expected", [
    ('rate(x{node=~"$node"}[$__rate_interval])', 'rate(x{node=~"ip-10-0-1-17"}[1m])'),
    ('x{cluster=~"${cluster}",job=~"$job"}', 'x{cluster=~".*",job=~"llama-70b"}'),
    ("increase(x[$__range]) and changes(y[$__interval:])", "increase(x[10m]) and changes(y[15s:])"),
    ('x{node=~"$nodes"}', None),  # $nodes is not $node: left unsubstituted -> error
])
def test_substitute(expr, expected):
    if expected is None:
        with pytest.raises(ValueError, match="unsubstituted"):
            substitute(expr, SAMPLE_VARIABLES)
    else:
        assert substitute(expr, SAMPLE_VARIABLES) == expected
