"""NodeEffects with its watch: the real ``kubernetes`` client against the fake API server.

Steady state costs zero writes, zero reads and one watch; what operators and other controllers do
to the node arrives through the watch (and wakes the effects worker when it matters); the watch
survives drops, 410 Gone, server-side timeouts, garbage and an API server that goes away, and
falls back to reading the node while it cannot watch. Time for the effects is the ``now``
argument; the watch runs in real time, so tests wait on conditions with generous deadlines.
"""

import threading

import pytest

from healthagent.effects.node_desired import CLEAR_ANNOTATION, CLEAR_HANDLED_ANNOTATION, HEALTH_LABEL
from tests.effects.helpers import (
    HEALTHY,
    T0,
    XID95,
    Wakes,
    cleared_by,
    condition,
    our_taints,
    settings_for,
    start_effects,
    wait_for,
)

pytestmark = pytest.mark.integration

NODE = "gpu-node-0"
NODE_PATH = f"/api/v1/nodes/{NODE}"


@pytest.fixture
def cluster(fake):
    fake.seed_nodes(20)
    return fake


@pytest.fixture
def watched(tmp_path, cluster):
    """Start NodeEffects with the watch, as the agent does; every one is closed at the end."""
    made = []

    def start(node=NODE, **overrides):
        kwargs = {k: overrides.pop(k) for k in ("watch_timeout_seconds", "resync_seconds") if k in overrides}
        wakes = Wakes()
        effects = start_effects(settings_for(tmp_path / node, node, **overrides), cluster, watch=True,
                                on_change=wakes, watch_backoff=(0.05, 0.5), **kwargs)
        made.append(effects)
        effects.startup(T0 - 1, "boot-1")
        assert effects.watching  # the start-up LIST primed the cache and started the watch
        wait_for(lambda: len(cluster.watches()) >= 1, what="the watch request")
        return effects, wakes

    yield start
    for effects in made:
        effects.close()


def version(node):
    return node["metadata"]["resourceVersion"]


def node_reads(fake):
    """GETs of the node object itself (the read-on-a-timer the watch replaces)."""
    return fake.requests("GET", NODE_PATH)


def lists_by_name(fake):
    return [r for r in fake.requests("GET", "/api/v1/nodes") if r.path == "/api/v1/nodes"
            and r.query.get("fieldSelector") == f"metadata.name={NODE}" and "watch" not in r.query]


def caught_up(effects, fake):
    """The cache holds the node's current version."""
    return effects.node is not None and version(effects.node) == version(fake.node(NODE))


def annotate_clear(fake, token):
    fake.update_node(NODE, lambda n: n["metadata"]["annotations"].update({CLEAR_ANNOTATION: token}))


def label(fake, key, value, node=NODE):
    fake.update_node(node, lambda n: n["metadata"]["labels"].update({key: value}))


def test_steady_state_is_zero_writes_zero_reads_and_one_watch(watched, cluster):
    effects, _ = watched(replace_noexecute_grace_seconds=0.0)
    effects.reconcile(XID95, T0, "boot-1")
    assert [t["effect"] for t in our_taints(cluster.node(NODE))] == ["NoExecute"]
    before = len(cluster.requests())
    for i in range(500):  # ~42 minutes of the loop's 5 s reconciles: far past the old 60 s re-read
        status = effects.reconcile(XID95, T0 + 1 + 5 * i, "boot-1")
        assert status.pending_writes == 0 and status.taint_effect == "NoExecute"
    assert cluster.requests()[before:] == []  # no write, no read, no new watch
    assert len(cluster.watches()) == 1 and len(lists_by_name(cluster)) == 1
    assert node_reads(cluster) == []  # the node was never read on its own: the LIST served start-up
    assert effects.watching and len(cluster.events()) == 1


def test_an_operator_clear_arrives_through_the_watch_and_wakes_the_worker(watched, cluster):
    effects, wakes = watched(resync_seconds=10**9)  # no re-read on a timer could explain it
    effects.reconcile(XID95, T0, "boot-1")
    assert our_taints(cluster.node(NODE))
    wakes.event.clear()
    annotate_clear(cluster, "ticket-42")
    assert wakes.wait(), "the watch did not wake the effects worker (and the loop)"
    assert effects.pending_clear() == "ticket-42"  # what the woken loop reads into the Collection
    status = effects.reconcile(cleared_by("ticket-42"), T0 + 1, "boot-1")  # with policy's verdict
    node = cluster.node(NODE)
    assert our_taints(node) == [] and node["metadata"]["labels"][HEALTH_LABEL] == "healthy"
    assert node["metadata"]["annotations"][CLEAR_HANDLED_ANNOTATION] == "ticket-42"
    assert condition(node, "GpuHealthy")["status"] == "True"
    assert status.clear_pending == "" and status.pending_writes == 0
    assert node_reads(cluster) == []  # planned and written against the watched node
    assert sorted(e["reason"] for e in cluster.events()) == ["Cleared", "GPU_XID"]


