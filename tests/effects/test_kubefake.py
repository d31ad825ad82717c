"""The fake API server honours the protocol the agent relies on, checked with the real client."""

import json
import threading
import time

import pytest
import urllib3
from kubernetes import client, watch

from tests.support.kubefake import ApiError, KubeFake, parse_label_selector

pytestmark = pytest.mark.integration

SMP = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@pytest.fixture
def core(fake):
    fake.seed_nodes(3)
    return client.CoreV1Api(fake.api_client())


def raw(call, *args, **kwargs):
    """Call a typed client method and return the reply as the JSON the server sent."""
    response = call(*args, _preload_content=False, _request_timeout=(2, 5), **kwargs)
    return json.loads(response.data)


def api_error(call, *args, **kwargs) -> tuple[int, dict]:
    with pytest.raises(client.ApiException) as info:
        raw(call, *args, **kwargs)
    return info.value.status, json.loads(info.value.body)


def test_get_node_and_404_status(core):
    node = raw(core.read_node, "gpu-node-1")
    assert node["kind"] == "Node" and node["metadata"]["name"] == "gpu-node-1"
    assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    status, body = api_error(core.read_node, "nope")
    assert status == 404
    assert body["kind"] == "Status" and body["reason"] == "NotFound" and body["details"]["name"] == "nope"


def test_strategic_merge_replaces_taints_whole_and_merges_conditions_by_type(core, fake):
    fake.update_node("gpu-node-0", lambda n: n["spec"].update(
        taints=[{"key": "other.io/a", "effect": "NoSchedule"}, {"key": "other.io/b", "effect": "NoExecute"}]))
    node = raw(core.patch_node, "gpu-node-0",
               {"spec": {"taints": [{"key": "mine.io/x", "value": "v", "effect": "NoSchedule"}]}},
               _content_type=SMP)
    assert [t["key"] for t in node["spec"]["taints"]] == ["mine.io/x"]  # atomic list: replaced
    node = raw(core.patch_node_status, "gpu-node-0",
               {"status": {"conditions": [{"type": "GpuHealthy", "status": "False", "reason": "R"}]}},
               _content_type=SMP)
    assert [c["type"] for c in node["status"]["conditions"]] == ["Ready", "GpuHealthy"]
    node = raw(core.patch_node_status, "gpu-node-0",
               {"status": {"conditions": [{"type": "GpuHealthy", "status": "True", "reason": "Fine"},
                                          {"type": "Ready", "$patch": "delete"}]}}, _content_type=SMP)
    assert node["status"]["conditions"] == [{"type": "GpuHealthy", "status": "True", "reason": "Fine"}]


