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


@pytest.mark.parametrize("key", ["budget_max_fraction", "nvml_interval_seconds", "source_timeout_seconds",
                                 "replace_noexecute_grace_seconds", "training_job_idle_seconds"])
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_non_finite_floats_are_refused(key, value):
    """nan compares false with every bound, so without this check it would pass validation."""
    with pytest.raises(ConfigError) as err:
        load_settings(env={f"HEALTHAGENT_{key.upper()}": value})
    line = str(err.value)
    assert f"HEALTHAGENT_{key.upper()}" in line and "not a finite number" in line and "\n" not in line


def test_non_finite_floats_from_yaml_are_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("budget_max_fraction: .nan\n")
    with pytest.raises(ConfigError, match="budget_max_fraction.*not a finite number"):
        load_settings(env={}, config_file=str(cfg))


@pytest.mark.parametrize("settings,needle,fix", [
    ({"taint_key": "healthagent.io/"}, "taint_key", "healthagent.io/"),
    ({"taint_key": "healthagent.io/has space"}, "taint_key", "healthagent.io/"),
    ({"taint_key": "healthagent.io/-dash-first"}, "taint_key", "healthagent.io/"),
    ({"taint_key": "healthagent.io/a/b"}, "taint_key", "healthagent.io/"),
    ({"taint_key": "healthagent.io/" + "x" * 64}, "taint_key", "healthagent.io/"),
    ({"budget_node_selector": "a=b,"}, "budget_node_selector", "selector syntax"),
    ({"budget_node_selector": "nvidia.com/gpu.present===true"}, "budget_node_selector", "selector syntax"),
    ({"budget_node_selector": "a in ()"}, "budget_node_selector", "selector syntax"),
    ({"budget_node_selector": "a in (x"}, "budget_node_selector", "selector syntax"),
    ({"budget_node_selector": "Bad_Prefix.com/x=1"}, "budget_node_selector", "selector syntax"),
    ({"budget_node_selector": "gpu=yes please"}, "budget_node_selector", "selector syntax"),
    ({"budget_node_selector": "count>many"}, "budget_node_selector", "selector syntax"),
    ({"budget_node_selector": "!a=b"}, "budget_node_selector", "selector syntax"),
    ({"state_file": ""}, "state_file", "hostPath"),
    ({"state_file": "   "}, "state_file", "hostPath"),
    ({"dcgm_url": "localhost:9400/metrics"}, "dcgm_url", "http(s)://HOST[:PORT]/PATH"),
    ({"dcgm_url": "ftp://localhost/metrics"}, "dcgm_url", "http(s)://HOST[:PORT]/PATH"),
    ({"dcgm_url": "http:///metrics"}, "dcgm_url", "http(s)://HOST[:PORT]/PATH"),
    ({"dcgm_url": "http://localhost:99999/metrics"}, "dcgm_url", "http(s)://HOST[:PORT]/PATH"),
    ({"dcgm_url": "http://local host/metrics"}, "dcgm_url", "http(s)://HOST[:PORT]/PATH"),
    ({"training_token": "two words"}, "training_token", "printable ASCII"),
    ({"training_token": "0123456789abcdef"}, "training_token", "16 characters; a key needs at least 32"),
    ({"training_token": "x" * 31}, "training_token", "openssl rand -hex 32"),
    ({"source_timeout_seconds": "0"}, "source_timeout_seconds", "greater than 0"),
    ({"idle_seconds": "0"}, "idle_seconds", "greater than 0"),
    ({"idle_seconds": "-1"}, "idle_seconds", "greater than 0"),
    ({"idle_seconds": "31"}, "idle_seconds", "use at most 30"),
])
def test_values_kubernetes_or_the_agent_would_reject_later_fail_at_start(settings, needle, fix):
    with pytest.raises(ConfigError) as err:
        load_settings(env={}, flags=settings)
    line = str(err.value)
    assert line.startswith(needle) and fix in line and "\n" not in line


def test_a_directory_is_not_a_state_file(tmp_path):
    with pytest.raises(ConfigError, match="state_file: .* is a directory"):
        load_settings(env={}, flags={"state_file": str(tmp_path)})


def test_the_training_token_never_appears_in_an_error_or_a_repr():
    secret = "s3cret token"
    with pytest.raises(ConfigError) as err:
        load_settings(env={"HEALTHAGENT_TRAINING_TOKEN": secret})
    assert "s3cret" not in str(err.value)
    settings = load_settings(env={"HEALTHAGENT_TRAINING_TOKEN": "s3cret-token-0123456789abcdef0123"})
    assert settings.training_token == "s3cret-token-0123456789abcdef0123" and "s3cret" not in repr(settings)


@pytest.mark.parametrize("settings", [
    {"taint_key": "healthagent.io/unhealthy"},
    {"taint_key": "healthagent.io/gpu.health_v2"},
    {"budget_node_selector": ""},
    {"budget_node_selector": "nvidia.com/gpu.present=true"},
    {"budget_node_selector": "nvidia.com/gpu.present==true,!node-role.kubernetes.io/control-plane"},
    {"budget_node_selector": "node.kubernetes.io/instance-type in (p5.48xlarge, p4d.24xlarge),tier notin (cpu)"},
    {"budget_node_selector": "gpus>0,empty="},
    {"dcgm_url": "http://localhost:9400/metrics"},
    {"dcgm_url": "https://[fd00::1]:9400/metrics"},
    {"dcgm_url": ""},  # unset: off
    {"training_token": "0123456789abcdef0123456789abcdef"},
    {"source_timeout_seconds": "0.5"},
])
def test_valid_values_are_accepted(settings):
    s = load_settings(env={}, flags=settings)
    for key, value in settings.items():
        assert str(getattr(s, key) or "") == str(float(value) if key.endswith("_seconds") else value)


@pytest.mark.parametrize("text,named", [
    ("state_file: /a\nstate_file: /b\n", "names key 'state_file' twice (lines 1 and 2)"),
    ("state-file: /a\nstate_file: /b\n", "'state-file' and 'state_file' in"),
])
def test_a_setting_given_twice_in_the_file_is_an_error_naming_both(tmp_path, text, named):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings(env={}, config_file=str(cfg))
    assert named in str(err.value) and "keep one" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key,value,needle", [
    ("nvml_interval_seconds", "1e308", "nvml_interval_seconds: 1e+308 is out of range; use at most 3600"),
    ("efa_interval_seconds", "86400", "use at most 3600"),
    ("expected_gpus", "100000000000000000000", "expected_gpus: 1e+20 is out of range; use at most 1024"),
    ("replace_noexecute_grace_seconds", "1e9", "use at most 604800"),
    ("kmsg_poll_seconds", "3600", "use at most 60"),
])
def test_numbers_past_any_meaning_are_refused(key, value, needle):
    with pytest.raises(ConfigError) as err:
        load_settings(env={f"HEALTHAGENT_{key.upper()}": value})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_value_of_thousands_of_digits_is_one_short_line():
    with pytest.raises(ConfigError) as err:
        load_settings(env={"HEALTHAGENT_EXPECTED_GPUS": "9" * 5000})
    assert "HEALTHAGENT_EXPECTED_GPUS" in str(err.value) and len(str(err.value)) < 300
