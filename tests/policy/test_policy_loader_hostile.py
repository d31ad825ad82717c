"""The policy loader against files written to weaken it: a key given twice on one line, YAML
anchors that stand for a billion values, and port patterns that can match nothing.

Each is refused with one line naming the key and the fix, in the one loader every section goes
through (``config.read_yaml`` for the YAML, ``config.shown`` for every value an error shows).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from healthagent.config import ConfigError, load_settings
from healthagent.policy.findings import FINDING_CODES
from healthagent.policy.settings import PolicyError, load_policy, parse_policy


def write(tmp_path, text: str) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return str(path)


def refusal(tmp_path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    message = str(caught.value)
    assert "\n" not in message and len(message.replace(path, "")) < 300, message
    return message


@pytest.mark.parametrize("text,named", [
    ("xid: {94: replace_node, 94: none}\n", "key 94 twice (line 1, columns 7 and 25)"),
    ("xid: {94: replace_node, 0x5e: none}\n", "key 94 twice (line 1, columns 7 and 25)"),
    ("{xid: {94: replace_node}, xid: {94: none}}\n", "key 'xid' twice (line 1, columns 2 and 27)"),
    ("findings: {GPU_NVLINK_ERRORS: {count: 1, count: 3}}\n", "key 'count' twice (line 1, columns 32 and 42)"),
    ('rdma_ports: {"mlx5_0/1": {up: true, up: false}}\n', "key 'up' twice (line 1, columns 27 and 37)"),
    ("thresholds: {xid_window_seconds: 60, xid_window_seconds: 1}\n", "key 'xid_window_seconds' twice (line 1"),
    ("findings:\n  GPU_NVLINK_ERRORS:\n    count: 1\n    window: 10m\n    count: 3\n", "key 'count' twice (lines 3 and 5)"),
    ("findings:\n  GPU_NVLINK_ERRORS: {count: 1, window: 10m,\n    count: 3}\n", "key 'count' twice (lines 2 and 3)"),
])
def test_a_key_given_twice_is_refused_on_one_line_and_at_every_level(tmp_path, text, named):
    """PyYAML keeps the last of two equal keys: ``{94: replace_node, 94: none}`` would take XID 94
    off the node with nothing said, whether the two are on one line or in a nested mapping."""
    message = refusal(tmp_path, text)
    assert named in message and message.endswith("keep one"), message


def test_a_key_given_twice_in_the_settings_file_is_refused_on_one_line(tmp_path):
    path = tmp_path / "settings.yaml"
    path.write_text("{kube: dry-run, node_name: a, kube: in-cluster}\n")
    with pytest.raises(ConfigError, match=r"names key 'kube' twice \(line 1, columns 2 and 31\); keep one$"):
        load_settings(env={}, config_file=str(path))


LAUGHS = "\n".join(
    ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"{chr(98 + k)}: &{chr(98 + k)} [" + ", ".join([f"*{chr(97 + k)}"] * 10) + "]" for k in range(8)]
    + ["thresholds: {incident_quiet_seconds: *i}"]) + "\n"


@pytest.mark.parametrize("text,named", [
    ("thresholds: {incident_quiet_seconds: &q 60, xid_dedupe_seconds: *q}\n", "anchor &q at line 1"),
    ("xid: &x {94: replace_node}\n", "anchor &x at line 1"),
    (LAUGHS, "anchor &a at line 1"),
])
def test_anchors_and_aliases_are_refused_before_any_value_is_built(tmp_path, text, named):
    message = refusal(tmp_path, text)
    assert f"uses the YAML {named}; write the value out where it is used" in message, message


def test_a_billion_laughs_policy_stops_the_agent_with_one_line_and_bounded_memory(tmp_path):
    """A kilobyte of nested aliases where a number belongs: the error message used to render the
    value (10**9 items), which took gigabytes. The agent runs under a 1 GiB address-space limit
    here: a rendering would fail with MemoryError (a traceback, exit 1)."""
    policy = write(tmp_path, LAUGHS)
    assert len(LAUGHS) < 1024

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = subprocess.run([sys.executable, "-m", "healthagent", "check", "--no-nvml", "--host-root",
                           str(tmp_path), "--policy-file", policy], capture_output=True, text=True,
                          preexec_fn=limit_memory, env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "anchor &a at line 1" in done.stderr, done.stderr[-2000:]


class Leaf:
    """A value that counts how often an error message renders it."""

    renders = 0

    def __repr__(self) -> str:
        Leaf.renders += 1
        return "lol"


def laughs(depth: int = 16):
    """A value of 2**depth leaves built from shared lists: small in memory, huge when rendered."""
    value: object = [Leaf(), Leaf()]
    for _ in range(depth):
        value = [value, value]
    return value


@pytest.mark.parametrize("document", [
    {"thresholds": {"incident_quiet_seconds": laughs()}},
    {"xid": {94: laughs()}},
    {"disabled_rules": [laughs()]},
    {"findings": {"GPU_NVLINK_ERRORS": {"count": laughs()}}},
    {"findings": {"GPU_NVLINK_ERRORS": {"window": laughs()}}},
    {"rdma_ports": {"mlx5_0/1": {"up": laughs()}}},
    {"rdma_ports": {"mlx5_0/1": {"rate_gbps": laughs()}}},
], ids=["threshold", "xid", "disabled_rules", "count", "window", "up", "rate_gbps"])
def test_an_error_never_renders_a_value_whole(document):
    """Every error about a value shows at most a few of its items: the cost of the message is
    bounded whatever the value holds (a parsed document can share one list 2**16 times)."""
    Leaf.renders = 0
    with pytest.raises(PolicyError) as caught:
        parse_policy(document)
    message = str(caught.value)
    assert Leaf.renders <= 16 and "\n" not in message, (Leaf.renders, message[:400])
    assert len(message.replace(", ".join(FINDING_CODES), "")) < 400, message


def test_a_setting_never_renders_a_value_whole():
    Leaf.renders = 0
    with pytest.raises(ConfigError) as caught:
        load_settings(env={}, flags={"listen": laughs()})
    assert Leaf.renders <= 16 and str(caught.value).startswith("flag --listen=[[")


@pytest.mark.parametrize("pattern,fix", [
    ("mlx5_[7-0]/1", "[7-0] matches no character, so the pattern matches no port and its rule would be off; "
                     "write a range from low to high, e.g. [0-7]"),
    ("ibp[z-a]s0", "[z-a] matches no character"),
    ("mlx5_0/1/1", "a pattern with two '/' matches nothing; use e.g. mlx5_*/1"),
    ("mlx5_0/a", "after '/' comes the port number (1, 2, ...), which 'a' cannot match; use e.g. mlx5_0/1"),
    ("mlx5_*/[a-z]", "which '[a-z]' cannot match"),
    ("mlx5_0/", "put the port number after '/', e.g. mlx5_0/1"),
    ("/1", "put the device name before '/', e.g. mlx5_0/1"),
])
def test_a_port_pattern_that_can_match_nothing_is_refused(tmp_path, pattern, fix):
    """``fnmatch`` drops a reversed range, so ``mlx5_[7-0]/1`` matches no port: the file would load
    and its rule would silently be off."""
    message = refusal(tmp_path, f'rdma_ports:\n  "{pattern}": {{up: true}}\n')
    assert message.startswith(f"policy: rdma_ports.{pattern}: ") or message.startswith(f"rdma_ports.{pattern}: ")
    assert fix in message, message


@pytest.mark.parametrize("pattern", ["mlx5_[0-7]/1", "mlx5_[!7-0]/1", "mlx5_*/*", "ibp*", "mlx5_[]]/1", "mlx5_[/1",
                                     "mlx5_0/[a1]", "*", "mlx5_?/1", "mlx5_1[0-5]/1"])
def test_port_patterns_that_can_match_are_accepted(pattern):
    assert parse_policy({"rdma_ports": {pattern: {"up": True}}}).rdma_ports[0].pattern == pattern


@pytest.mark.parametrize("text,reason", [
    ("thresholds: {xid_window_seconds: " + "1" * 5000 + "}\n", "Exceeds the limit (4300 digits) for integer string conversion"),
    ("thresholds: {xid_window_seconds: 2024-13-45}\n", "month must be in 1..12"),
])
def test_a_scalar_yaml_cannot_build_is_one_line(tmp_path, text, reason):
    """Found while refusing the above: PyYAML builds these while loading and raises ValueError,
    which escaped the loader as a traceback."""
    assert f"holds a value that cannot be read ({reason}); fix the file" in refusal(tmp_path, text)
