"""Settings: precedence, conversion, and one-line errors that name the key and the fix."""

import pytest

from healthagent.config import ConfigError, load_settings


def test_defaults(tmp_path):
    s = load_settings(env={})
    assert s.listen == "0.0.0.0:9410"
    assert s.kube == "in-cluster"
    assert s.replace_noexecute_grace_seconds == 120.0


def test_precedence_yaml_env_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("nvml-interval-seconds: 5\nexpected_gpus: 8\nkube: dry-run\n")
    env = {"HEALTHAGENT_NVML_INTERVAL_SECONDS": "3", "NODE_NAME": "node-a"}
    s = load_settings(flags={"expected_gpus": "4"}, env=env, config_file=str(cfg))
    assert s.nvml_interval_seconds == 3.0  # env beats YAML
    assert s.expected_gpus == 4  # flag beats YAML
    assert s.kube == "dry-run"
    assert s.node_name == "node-a"


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"HEALTHAGENT_NVML_INTERVAL_SECONDS": "abc"}, "HEALTHAGENT_NVML_INTERVAL_SECONDS"),
        ({"HEALTHAGENT_KUBE": "sometimes"}, "kube"),
        ({"HEALTHAGENT_LISTEN": "9410"}, "listen"),
        ({"HEALTHAGENT_BUDGET_MAX_FRACTION": "1.5"}, "budget_max_fraction"),
        ({"HEALTHAGENT_HYPERPOD_LABELS": "maybe"}, "HEALTHAGENT_HYPERPOD_LABELS"),
        ({"HEALTHAGENT_TAINT_KEY": "example.com/x"}, "taint_key"),
        ({"HEALTHAGENT_HOST_ROOT": "/nonexistent/root"}, "host_root"),
    ],
)
def test_bad_values_name_the_key(env, needle):
    with pytest.raises(ConfigError) as err:
        load_settings(env=env)
    line = str(err.value)
    assert needle in line and "\n" not in line


def test_unknown_yaml_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("nvml_intreval_seconds: 5\n")
    with pytest.raises(ConfigError, match="unknown key 'nvml_intreval_seconds'"):
        load_settings(env={}, config_file=str(cfg))


def test_broken_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(env={}, config_file=str(cfg))
