"""The whole agent (``AgentRuntime``) on the demo node against the fake API server.

The end-to-end check: an XID 95 in the kernel log leads to the NoExecute taint, the health
label, the condition and one Event; a second agent start on the same state and node writes
nothing. NVML is off (no C compiler needed): the XID arrives through the kernel-log source.
Waiting is on conditions with generous timeouts, never on a bare sleep.
"""

from pathlib import Path

import pytest

from healthagent.config import load_settings
from healthagent.effects.node_desired import HEALTH_LABEL
from tests.effects.helpers import TAINT_KEY, condition, our_taints, wait_for

pytestmark = pytest.mark.integration

NODE = "gpu-node-0"


def kubeconfig_for(fake, path: Path) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: fake, cluster: {{server: \"{fake.url}\"}}}}]\n"
        "users: [{name: agent, user: {}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: agent}}]\n"
        "current-context: fake\n")
    return path


def test_xid95_on_the_demo_node_taints_reports_and_a_restart_writes_nothing(tmp_path, fake):
    from healthagent.wiring import AgentRuntime
    from healthagent.demo.node import build_demo_root

    fake.seed_nodes(20)
    demo = build_demo_root(tmp_path / "root")
    settings = load_settings(env={}, flags=dict(
        host_root=str(demo.root), kernel_log=str(demo.kernel_log), nvml="false", kube="kubeconfig",
        kubeconfig=str(kubeconfig_for(fake, tmp_path / "kubeconfig")), node_name=NODE,
        state_file=str(tmp_path / "state" / "state.json"), listen="127.0.0.1:0",
        replace_noexecute_grace_seconds="0"))

    runtime = AgentRuntime(settings)
    runtime.start()
    try:
        wait_for(lambda: runtime.agent.effects_worker.reconciles >= 1, what="the first reconcile")
        demo.inject_xid(3, 95, via="kmsg")
        wait_for(lambda: [t["effect"] for t in our_taints(fake.node(NODE))] == ["NoExecute"],
                 what="the NoExecute taint")
        wait_for(lambda: len(fake.events()) == 1, what="the Event")
    finally:
        runtime.stop()
    node = fake.node(NODE)
    assert our_taints(node)[0]["value"] == "replace_node" and our_taints(node)[0]["key"] == TAINT_KEY
    assert node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    assert condition(node, "GpuHealthy")["status"] == "False"
    assert fake.events()[0]["reason"] == "GPU_XID" and "95" in fake.events()[0]["note"]

    fake.reset_log()
    again = AgentRuntime(settings)
    again.start()
    try:
        wait_for(lambda: again.agent.effects_worker.reconciles >= 1, what="the restarted agent's reconcile")
    finally:
        again.stop()
    assert fake.writes() == []
    assert len(fake.events()) == 1 and our_taints(fake.node(NODE))[0]["effect"] == "NoExecute"
