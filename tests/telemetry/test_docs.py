"""docs/metrics.md lists every exported metric; docs/training.md's PromQL parses; its example runs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from healthagent.telemetry import spec
from tests.support.observability import promtool_check_expressions
from tests.telemetry.harness import RunningAgent

REPO = Path(__file__).resolve().parents[2]
METRICS_DOC = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
TRAINING_DOC = (REPO / "docs" / "training.md").read_text(encoding="utf-8")


def doc_rows() -> dict[str, tuple[str, str]]:
    """metric name -> (type, labels cell) from the tables of docs/metrics.md."""
    rows = {}
    for line in METRICS_DOC.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) >= 3 and cells[0].startswith("`healthagent_"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


@pytest.mark.parametrize("metric", spec.HEALTH + spec.TRAINING + (spec.COLLECT_DURATION, spec.BUILD_INFO),
                         ids=lambda m: m.name)
def test_metrics_doc_lists_every_metric_with_type_and_labels(metric):
    rows = doc_rows()
    assert metric.full_name in rows, f"{metric.full_name} missing from docs/metrics.md"
    kind, labels = rows[metric.full_name]
    assert kind == metric.type
    documented = set() if labels == "-" else {
        re.match(r"`([a-z_]+)`", part.strip()).group(1) for part in labels.split(",")}
    assert documented == set(metric.labels)


def test_metrics_doc_has_the_efa_family_pattern():
    assert "healthagent_efa_<counter>_total" in doc_rows()


def promql_blocks(text: str) -> list[str]:
    """Expressions in ```promql blocks; a comment or blank line ends an expression."""
    expressions = []
    for block in re.findall(r"```promql\n(.*?)```", text, flags=re.S):
        current: list[str] = []
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                if current:
                    expressions.append(" ".join(current))
                current = []
            else:
                current.append(line.strip())
        if current:
            expressions.append(" ".join(current))
    return expressions


def test_training_doc_promql_parses(tmp_path):
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus); CI installs it")
    expressions = promql_blocks(TRAINING_DOC)
    assert len(expressions) >= 9
    result = promtool_check_expressions({f"doc_expr_{i}": e for i, e in enumerate(expressions)}, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
def test_training_doc_three_line_example_runs(agent: RunningAgent):
    block = re.search(r"## In a training script.*?```python\n(.*?)```", TRAINING_DOC, flags=re.S).group(1)
    lines = [line.split("#")[0].rstrip() for line in block.strip().splitlines()]
    assert len(lines) == 3
    setup = lines[0] + "\n" + lines[1].replace('job="llama3-70b")', f'job="llama3-70b", url="{agent.url}")')
    namespace: dict = {}
    exec(setup, namespace)
    for step in range(1, 4):
        namespace.update(step=step, global_tokens=4096, global_batch=8)
        exec(lines[2].strip(), namespace)
    namespace["reporter"].close(timeout=30)
    assert 'healthagent_training_steps_total{job="llama3-70b"} 3.0' in agent.scrape().text