def test_merge_patch_and_json_patch(core):
    node = raw(core.patch_node, "gpu-node-0", {"metadata": {"labels": {"a": "1", "nvidia.com/gpu.present": None}}},
               _content_type=MERGE)
    assert node["metadata"]["labels"]["a"] == "1" and "nvidia.com/gpu.present" not in node["metadata"]["labels"]
    node = raw(core.patch_node, "gpu-node-0", [
        {"op": "test", "path": "/metadata/labels/a", "value": "1"},
        {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
        {"op": "remove", "path": "/metadata/labels/a"}], _content_type=JSON_PATCH)
    assert node["metadata"]["labels"]["b/c"] == "2" and "a" not in node["metadata"]["labels"]
    failing_test = [{"op": "test", "path": "/metadata/labels/b~1c", "value": "9"}]
    status, body = api_error(core.patch_node, "gpu-node-0", failing_test, _content_type=JSON_PATCH)
    assert status == 422 and body["reason"] == "Invalid"


def test_stale_resource_version_gets_409_conflict_status(core, fake):
    node = raw(core.read_node, "gpu-node-0")
    rv = node["metadata"]["resourceVersion"]
    fake.update_node("gpu-node-0", lambda n: n["metadata"]["labels"].update(kubelet="wrote"))
    status, body = api_error(core.patch_node, "gpu-node-0",
                             {"metadata": {"resourceVersion": rv, "labels": {"x": "y"}}}, _content_type=SMP)
    assert status == 409
    assert body["reason"] == "Conflict" and body["status"] == "Failure" and body["code"] == 409
    assert "the object has been modified" in body["message"]
    node["metadata"]["labels"]["x"] = "y"
    status, _ = api_error(core.replace_node, "gpu-node-0", node)  # PUT with the stale version
    assert status == 409
    fresh = raw(core.read_node, "gpu-node-0")
    fresh["metadata"]["labels"]["x"] = "y"
    assert raw(core.replace_node, "gpu-node-0", fresh)["metadata"]["labels"]["x"] == "y"


def test_resource_version_bumps_only_on_change_and_subresources_ignore_the_other_half(core):
    node = raw(core.read_node, "gpu-node-2")
    rv = node["metadata"]["resourceVersion"]
    same = raw(core.patch_node, "gpu-node-2", {"metadata": {"labels": {"kubernetes.io/hostname": "gpu-node-2"}}},
               _content_type=SMP)
    assert same["metadata"]["resourceVersion"] == rv  # a no-op write is not a change
    after = raw(core.patch_node_status, "gpu-node-2", {"metadata": {"labels": {"sneaky": "1"}},
                                                       "spec": {"unschedulable": True}}, _content_type=SMP)
    assert "sneaky" not in after["metadata"]["labels"] and "unschedulable" not in after["spec"]
    after = raw(core.patch_node, "gpu-node-2", {"status": {"conditions": [{"type": "X", "status": "True"}]}},
                _content_type=SMP)
    assert [c["type"] for c in after["status"]["conditions"]] == ["Ready"]


@pytest.mark.parametrize("selector,expected", [
    ("nvidia.com/gpu.present=true", ["gpu-node-0", "gpu-node-1", "gpu-node-2"]),
    ("pool=a", ["gpu-node-0"]),
    ("pool!=a", ["cpu-0", "gpu-node-1", "gpu-node-2"]),
    ("pool", ["gpu-node-0", "gpu-node-1"]),
    ("!pool", ["cpu-0", "gpu-node-2"]),
    ("pool in (a,b),nvidia.com/gpu.present==true", ["gpu-node-0", "gpu-node-1"]),
    ("pool notin (a)", ["cpu-0", "gpu-node-1", "gpu-node-2"]),
])
def test_list_with_label_selectors(core, fake, selector, expected):
    fake.update_node("gpu-node-0", lambda n: n["metadata"]["labels"].update(pool="a"))
    fake.update_node("gpu-node-1", lambda n: n["metadata"]["labels"].update(pool="b"))
    fake.add_node("cpu-0")
    reply = raw(core.list_node, label_selector=selector)
    assert [n["metadata"]["name"] for n in reply["items"]] == expected


def test_list_with_field_selectors_and_a_bad_one(core):
    reply = raw(core.list_node, field_selector="metadata.name=gpu-node-1")
    assert [n["metadata"]["name"] for n in reply["items"]] == ["gpu-node-1"]
    status, body = api_error(core.list_node, field_selector="status.phase=Running")
    assert status == 400 and body["reason"] == "BadRequest"


def test_list_resource_versions_and_a_lagging_watch_cache(core, fake):
    def tainted(**versions):
        reply = raw(core.list_node, label_selector="nvidia.com/gpu.present=true", **versions)
        return reply["metadata"]["resourceVersion"], [n["metadata"]["name"] for n in reply["items"]
                                                      if n["spec"].get("taints")]

    fake.hold_watch_cache()
    held = str(fake.resource_version)
    fake.update_node("gpu-node-1", lambda n: n["spec"].update(taints=[{"key": "k", "effect": "NoSchedule"}]))
    live = str(fake.resource_version)
    assert tainted(resource_version="0") == (held, [])  # "any": the cache, behind
    assert tainted() == (live, ["gpu-node-1"])  # unset: a quorum read
    assert tainted(resource_version=live, resource_version_match="NotOlderThan") == (live, ["gpu-node-1"])
    assert tainted(resource_version=held, resource_version_match="NotOlderThan") == (held, [])
    fake.release_watch_cache()
    assert tainted(resource_version="0") == (live, ["gpu-node-1"])
    status, body = api_error(core.list_node, resource_version=str(int(live) + 5),
                             resource_version_match="NotOlderThan")
    assert (status, body["reason"]) == (504, "Timeout") and "Too large resource version" in body["message"]
    status, body = api_error(core.list_node, resource_version_match="NotOlderThan")
    assert (status, body["reason"]) == (422, "Invalid")
    status, body = api_error(core.list_node, resource_version="abc")
    assert (status, body["reason"]) == (400, "BadRequest")


@pytest.mark.parametrize("selector", ["a==b==c", "a in b", "=x", "a,,(b"])
def test_label_selector_parser_rejects_garbage(selector):
    with pytest.raises(ApiError) as info:
        parse_label_selector(selector)
    assert info.value.code == 400


def test_validation_rejects_what_the_real_server_rejects(core):
    status, body = api_error(core.patch_node, "gpu-node-0",
                             {"spec": {"taints": [{"key": "k.io/a", "effect": "Sometimes"}]}}, _content_type=SMP)
    assert status == 422 and "effect" in body["message"]
    status, _ = api_error(core.patch_node, "gpu-node-0", {"spec": {"taints": [
        {"key": "k.io/a", "effect": "NoSchedule"}, {"key": "k.io/a", "value": "x", "effect": "NoSchedule"}]}},
        _content_type=SMP)
    assert status == 422
    status, _ = api_error(core.patch_node, "gpu-node-0", {"metadata": {"labels": {"bad": "has space"}}},
                          _content_type=SMP)
    assert status == 422
    status, _ = api_error(core.patch_node, "gpu-node-0", {"x": 1}, _content_type="application/apply-patch+yaml")
    assert status == 415


def test_watch_streams_changes_and_can_be_dropped(core, fake):
    seen = []
    since = str(fake.resource_version)

    def act():
        fake.update_node("gpu-node-1", lambda n: n["metadata"]["labels"].update(step="1"))
        fake.update_node("gpu-node-1", lambda n: n["metadata"]["labels"].pop("nvidia.com/gpu.present"))
        fake.drop_watches()

    stream = watch.Watch().stream(core.list_node, label_selector="nvidia.com/gpu.present=true",
                                  resource_version=since, _request_timeout=10)
    timer = threading.Timer(0.2, act)
    timer.start()
    with pytest.raises(urllib3.exceptions.ProtocolError):
        for event in stream:
            seen.append((event["type"], event["object"].metadata.name))
    timer.join()
    # leaving the selector is a DELETED for this watcher, as the real server does it
    assert seen == [("MODIFIED", "gpu-node-1"), ("DELETED", "gpu-node-1")]


def test_watch_from_zero_lists_then_times_out_and_too_old_is_410(core, fake):
    events = list(watch.Watch().stream(core.list_node, resource_version="0", timeout_seconds=1))
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "gpu-node-0"), ("ADDED", "gpu-node-1"), ("ADDED", "gpu-node-2")]
    fake.watch_history = 2
    for i in range(4):
        fake.update_node("gpu-node-0", lambda n, i=i: n["metadata"]["labels"].update(i=str(i)))
    with pytest.raises(client.ApiException) as info:
        list(watch.Watch().stream(core.list_node, resource_version="101", timeout_seconds=1))
    assert info.value.status == 410


