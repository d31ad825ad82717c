"""docs/policy.md is the page operators tune the policy from: every section of the file has its part there, every
example it shows is a policy the agent accepts, and the errors it quotes are the ones a wrong file gets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from healthagent.policy.scope import SECTION_KEYS
from healthagent.policy.settings import TOP_LEVEL_KEYS, parse_policy

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "policy.md").read_text(encoding="utf-8")


def test_every_top_level_key_of_the_policy_file_is_explained():
    headed = {word for heading in re.findall(r"^## (.+)$", DOC, flags=re.M) for word in re.split(r"[ ,]+", heading)}
    assert set(TOP_LEVEL_KEYS) <= headed, set(TOP_LEVEL_KEYS) - headed


def test_every_scope_key_is_in_the_scope_table():
    section = DOC.split("\n## scope", 1)[1]
    assert {key for key in SECTION_KEYS if f"| `{key}` |" in section} == set(SECTION_KEYS)


def test_every_example_is_a_policy_the_agent_accepts():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC, flags=re.S)
    assert blocks
    for block in blocks:
        parse_policy(yaml.safe_load(block))  # raises PolicyError naming the key


def test_the_quoted_errors_are_what_check_prints_for_a_wrong_file(tmp_path):
    """The error lines on the page come from ``check --policy-file`` on the files that cause them, exit 3."""
    quoted = re.search(r"```\n(healthagent: policy error: .*?)```", DOC, flags=re.S).group(1).splitlines()
    host = tmp_path / "host"
    host.mkdir()
    files = {"thresholds:\n  efa_rx_drop_per_minute: 500\n": quoted[0],
             'xid:\n  94: restart_app\n  "94": monitor\n': quoted[1]}
    for text, line in files.items():
        policy = tmp_path / "policy.yaml"
        policy.write_text(text, encoding="utf-8")
        result = subprocess.run([sys.executable, "-m", "healthagent", "check", "--policy-file", str(policy),
                                 "--host-root", str(host), "--no-nvml"],
                                capture_output=True, text=True, timeout=60, cwd=REPO)
        assert result.returncode == 3, result.stderr
        printed = result.stderr.strip().splitlines()[-1]
        assert printed.startswith(line.removesuffix("...").rstrip()), (printed, line)
