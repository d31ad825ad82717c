"""Fuzz the policy file loader with what an operator's ConfigMap could hold.

Whatever the file says, ``load_policy`` returns a ``Policy`` or raises ``PolicyError`` whose text is
one line (the key and the fix); no other exception escapes. Documents near the real schema (the
top-level keys, real threshold names, XID numbers, action words, finding codes and durations,
with wrong types mixed in) reach the validation of every field; random text and bytes reach the
YAML parser's errors.
"""

from __future__ import annotations

import fnmatch
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthagent.model import Action
from healthagent.policy.catalog import load_catalog
from healthagent.policy.rdma_ports_file import never_matches
from healthagent.policy.settings import THRESHOLDS, TOP_LEVEL_KEYS, Policy, PolicyError, load_policy

pytestmark = pytest.mark.reliability

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**20), st.floats(), st.text(max_size=20)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=15)
actions = st.one_of(st.sampled_from([a.value for a in Action]), st.sampled_from(["REPLACE_NODE", "reboot", ""]),
                    anything)
numbers = st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                    st.booleans(), st.none())
near_schema = st.fixed_dictionaries({}, optional={
    "xid": st.one_of(st.dictionaries(st.one_of(st.integers(-3, 200), st.text(max_size=4)), actions, max_size=5),
                     anything),
    "sxid": st.one_of(st.dictionaries(st.integers(0, 30000), actions, max_size=3), anything),
    "thresholds": st.one_of(st.dictionaries(st.one_of(st.sampled_from(sorted(THRESHOLDS)), st.text(max_size=8)),
                                            numbers, max_size=6), anything),
    "disabled_rules": st.one_of(st.lists(st.one_of(st.sampled_from(["GPU_POWER_THROTTLE", "EFA_RX_DROPS",
                                                                    "gpu_xid", "NOPE"]), anything), max_size=4),
                                anything),
    "findings": st.one_of(st.dictionaries(
        st.one_of(st.sampled_from(["GPU_NVLINK_ERRORS", "gpu_xid", "GPU_THERMAL_THROTTLE", "NOPE"]), st.text(max_size=8)),
        st.one_of(st.dictionaries(st.one_of(st.sampled_from(["count", "window", "sustain", "after_boot_grace"]),
                                            st.text(max_size=6)),
                                  st.one_of(numbers, st.sampled_from(["10m", "90s", "1h", "1.5m", "-5m", "5 m"])),
                                  max_size=4), anything), max_size=3), anything),
    "unknown": anything,
})


def load_text(text: str | bytes) -> Policy | None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
        try:
            policy = load_policy(str(path))
        except PolicyError as exc:
            message = str(exc)
            assert message and "\n" not in message, message
            return None
    assert isinstance(policy, Policy)
    load_catalog(policy)  # a policy that loads must also merge into the catalog
    return policy


@FUZZ
@given(near_schema)
def test_documents_near_the_schema(document):
    try:
        text = yaml.safe_dump(document, allow_unicode=True)
    except yaml.YAMLError:
        return
    policy = load_text(text)
    if policy is not None:
        assert set(document) <= set(TOP_LEVEL_KEYS)
        assert all(isinstance(a, Action) for a in policy.xid_actions.values())


@FUZZ
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300), anything.map(lambda d: yaml.safe_dump(d))))
def test_any_file_content(content):
    load_text(content)


@pytest.mark.parametrize("content", [b"\x80", b"xid:\n  94: restart_app\n  \xff\xfe: x\n", "é".encode("latin-1")])
def test_a_file_that_is_not_utf8_is_one_clear_line(tmp_path, content):
    """Found by the fuzzer above: a non-UTF-8 file escaped as UnicodeDecodeError (a traceback at
    start-up). Both files read through ``config.read_yaml`` now name the file and the fix."""
    from healthagent.config import ConfigError, load_settings

    path = tmp_path / "file.yaml"
    path.write_bytes(content)
    with pytest.raises(PolicyError, match=r"^policy: '.*file\.yaml' is not UTF-8 text \(byte \d+\); save it as UTF-8$"):
        load_policy(str(path))
    with pytest.raises(ConfigError, match=r"^config: '.*file\.yaml' is not UTF-8 text"):
        load_settings(env={}, config_file=str(path))


@pytest.mark.parametrize("text, message", [
    ('thresholds: {"\\n": 1}\n', "thresholds.'\\n': unknown threshold; valid: "),
    ('xid: {"9\\n4": restart_app}\n', "xid.'9\\n4': '9\\n4' is not an XID number; use an integer such as 94"),
    ("thresholds: {nope: 1}\n", "thresholds.nope: unknown threshold; valid: "),
])
def test_a_key_with_a_newline_stays_on_one_line(tmp_path, text, message):
    """Found by the fuzzer above: a key with a newline was written raw into the message (two lines,
    and a way to forge a log line); such keys are quoted now, plain ones stay as written."""
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as caught:
        load_policy(str(path))
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


PORT_NAMES = ("mlx5_0/1", "mlx5_7/1", "mlx5_10/2", "mlx4_0/1", "ibp75s0", "ens1f0np0", "rdmap79s0/1", "bnxt_re0/1")


@FUZZ
@given(st.text(alphabet="mlx5_0179/[]!-*?aibpz", max_size=14))
def test_a_port_pattern_refused_as_matching_nothing_matches_no_port(pattern):
    """``never_matches`` only ever refuses what no port name or interface can match: a pattern that
    matches one of these names is never called one that matches nothing."""
    if any(fnmatch.fnmatchcase(name, pattern) for name in PORT_NAMES):
        assert never_matches(pattern) is None, pattern