def test_watch_bookmarks_raw_lines_compaction_and_a_client_that_leaves(core, fake):
    since = str(fake.resource_version)
    response = core.list_node(watch=True, allow_watch_bookmarks=True, resource_version=since, timeout_seconds=1,
                              field_selector="metadata.name=gpu-node-0", _preload_content=False,
                              _request_timeout=(2, 10))
    fake.update_node("gpu-node-1", lambda n: n["metadata"]["labels"].update(step="1"))  # not selected
    fake.send_bookmarks()
    fake.send_raw_watch_line("not an event")
    lines = list(watch.watch.iter_resp_lines(response))  # until timeoutSeconds ends it cleanly
    assert json.loads(lines[0]) == {"type": "BOOKMARK", "object": {
        "kind": "Node", "apiVersion": "v1", "metadata": {"resourceVersion": str(fake.resource_version)}}}
    assert lines[1:] == ["not an event"]
    assert fake.watches()[-1].query["allowWatchBookmarks"] == "true"

    fake.compact()  # as etcd compaction: only versions from now on can be resumed
    with pytest.raises(client.ApiException) as info:
        list(watch.Watch().stream(core.list_node, resource_version=since, timeout_seconds=1))
    assert info.value.status == 410
    assert list(watch.Watch().stream(core.list_node, resource_version=str(fake.resource_version),
                                     timeout_seconds=1)) == []

    fake.fail_next(1, status=410)  # the other form of 410: an HTTP status on the watch request
    status, body = api_error(core.list_node, watch=True, resource_version=since)
    assert (status, body["reason"]) == (410, "Expired")

    quiet = core.list_node(watch=True, resource_version=str(fake.resource_version), _preload_content=False,
                           _request_timeout=(2, 10))
    assert fake.open_watches() == 1
    quiet.close()
    deadline = time.monotonic() + 30
    while fake.open_watches() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.open_watches() == 0  # the server noticed the client left a quiet stream


