"""The agent's DaemonSet: where it runs, what it may touch, how Kubernetes checks it is alive."""

from __future__ import annotations

import copy

import pytest

from healthagent.config import ENV_PREFIX, TRAINING_PORT, Settings, load_settings
from healthagent.training.client import DEFAULT_PORT as CLIENT_DEFAULT_PORT
from tests.support.deploy import (
    OVERLAYS,
    agent_container,
    env_of,
    find,
    overlay_with_components,
    render,
)

pytestmark = pytest.mark.integration


def pod_spec(objects):
    return find(objects, "DaemonSet", "healthagent")["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tolerates_its_own_taint_with_both_effects_and_the_gpu_taints(rendered, overlay):
    tolerations = pod_spec(rendered[overlay])["tolerations"]
    assert tolerations == [
        {"key": "healthagent.io/unhealthy", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "healthagent.io/unhealthy", "operator": "Exists", "effect": "NoExecute"},
        {"key": "sagemaker.amazonaws.com/node-health-status", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists"},
    ]


def test_tolerated_taint_key_is_the_agents_default(rendered):
    keys = {t["key"] for t in pod_spec(rendered["generic"])["tolerations"]}
    assert Settings().taint_key in keys


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_runs_on_gpu_nodes_as_node_critical(rendered, overlay):
    spec = pod_spec(rendered[overlay])
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in [
        expr for term in terms for expr in term["matchExpressions"]]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["serviceAccountName"] == "healthagent"
    assert "hostNetwork" not in spec and "hostPID" not in spec


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_context_is_least_privilege(rendered, overlay):
    container = agent_container(rendered[overlay])
    assert container["securityContext"] == {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["SYSLOG"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod_spec(rendered[overlay])["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}


def test_privileged_kernel_log_component_makes_only_the_container_privileged(kubectl, tmp_path):
    objects = render(overlay_with_components(tmp_path, "generic", ["privileged-kernel-log"]), kubectl)
    context = agent_container(objects)["securityContext"]
    assert context["privileged"] is True
    # Kubernetes rejects allowPrivilegeEscalation=false together with privileged=true.
    assert "allowPrivilegeEscalation" not in context
    assert context["readOnlyRootFilesystem"] is True


def test_runtime_class_component_sets_nvidia(kubectl, tmp_path, rendered):
    objects = render(overlay_with_components(tmp_path, "generic", ["nvidia-runtime-class"]), kubectl)
    assert pod_spec(objects)["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in pod_spec(rendered["generic"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_host_paths_are_read_only_except_the_state_directory(rendered, overlay):
    spec = pod_spec(rendered[overlay])
    container = agent_container(rendered[overlay])
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    host = {path: volumes[m["name"]]["hostPath"] for path, m in mounts.items()
            if "hostPath" in volumes[m["name"]]}
    assert host == {
        "/host/sys": {"path": "/sys", "type": "Directory"},
        "/host/proc": {"path": "/proc", "type": "Directory"},
        "/host/dev/kmsg": {"path": "/dev/kmsg", "type": "CharDevice"},
        "/var/lib/healthagent": {"path": "/var/lib/healthagent", "type": "DirectoryOrCreate"},
    }
    writable = sorted(path for path, m in mounts.items() if not m.get("readOnly"))
    assert writable == ["/tmp", "/var/lib/healthagent"]
    assert volumes[mounts["/tmp"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert mounts["/host/sys"]["recursiveReadOnly"] == "IfPossible"
    assert container["args"] == ["--host-root", "/host"]


def test_state_file_lives_in_the_state_mount(rendered):
    env = env_of(agent_container(rendered["generic"]))
    assert env["HEALTHAGENT_STATE_FILE"] == "/var/lib/healthagent/state.json"
    assert env["HEALTHAGENT_STATE_FILE"].startswith("/var/lib/healthagent/")
    assert Settings().state_file == env["HEALTHAGENT_STATE_FILE"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_ports(rendered, overlay):
    """Probes and the scrape on the pod's own port (no hostPort); only the intake on the node's."""
    container = agent_container(rendered[overlay])
    assert container["ports"] == [
        {"name": "metrics", "containerPort": 9410, "protocol": "TCP"},
        {"name": "training", "containerPort": 9412, "hostPort": 9412, "protocol": "TCP"},
    ]
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"),
                        ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
        assert container[probe]["timeoutSeconds"] >= 1
    assert container["image"].startswith("healthagent:")


def test_listen_ports_match_the_container_ports(rendered):
    container = agent_container(rendered["generic"])
    env = env_of(container)
    ports = {p["name"]: p for p in container["ports"]}
    host, _, port = env["HEALTHAGENT_LISTEN"].rpartition(":")
    assert (host, int(port)) == ("0.0.0.0", ports["metrics"]["containerPort"])
    host, _, port = env["HEALTHAGENT_TRAINING_LISTEN"].rpartition(":")
    assert (host, int(port)) == ("0.0.0.0", ports["training"]["containerPort"])
    # The ranks' client finds the intake at the node's IP on its default port.
    assert ports["training"]["hostPort"] == TRAINING_PORT == CLIENT_DEFAULT_PORT


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_intake_is_closed_unless_a_job_token_opens_it(rendered, overlay):
    env = env_of(agent_container(rendered[overlay]))
    assert env["HEALTHAGENT_TRAINING_INTAKE"] == "token"
    assert env["HEALTHAGENT_TRAINING_TOKEN"] == {"secretKeyRef": {"name": "healthagent-training", "key": "token",
                                                                  "optional": True}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_are_bounded(rendered, overlay):
    assert agent_container(rendered[overlay])["resources"] == {
        "requests": {"cpu": "50m", "memory": "128Mi"},
        "limits": {"cpu": "1", "memory": "256Mi"},
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rolling_update_a_tenth_at_a_time(rendered, overlay):
    strategy = find(rendered[overlay], "DaemonSet")["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}


EXPECTED_ENV = {
    "generic": {"HEALTHAGENT_KUBE": "in-cluster"},
    "hyperpod": {"HEALTHAGENT_KUBE": "in-cluster", "HEALTHAGENT_HYPERPOD_LABELS": "true"},
    "dry-run": {"HEALTHAGENT_KUBE": "dry-run"},
    "eks-node-repair": {"HEALTHAGENT_KUBE": "in-cluster", "HEALTHAGENT_CONDITION_VOCABULARY": "eks"},
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_per_overlay(rendered, overlay):
    env = env_of(agent_container(rendered[overlay]))
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env.items() >= EXPECTED_ENV[overlay].items()
    if overlay != "hyperpod":
        assert "HEALTHAGENT_HYPERPOD_LABELS" not in env
        assert "HEALTHAGENT_BUDGET_NODE_SELECTOR" not in env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_is_a_valid_agent_configuration(rendered, overlay, tmp_path):
    """The agent's own settings loader accepts every HEALTHAGENT_* value the manifests set."""
    env = {k: v for k, v in env_of(agent_container(rendered[overlay])).items() if isinstance(v, str)}
    env["NODE_NAME"] = "gpu-node-1"
    settings = load_settings(flags={"host_root": str(tmp_path)}, env=env)
    assert settings.kube == EXPECTED_ENV[overlay]["HEALTHAGENT_KUBE"]
    assert settings.node_name == "gpu-node-1"
    assert settings.hyperpod_labels is (overlay == "hyperpod")
    assert settings.condition_vocabulary == ("eks" if overlay == "eks-node-repair" else "healthagent")
    unknown = [k for k in env if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower()
               not in Settings.__dataclass_fields__]
    assert unknown == []


def instance_types_in_selector(selector: str) -> set[str]:
    _, _, values = selector.partition(" in ")
    return {v.strip() for v in values.strip().strip("()").split(",")}


def test_hyperpod_budget_counts_the_nodes_the_daemonset_runs_on(rendered):
    """The taint budget's share is computed over the same GPU instance types the agent runs on."""
    spec = pod_spec(rendered["hyperpod"])
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    hyperpod_term = {e["key"]: e for e in terms[1]["matchExpressions"]}
    assert hyperpod_term["sagemaker.amazonaws.com/compute-type"]["values"] == ["hyperpod"]
    affinity_types = set(hyperpod_term["node.kubernetes.io/instance-type"]["values"])
    selector = env_of(agent_container(rendered["hyperpod"]))["HEALTHAGENT_BUDGET_NODE_SELECTOR"]
    assert selector.startswith("sagemaker.amazonaws.com/compute-type=hyperpod,node.kubernetes.io/instance-type in (")
    assert instance_types_in_selector(selector) == affinity_types
    assert "ml.p5.48xlarge" in affinity_types


def test_overlays_differ_only_where_documented(rendered):
    """generic is the base and the budget counter; dry-run changes the kube mode and RBAC and has no
    counter; hyperpod adds its label switch, budget selector (the counter's too) and node affinity term; eks-node-repair switches the condition vocabulary and
    the node policy's condition types. Nothing else differs."""
    def comparable(objects, drop_env=(), drop_rbac=False, drop_affinity=False, drop_node_policy=False):
        out = []
        for obj in objects:
            obj = copy.deepcopy(obj)
            if drop_node_policy and obj["kind"] == "ValidatingAdmissionPolicy" \
                    and obj["metadata"]["name"] == "healthagent-own-node-only":
                continue
            if drop_rbac and obj["metadata"]["name"] == "healthagent-budget-counter":
                continue  # no budget in a dry run: no counter
            if obj["kind"] in ("DaemonSet", "Deployment"):
                spec = obj["spec"]["template"]["spec"]
                container = spec["containers"][0]
                container["env"] = sorted((e for e in container["env"] if e["name"] not in drop_env),
                                          key=lambda e: e["name"])
                if drop_affinity and obj["kind"] == "DaemonSet":
                    spec.pop("affinity")
            if drop_rbac and obj["kind"] == "ClusterRole":
                obj.pop("rules")
            if drop_rbac and obj["kind"] in ("Role", "RoleBinding"):
                continue
            out.append(obj)
        return sorted(out, key=lambda o: (o["kind"], o["metadata"]["name"]))

    generic = rendered["generic"]
    assert comparable(rendered["dry-run"], drop_env={"HEALTHAGENT_KUBE"}, drop_rbac=True) == comparable(
        generic, drop_env={"HEALTHAGENT_KUBE"}, drop_rbac=True)
    hyperpod_env = {"HEALTHAGENT_HYPERPOD_LABELS", "HEALTHAGENT_BUDGET_NODE_SELECTOR"}
    assert comparable(rendered["hyperpod"], drop_env=hyperpod_env, drop_affinity=True) == comparable(
        generic, drop_env=hyperpod_env, drop_affinity=True)
    eks = rendered["eks-node-repair"]
    assert comparable(eks, drop_env={"HEALTHAGENT_CONDITION_VOCABULARY"}, drop_node_policy=True) == comparable(
        generic, drop_node_policy=True)
    assert env_of(agent_container(eks))["HEALTHAGENT_CONDITION_VOCABULARY"] == "eks"
    policy = repr(find(eks, "ValidatingAdmissionPolicy", "healthagent-own-node-only")["spec"])
    assert "AcceleratedHardwareReady" in policy and "NetworkingReady" in policy and "GpuHealthy" not in policy