def test_a_taint_removed_by_hand_is_noticed_through_the_watch(watched, cluster):
    effects, wakes = watched(resync_seconds=10**9)
    effects.reconcile(XID95, T0, "boot-1")
    wakes.event.clear()
    cluster.update_node(NODE, lambda n: n["spec"].update(taints=[]))  # kubectl taint node ... -
    assert wakes.wait()
    token = f"taint-removed-{int(T0 + 1)}"
    status = effects.reconcile(XID95, T0 + 1, "boot-1")
    assert status.clear_pending == token and effects.pending_clear() == token
    assert our_taints(cluster.node(NODE)) == []  # not put back for the findings that were open
    effects.reconcile(cleared_by(token), T0 + 2, "boot-1")
    assert cluster.node(NODE)["metadata"]["labels"][HEALTH_LABEL] == "healthy"
    assert node_reads(cluster) == []


def test_foreign_changes_update_the_cache_without_a_write_or_a_wake(watched, cluster):
    effects, wakes = watched()
    effects.reconcile(HEALTHY, T0, "boot-1")
    woken = wakes.count
    before = len(cluster.requests())

    def kubelet_heartbeat(n):
        n["status"]["conditions"][0]["lastHeartbeatTime"] = "2030-01-01T00:00:00Z"

    label(cluster, "team", "llm")  # another controller's label
    cluster.update_node(NODE, kubelet_heartbeat)
    wait_for(lambda: caught_up(effects, cluster), what="the cache to take the foreign changes")
    assert effects.node["metadata"]["labels"]["team"] == "llm"
    assert effects.reconcile(HEALTHY, T0 + 5, "boot-1").pending_writes == 0
    assert cluster.requests()[before:] == [] and wakes.count == woken
    # the next write's preconditions pin the node as the watch delivered it: no conflict,
    # nothing re-read
    status = effects.reconcile(XID95, T0 + 10, "boot-1")
    patch = [r for r in cluster.writes(NODE_PATH) if r.path == NODE_PATH][-1]
    tests = {op["path"]: op["value"] for op in patch.body if op["op"] == "test"}
    assert tests == {"/metadata/uid": cluster.node(NODE)["metadata"]["uid"], "/spec/taints": None}
    assert not any(result == "conflict" for _, result in status.writes)
    assert node_reads(cluster) == [] and cluster.node(NODE)["metadata"]["labels"]["team"] == "llm"


def test_a_dropped_watch_resumes_from_the_last_resource_version(watched, cluster):
    effects, _ = watched()
    label(cluster, "step", "1")
    wait_for(lambda: caught_up(effects, cluster), what="the change")
    last = version(effects.node)
    cluster.drop_watches()
    wait_for(lambda: len(cluster.watches()) == 2, what="the watch to be resumed")
    assert cluster.watches()[1].query["resourceVersion"] == last
    assert len(lists_by_name(cluster)) == 1  # resumed, not listed again
    label(cluster, "step", "2")  # the resumed watch carries changes
    wait_for(lambda: effects.node["metadata"]["labels"].get("step") == "2", what="the change after the resume")
    assert effects.api_errors.get("watch_unavailable") == 1 and node_reads(cluster) == []


@pytest.mark.parametrize("gone_as", ["error-event", "http-status"])
def test_410_gone_lists_again_and_watches_from_the_new_list(watched, cluster, gone_as):
    effects, wakes = watched(resync_seconds=10**9)
    effects.reconcile(XID95, T0, "boot-1")
    cluster.go_down()
    wait_for(lambda: not effects.watching, what="the watch to notice the API server is gone")
    annotate_clear(cluster, "while-down")  # only a LIST can bring it once the history is gone
    cluster.compact()
    if gone_as == "http-status":
        cluster.fail_next(1, status=410)
    cluster.reset_log()
    wakes.event.clear()
    cluster.come_up()
    wait_for(lambda: len(cluster.watches()) == 2 and effects.watching, what="the watch after the 410")
    resumed, listed, rewatched = cluster.requests()[:3]
    assert resumed.query["watch"] == "true" and int(resumed.query["resourceVersion"]) < cluster.resource_version
    assert resumed.status == (410 if gone_as == "http-status" else 200)  # else an ERROR event in the stream
    assert listed in lists_by_name(cluster)
    assert rewatched.query["resourceVersion"] == str(cluster.resource_version)
    assert effects.api_errors.get("watch_expired") == 1
    assert wakes.wait()
    assert effects.pending_clear() == "while-down"
    effects.reconcile(cleared_by("while-down"), T0 + 1, "boot-1")
    assert our_taints(cluster.node(NODE)) == []


