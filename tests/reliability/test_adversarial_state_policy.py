"""The agent's own inputs turned hostile: an operator's clear racing a new fault, a policy file that
says one thing twice, a wall clock that jumps (a state file that is garbage, huge or on a dying
disk: ``test_adversarial_state_files.py``).

Real parts wherever they can show the fault: the agent (``AgentRuntime``) on the demo node, the
fake API server (and a real kube-apiserver where the binaries are present), real files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from healthagent.effects.node_desired import CLEAR_ANNOTATION
from tests.reliability.helpers import (NODE, REPLACE, alive, events_by_reason, gpu_xid_events, our_taints, scrape,
                                       wait_metric, wait_warm)
from tests.support.live_agent import REPO_ROOT, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.integration]


# -- an operator's clear racing a new fault ---------------------------------------------------------

def test_an_xid_after_an_operator_clear_is_a_new_fault_while_another_writer_patches_the_node(
        fake, demo, start_agent):
    """XID 94, the replace_node taint; an operator clears the node while another controller
    patches it. The effects take the taint off, but the rest of their step (the conditions
    write, here held by the server) keeps the loop from hearing of the clear; meanwhile XID 94
    comes again and joins the open incident. When the loop applies the clear, it closes what the
    operator saw and keeps what came after: a new finding, a new Event, the taint again."""
    runtime = start_agent()
    wait_warm(runtime)
    demo.inject_xid(3, 94)
    wait_until(lambda: our_taints(fake) == REPLACE, what="the replace_node taint")
    wait_until(lambda: len(gpu_xid_events(fake)) == 1, what="the GPU_XID Event")
    from tests.support.clusters import FakeCluster, LabelChurn

    with LabelChurn(FakeCluster(fake), NODE, rate=100.0) as other:  # strategic-merge PATCHes, over HTTP
        status_write = fake.hold(lambda method, path, body: method == "PATCH" and path.endswith("/status"))
        fake.update_node(NODE, lambda node: node["metadata"].setdefault("annotations", {}).update(
            {CLEAR_ANNOTATION: "ticket-4711"}))
        wait_until(lambda: our_taints(fake) == [], what="the taint removed by the clear")
        assert status_write.arrived.wait(60)  # the effects' step is not over: the loop has not heard
        demo.inject_xid(3, 94)
        wait_metric(runtime, lambda s: s.total("healthagent_xid_errors_total") == 2, "the new XID 94 counted")
        status_write.release(apply=True)
        wait_until(lambda: our_taints(fake) == REPLACE, what="the taint back for the new XID 94")
        wait_until(lambda: len(gpu_xid_events(fake)) == 2, what="a GPU_XID Event for the new fault")
        assert other.writes > 0
    first, second = sorted(gpu_xid_events(fake), key=lambda e: e["eventTime"])
    assert first["metadata"]["name"] != second["metadata"]["name"]
    after = scrape(runtime)
    assert after.value("healthagent_findings", code="GPU_XID", action="replace_node") == 1
    assert events_by_reason(fake).get("Cleared") == 1
    assert alive(runtime)


def test_a_clear_that_arrives_during_a_slow_step_waits_for_policy(tmp_path, fake):
    """The API server answers slowly (an Event create held); the operator's clear arrives through
    the watch in the middle of that step, and the loop finds a new fault meanwhile (another GPU).
    The effects carry out nothing on their own: they hold the node as it is until policy's verdict
    accounts for the clear (policy closed what was open when the loop saw it); the fault found
    after the clear keeps the node tainted, and the clear is reported once, also after a restart."""
    from healthagent.model import Action, Finding, Verdict
    from tests.effects.helpers import T0, Wakes, settings_for, start_effects

    def finding(pci: str, t: float, finding_id: int) -> Finding:
        return Finding(code="GPU_XID", action=Action.REPLACE_NODE, summary=f"XID 94 on {pci}", evidence="XID 94 x1",
                       next_steps="replace the node", pci_bus_id=pci, xids=(94,), first_seen=t, last_seen=t,
                       id=finding_id)

    one, two, late = finding("0000:53:00.0", T0, 1), finding("0000:64:00.0", T0 + 1, 2), finding("0000:75:00.0", T0 + 2, 3)
    wakes = Wakes()
    effects = start_effects(settings_for(tmp_path, NODE), fake, watch=True, on_change=wakes,
                            watch_backoff=(0.05, 0.5))
    try:
        effects.startup(T0 - 1, "boot-1")
        effects.reconcile(Verdict.of([one], T0, observation=1), T0, "boot-1")
        assert our_taints(fake) == REPLACE
        slow_event = fake.hold(lambda method, path, body: method == "POST" and path.endswith("/events"))
        step = threading.Thread(target=effects.reconcile,
                                args=(Verdict.of([one, two], T0 + 1, observation=2), T0 + 1, "boot-1"))
        step.start()
        assert slow_event.arrived.wait(30)
        woken = wakes.count
        fake.update_node(NODE, lambda node: node["metadata"].setdefault("annotations", {}).update(
            {CLEAR_ANNOTATION: "ticket-7"}))
        wait_until(lambda: wakes.count > woken, what="the watch seeing the clear")
        slow_event.release(apply=True)
        step.join(30)
        assert effects.pending_clear() == "ticket-7"  # what the loop reads from the node for policy
        held = effects.reconcile(Verdict.of([one, two, late], T0 + 3, observation=3), T0 + 3, "boot-1")
        assert held.clear_pending == "ticket-7" and our_taints(fake) == REPLACE  # held as it is
        assert not any(e["reason"] == "Cleared" for e in fake.events())
        decided = Verdict.of([late], T0 + 4, observation=4, clear_token="ticket-7")  # policy closed one, two
        status = effects.reconcile(decided, T0 + 4, "boot-1")
        assert status.clear_pending == "" and our_taints(fake) == REPLACE  # kept for the fault after it
        assert sum(e["reason"] == "Cleared" for e in fake.events()) == 1
        assert len([e for e in gpu_xid_events(fake) if "0000:75:00.0" in e["note"]]) == 1
        restarted = start_effects(settings_for(tmp_path, NODE), fake)
        restarted.startup(T0 + 5, "boot-1")
        restarted.reconcile(decided, T0 + 5, "boot-1")
        assert sum(e["reason"] == "Cleared" for e in fake.events()) == 1  # handled: never again
    finally:
        effects.close()


def test_a_watch_line_nested_past_the_parser_is_a_bad_event_and_the_node_is_listed_again(tmp_path, fake):
    """A proxy or a broken server sends 60,000 ``[`` on the watch: counted as a bad event (not an
    internal error: nothing in the agent is broken), the node listed again, the watch goes on."""
    from tests.effects.helpers import T0, settings_for, start_effects

    effects = start_effects(settings_for(tmp_path, NODE), fake, watch=True, watch_backoff=(0.05, 0.5))
    try:
        effects.startup(T0 - 1, "boot-1")
        wait_until(lambda: fake.open_watches() >= 1, what="the watch")
        fake.send_raw_watch_line("[" * 60_000)
        wait_until(lambda: effects.errors.get("watch_bad_event") == 1 and effects.watching, what="the re-list")
        assert effects.errors == {"watch_bad_event": 1}
        fake.update_node(NODE, lambda node: node["metadata"].setdefault("labels", {}).update({"after": "it"}))
        wait_until(lambda: effects.node["metadata"]["labels"].get("after") == "it", what="the next change")
    finally:
        effects.close()


def test_an_xid_right_after_a_clear_on_a_real_api_server_under_label_churn(
        tmp_path, demo, control_plane, unique_name):
    """The same race on a real kube-apiserver + etcd, with another controller patching the node's
    labels a hundred times a second (its writes and the agent's meet in etcd's optimistic
    concurrency). Whichever way the race goes, the XID after the clear is acted on."""
    from healthagent.config import load_settings
    from healthagent.wiring import AgentRuntime
    from tests.support.clusters import LabelChurn, RealCluster

    cluster = RealCluster(control_plane, unique_name("clear-race") + "-")
    cluster.seed(10)  # 10% of 10 GPU nodes: the budget allows this one
    name = cluster.name(0)
    settings = load_settings(env={}, flags=dict(
        host_root=str(demo.root), kube="kubeconfig", node_name=name, nvml="false",
        kubeconfig=str(control_plane.write_kubeconfig(tmp_path / "kubeconfig")),
        budget_node_selector=cluster.budget_selector, state_file=str(tmp_path / "state" / "state.json"),
        listen="127.0.0.1:0", expected_efa_devices=32))
    runtime = AgentRuntime(settings)
    runtime.start()

    def taints() -> list[tuple[str, str]]:
        return [(t["value"], t["effect"]) for t in cluster.node(name)["spec"].get("taints") or []
                if t["key"] == settings.taint_key]

    def xid_events() -> int:
        return sum(e["reason"] == "GPU_XID" for e in cluster.events() if e["regarding"]["name"] == name)

    try:
        wait_warm(runtime)
        demo.inject_xid(3, 94)
        wait_until(lambda: taints() == REPLACE, what="the replace_node taint")
        with LabelChurn(cluster, name, rate=100.0) as churn:
            cluster.update_node(name, lambda node: node["metadata"].setdefault("annotations", {}).update(
                {CLEAR_ANNOTATION: "ticket-9"}))
            wait_until(lambda: taints() == [], what="the taint removed by the clear", interval=0.005)
            demo.inject_xid(3, 94)  # at once: the effects may still be finishing the clear
            wait_until(lambda: taints() == REPLACE, what="the taint back for the new XID 94")
            wait_until(lambda: xid_events() == 2, what="a GPU_XID Event for the new fault")
        assert churn.writes > 0 and not churn.errors
        assert alive(runtime)
    finally:
        runtime.stop()
        cluster.close()


# -- a policy or settings file that says one thing twice, or the impossible --------------------------

def run_agent(tmp_path, demo, *args: str) -> subprocess.CompletedProcess:
    """``healthagent run`` (the DaemonSet's command) with a file it must refuse at start."""
    argv = [sys.executable, "-m", "healthagent", "run", "--no-nvml", "--kube", "off",
            "--host-root", str(demo.root), "--state-file", str(tmp_path / "s" / "state.json"),
            "--listen", "127.0.0.1:0", *args]
    try:
        return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail("the agent started and ran with the file instead of refusing it")


@pytest.mark.parametrize("text,named", [
    ("xid:\n  94: replace_node\n  94: none\n", "names key 94 twice (lines 2 and 3); keep one"),
    ("xid:\n  94: replace_node\n  '94': none\n", "xid.94: 94 and '94' both name XID 94; keep one"),
    ("xid: {100000000000000000000000: none}\n", "XID numbers are 1 to 999999999"),
    ("thresholds: {efa_rx_drops_per_minute: 1e308}\n", "thresholds.efa_rx_drops_per_minute: 1e+308 is out of range"),
])
def test_a_policy_that_says_one_thing_twice_or_the_impossible_stops_the_start(tmp_path, demo, text, named):
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    done = run_agent(tmp_path, demo, "--policy-file", str(policy))
    assert done.returncode == 3, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("healthagent: policy error:") and named in line


def test_a_settings_file_that_names_a_setting_twice_stops_the_start(tmp_path, demo):
    config = tmp_path / "config.yaml"
    config.write_text("state-file: /var/lib/a.json\nstate_file: /var/lib/b.json\n")
    done = run_agent(tmp_path, demo, "--config", str(config))
    assert done.returncode == 3, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "'state-file' and 'state_file'" in line and "keep one" in line


# -- a wall clock that jumps -------------------------------------------------------------------------

class SteppedClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_wall_clock_set_back_by_hours_does_not_put_the_periodic_sources_to_sleep(tmp_path):
    """NTP or an operator steps the clock back three hours; a minute later an EFA device is gone.
    The EFA source must still run every interval and find it."""
    from tests.test_agent import demo_settings
    from healthagent.wiring import AgentRuntime

    node, settings = demo_settings(tmp_path, expected_efa_devices="32")
    running = AgentRuntime(settings)
    clock = SteppedClock(1_800_000_000.0)
    running.agent.clock = clock
    try:
        for _ in range(3):
            running.agent.cycle()
            clock.now += 5.0
        clock.now -= 3 * 3600.0
        node.remove_efa_device(node.efa_devices[7])
        found = False
        for _ in range(30):  # 30 s of cycles on the stepped-back clock
            clock.now += 1.0
            verdict = running.agent.cycle()
            found = found or any(f.code == "EFA_DEVICE_MISSING" for f in verdict.findings)
        assert found
    finally:
        running.agent.shutdown(grace_seconds=5)
        running.server.stop()


def test_a_wall_clock_set_back_does_not_stop_the_effects_reading_the_node_while_the_watch_is_down(
        tmp_path, fake):
    """Without a watch the effects re-read the node every minute to notice operators; a clock set
    back three hours must not make that three hours and a minute."""
    from tests.effects.helpers import T0, XID95, settings_for, start_effects

    effects = start_effects(settings_for(tmp_path, NODE), fake)  # no watch: reads on a timer
    effects.startup(T0 - 1, "boot-1")
    effects.reconcile(XID95, T0, "boot-1")
    effects.reconcile(XID95, T0 + 30, "boot-1")
    fake.reset_log()
    effects.reconcile(XID95, T0 + 30 - 3 * 3600, "boot-1")
    assert [(r.method, r.path) for r in fake.requests("GET", f"/api/v1/nodes/{NODE}")] == [
        ("GET", f"/api/v1/nodes/{NODE}")]