def event_body(name="n.1", **overrides):
    body = {"apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": name, "namespace": "default"},
            "eventTime": "2024-05-01T10:00:00.000001Z", "reportingController": "healthagent.io/agent",
            "reportingInstance": "gpu-node-0", "action": "Detected", "reason": "GPU_XID", "type": "Warning",
            "note": "evidence", "regarding": {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-0"}}
    body.update(overrides)
    return body


def test_events_create_conflict_validate_and_patch(fake):
    events = client.EventsV1Api(fake.api_client())
    created = raw(events.create_namespaced_event, "default", event_body())
    assert created["metadata"]["uid"] and created["metadata"]["resourceVersion"]
    status, body = api_error(events.create_namespaced_event, "default", event_body())
    assert status == 409 and body["reason"] == "AlreadyExists"
    status, body = api_error(events.create_namespaced_event, "default", event_body("n.2", type="Loud"))
    assert status == 422 and "type" in body["message"]
    status, body = api_error(events.create_namespaced_event, "default", event_body("n.3", note="x" * 1025))
    assert status == 422
    patched = raw(events.patch_namespaced_event, "n.1", "default", {"note": "more"}, _content_type=MERGE)
    assert patched["note"] == "more"
    assert [e["metadata"]["name"] for e in fake.events("default")] == ["n.1"]


def test_event_time_must_be_microtime(fake):
    """The real API server parses eventTime with RFC3339Micro; a time without six fraction digits
    is a 400 (the reason the agent never sends a zero microsecond)."""
    events = client.EventsV1Api(fake.api_client())
    status, _ = api_error(events.create_namespaced_event, "default",
                          event_body("n.4", eventTime="2024-05-01T10:00:00Z"))
    assert status == 400


def test_fault_switches(core, fake):
    fake.fail_next(2)
    for _ in range(2):
        status, body = api_error(core.read_node, "gpu-node-0")
        assert status == 500 and body["reason"] == "InternalError"
    assert raw(core.read_node, "gpu-node-0")["metadata"]["name"] == "gpu-node-0"
    fake.conflict_next_writes(1)
    status, _ = api_error(core.patch_node, "gpu-node-0", {"metadata": {"labels": {"a": "b"}}}, _content_type=SMP)
    assert status == 409
    assert raw(core.patch_node, "gpu-node-0", {"metadata": {"labels": {"a": "b"}}},
               _content_type=SMP)["metadata"]["labels"]["a"] == "b"
    fake.go_down()
    with pytest.raises(urllib3.exceptions.HTTPError):
        raw(core.read_node, "gpu-node-0")
    fake.come_up()
    assert raw(core.read_node, "gpu-node-0")["metadata"]["labels"]["a"] == "b"
    fake.set_delay(0.5)
    with pytest.raises(urllib3.exceptions.HTTPError):
        core.patch_node("gpu-node-0", {"metadata": {"labels": {"c": "d"}}}, _content_type=SMP,
                        _preload_content=False, _request_timeout=(1, 0.1))
    fake.set_delay(0)


def test_requests_are_recorded(core, fake):
    fake.reset_log()
    raw(core.read_node, "gpu-node-0")
    raw(core.patch_node, "gpu-node-0", {"metadata": {"labels": {"a": "b"}}}, _content_type=SMP)
    assert [(r.method, r.path, r.status) for r in fake.requests()] == [
        ("GET", "/api/v1/nodes/gpu-node-0", 200), ("PATCH", "/api/v1/nodes/gpu-node-0", 200)]
    assert fake.writes()[0].content_type == SMP and fake.writes()[0].body == {"metadata": {"labels": {"a": "b"}}}


def test_a_stopped_fake_refuses_connections():
    fake = KubeFake().start()
    api = client.CoreV1Api(fake.api_client())
    fake.stop()
    with pytest.raises(urllib3.exceptions.HTTPError):
        raw(api.read_node, "x")