def test_the_server_ending_the_watch_is_normal_and_it_watches_again_from_the_last_version(watched, cluster):
    effects, wakes = watched(watch_timeout_seconds=(1, 1))
    label(cluster, "step", "1")
    wait_for(lambda: caught_up(effects, cluster), what="the change")
    last = version(effects.node)
    woken = wakes.count
    wait_for(lambda: len(cluster.watches()) >= 2, what="the watch after timeoutSeconds")
    assert cluster.watches()[0].query["timeoutSeconds"] == "1"
    assert cluster.watches()[1].query["resourceVersion"] == last
    assert len(lists_by_name(cluster)) == 1 and effects.errors == {}
    assert effects.watching and wakes.count == woken  # never went down


def test_bookmarks_let_a_quiet_node_resume_after_the_history_is_gone(watched, cluster):
    effects, _ = watched()
    for i in range(5):
        label(cluster, "churn", str(i), node="gpu-node-7")  # the cluster moves on, this node does not
    cluster.send_bookmarks()
    wait_for(lambda: effects.node_watch.resume_version == str(cluster.resource_version), what="the bookmark")
    cluster.compact()
    cluster.drop_watches()
    wait_for(lambda: len(cluster.watches()) == 2, what="the resumed watch")
    assert cluster.watches()[0].query["allowWatchBookmarks"] == "true"
    assert cluster.watches()[1].query["resourceVersion"] == str(cluster.resource_version)
    assert len(lists_by_name(cluster)) == 1 and "watch_expired" not in effects.api_errors


def test_api_down_then_up_the_watch_resumes_and_the_queued_writes_apply(watched, cluster):
    effects, wakes = watched()
    effects.reconcile(HEALTHY, T0, "boot-1")
    last = version(cluster.node(NODE))
    cluster.go_down()
    wait_for(lambda: not effects.watching, what="the watch to go down")
    status = effects.reconcile(XID95, T0 + 5, "boot-1")  # falls back to reading: refused
    assert not status.reachable and status.pending_writes == 3  # node, status, one Event
    label(cluster, "team", "llm")  # changed while the agent could not see
    cluster.reset_log()
    wakes.event.clear()
    cluster.come_up()
    assert wakes.wait(), "the watch coming back did not wake the worker"
    wait_for(lambda: effects.node["metadata"]["labels"].get("team") == "llm", what="the replayed change")
    assert cluster.watches()[0].query["resourceVersion"] == last and lists_by_name(cluster) == []
    status = effects.reconcile(XID95, T0 + 10, "boot-1")
    assert status.reachable and status.pending_writes == 0
    node = cluster.node(NODE)
    assert our_taints(node) and node["metadata"]["labels"][HEALTH_LABEL] == "replace-required"
    assert node["metadata"]["labels"]["team"] == "llm" and len(cluster.events()) == 1


def test_started_while_the_api_server_is_down_the_watch_lists_once_it_is_back(tmp_path, cluster):
    wakes = Wakes()
    cluster.go_down()
    effects = start_effects(settings_for(tmp_path, NODE), cluster, watch=True, on_change=wakes,
                            watch_backoff=(0.05, 0.5))
    try:
        status = effects.startup(T0 - 1, "boot-1")
        assert not status.reachable and not effects.watching
        cluster.come_up()
        assert wakes.wait(), "the watch's first LIST did not wake the worker"
        wait_for(lambda: effects.watching and len(cluster.watches()) == 1, what="the watch")
        assert effects.node["metadata"]["name"] == NODE and len(lists_by_name(cluster)) == 1
        status = effects.reconcile(XID95, T0, "boot-1")
        assert status.reachable and status.pending_writes == 0 and our_taints(cluster.node(NODE))
    finally:
        effects.close()


def test_garbage_on_the_watch_is_counted_and_the_node_listed_again(watched, cluster):
    effects, _ = watched()
    cluster.send_raw_watch_line("<html>502 Bad Gateway</html>")
    wait_for(lambda: len(lists_by_name(cluster)) == 2 and len(cluster.watches()) == 2, what="the re-list")
    assert effects.errors == {"watch_bad_event": 1}
    label(cluster, "after", "garbage")
    wait_for(lambda: effects.node["metadata"]["labels"].get("after") == "garbage", what="the next change")


