"""docs/reference/metrics.md lists every exported metric; docs/training.md's PromQL parses; its example runs;
the example training pod gets its credential with the one documented command and reports."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from healthagent.telemetry import spec
from tests.support.observability import promtool_check_expressions
from healthagent.training.client import TrainingReporter, agent_base_url
from tests.telemetry.harness import RunningAgent, start_agent
from tests.support.nvml_stub import NO_CC

REPO = Path(__file__).resolve().parents[2]
METRICS_DOC = (REPO / "docs" / "reference" / "metrics.md").read_text(encoding="utf-8")
TRAINING_DOC = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
EXAMPLE_POD = REPO / "examples" / "training-pod.yaml"


def doc_rows() -> dict[str, tuple[str, set[str]]]:
    """metric name -> (type, label names) from the list items of docs/reference/metrics.md, each
    ``- `name` (type; `label`, `label`): help`` over as many lines as it wraps to."""
    rows = {}
    for entry in re.split(r"\n(?=- )", METRICS_DOC):
        found = re.match(r"- `(healthagent_[^`]+)` \((counter|gauge|histogram); (.*?)\):", " ".join(entry.split()))
        if found:
            cell = found.group(3)
            labels = set() if cell == "no labels" else {
                re.fullmatch(r"`([a-z_]+)`", part.strip()).group(1) for part in cell.split(",")}
            rows[found.group(1)] = (found.group(2), labels)
    return rows


@pytest.mark.parametrize("metric", spec.HEALTH + spec.TRAINING + (spec.COLLECT_DURATION, spec.BUILD_INFO),
                         ids=lambda m: m.name)
def test_metrics_doc_lists_every_metric_with_type_and_labels(metric):
    rows = doc_rows()
    assert metric.full_name in rows, f"{metric.full_name} missing from docs/reference/metrics.md"
    kind, labels = rows[metric.full_name]
    assert kind == metric.type
    assert labels == set(metric.labels)


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
    setup = lines[0] + "\n" + lines[1].replace('job="llama3-70b")', f'job="llama3-70b", url="{agent.intake_url}")')
    namespace: dict = {}
    exec(setup, namespace)
    for step in range(1, 4):
        namespace.update(step=step, global_tokens=4096, global_batch=8)
        exec(lines[2].strip(), namespace)
    namespace["reporter"].close(timeout=30)
    assert 'healthagent_training_steps_total{job="llama3-70b"} 3.0' in agent.scrape().text


def one_step_command(text: str) -> list[str]:
    """The documented command that gives a job its credential, as words."""
    (line,) = {m.strip() for m in re.findall(r"(kubectl -n healthagent exec ds/healthagent -- healthagent "
                                               r"training-token [^\n]*)", text)}
    return shlex.split(line)


def resolve_env(container: dict, secret: dict, host_ip: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it from this Secret and the pod's node."""
    env = {}
    for item in container["env"]:
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "secretKeyRef" in source:
            assert source["secretKeyRef"]["name"] == secret["metadata"]["name"], item
            env[item["name"]] = secret["stringData"][source["secretKeyRef"]["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.hostIP":
            env[item["name"]] = host_ip
    return env


@pytest.mark.integration
def test_the_example_pod_gets_its_credential_in_one_step_and_its_reports_are_accepted():
    text = EXAMPLE_POD.read_text(encoding="utf-8")
    pod = yaml.safe_load(text)
    words = one_step_command(text)
    assert words == one_step_command(TRAINING_DOC)  # the docs and the example say the same step
    pipe = words.index("|")
    assert words[pipe + 1:] == ["kubectl", "apply", "-f", "-"]
    command = words[words.index("--") + 1:pipe]
    key = "example-cluster-key-0123456789abcdef"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHAGENT_")}
    made = subprocess.run([sys.executable, "-m", *command], env={**env, "HEALTHAGENT_TRAINING_TOKEN": key},
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert made.returncode == 0, made.stderr
    secret = json.loads(made.stdout)
    assert secret["metadata"]["namespace"] == pod["metadata"]["namespace"]
    rank_env = resolve_env(pod["spec"]["containers"][0], secret, host_ip="127.0.0.1")
    assert agent_base_url(rank_env) == "http://127.0.0.1:9412"  # the intake's hostPort
    agent = start_agent(intake="token", key=key)
    try:
        reporter = TrainingReporter(url=agent.intake_url, env=rank_env)  # the job and token from env
        reporter.report_rendezvous(64)
        reporter.report_step(1, tokens=4096, samples=8, step_seconds=1.0)
        reporter.close(timeout=30)
        assert (reporter.stats().delivered, reporter.stats().rejected) == (2, 0)
        assert agent.intake.jobs() == ["llama3-70b"]
    finally:
        agent.server.stop()


@pytest.mark.integration
def test_metrics_doc_counts_the_series_the_demo_node_serves(tmp_path, monkeypatch):
    """The figure under "Series per node" is what `healthagent demo` serves on its healthy start."""
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.script import demo_settings
    from healthagent.demo.stub_setup import use_stub_nvml
    from healthagent.wiring import AgentRuntime
    from tests.support.wait import wait_for

    documented = int(re.search(r"\*\*([\d,]+)\s+series\*\*", METRICS_DOC).group(1).replace(",", ""))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HEALTHAGENT_STUB_NVML_SCENARIO", raising=False)
    node = build_demo_root(tmp_path / "host")
    use_stub_nvml(node.scenario)
    runtime = AgentRuntime(demo_settings(node, tmp_path))
    runtime.start()
    try:
        wait_for(lambda: runtime.agent.cycles > 2 and runtime.telemetry.snapshot is not None
                 and len(runtime.telemetry.snapshot.gpus) == 8 and len(runtime.telemetry.snapshot.efa) == 32
                 and all(item.last is not None for item in runtime.agent.scheduled),
                 what="the demo agent to read every source")
        with urllib.request.urlopen(f"http://127.0.0.1:{runtime.server.port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        runtime.stop()
    served = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    assert served == documented, (f"docs/reference/metrics.md says {documented:,} series; the demo node serves "
                                  f"{served:,} (DEMO_SERIES in docs/reference/metrics_page.py)")