def test_a_watch_refused_while_the_api_server_restarts_falls_back_to_reads_and_comes_back(watched, cluster):
    """A restarted API server refuses everyone (403) until its authorization caches fill: the
    agent reads its node meanwhile and watches again after a backoff, not minutes later."""
    effects, _ = watched(resync_seconds=10**9)
    effects.reconcile(XID95, T0, "boot-1")
    cluster.go_down()
    wait_for(lambda: not effects.watching, what="the watch to go down")
    annotate_clear(cluster, "ticket-7")
    cluster.fail_next(2, status=403)
    cluster.come_up()
    wait_for(lambda: effects.errors.get("watch_rejected_403") == 2, what="the refused watches")
    wait_for(lambda: effects.watching, what="the watch after the refusals")
    refused = [r for r in cluster.watches() if r.status == 403]
    assert len(refused) == 2 and cluster.watches()[-1].status == 200
    wait_for(lambda: effects.pending_clear() == "ticket-7", what="the clear through the resumed watch")
    effects.reconcile(cleared_by("ticket-7"), T0 + 1, "boot-1")
    assert our_taints(cluster.node(NODE)) == []


def test_a_conflict_on_a_write_still_reads_the_node_again(watched, cluster):
    effects, wakes = watched()
    wakes.event.clear()
    cluster.conflict_next_writes(1)
    status = effects.reconcile(XID95, T0, "boot-1")
    assert status.writes[("node", "conflict")] == 1 and status.pending_writes >= 1
    assert wakes.event.is_set()  # the next reconcile is due at once
    status = effects.reconcile(XID95, T0 + 1, "boot-1")  # against a read, not the watch's cache
    assert status.pending_writes == 0 and len(node_reads(cluster)) == 1 and our_taints(cluster.node(NODE))


def test_a_deleted_and_recreated_node_gets_the_taint_again(watched, cluster):
    effects, wakes = watched()
    effects.reconcile(XID95, T0, "boot-1")
    wakes.event.clear()
    cluster.delete_node(NODE)
    assert wakes.wait()
    wait_for(lambda: effects.node is None, what="the cache to forget the node")
    cluster.add_node(NODE, labels={"nvidia.com/gpu.present": "true"})  # a new uid, no taint
    assert wakes.wait()
    status = effects.reconcile(XID95, T0 + 1, "boot-1")
    assert our_taints(cluster.node(NODE)) and status.clear_pending == "" and status.pending_writes == 0


def test_close_stops_the_watch(watched, cluster):
    effects, _ = watched()
    watch = effects.node_watch
    effects.close()
    assert not watch.running and not effects.watching
    wait_for(lambda: cluster.open_watches() == 0, what="the server to see the watch closed")
    assert effects.errors == {}  # stopping is no failure


def test_dry_run_has_no_watch_and_no_network(tmp_path, cluster):
    threads = set(threading.enumerate())
    effects = start_effects(settings_for(tmp_path, NODE, kube="dry-run"), None, watch=True)
    effects.startup(T0 - 1, "boot-1")
    assert effects.reconcile(XID95, T0, "boot-1").taint_effect == "NoSchedule"
    assert effects.node_watch is None and not effects.watching
    assert set(threading.enumerate()) - threads == set()
    assert cluster.requests() == []


def watch_up_gauge(status) -> float:
    """``healthagent_kube_watch_up`` as a scrape renders it from a snapshot with ``status``."""
    from prometheus_client import generate_latest

    from healthagent.model import AgentSnapshot
    from healthagent.telemetry.metrics import Telemetry

    telemetry = Telemetry("test")
    telemetry.publish(AgentSnapshot(timestamp=T0, kube=status))
    lines = [line for line in generate_latest(telemetry.registry).decode().splitlines()
             if line.startswith("healthagent_kube_watch_up ")]
    assert len(lines) == 1, lines
    return float(lines[0].split()[1])


def test_whether_the_watch_is_live_is_in_the_status_and_exported(watched, cluster, tmp_path):
    effects, _ = watched()
    status = effects.reconcile(XID95, T0, "boot-1")
    assert status.watching is True and watch_up_gauge(status) == 1
    cluster.go_down()
    wait_for(lambda: not effects.watching, what="the watch to go down")
    status = effects.reconcile(XID95, T0 + 1, "boot-1")
    assert status.watching is False and watch_up_gauge(status) == 0
    dry = start_effects(settings_for(tmp_path / "dry", NODE, kube="dry-run"), None, watch=True)
    assert dry.reconcile(XID95, T0, "boot-1").watching is False  # no watch in dry-run
