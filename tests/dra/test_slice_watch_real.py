"""The node's ResourceSlices reach the agent through one watch on a real kube-apiserver v1.36.

Proven here: while a GPU-scope finding is open the agent holds one watch of the node's slices
(field-selected by ``spec.nodeName``) and a slice the driver changes reaches it without another
LIST (the change wakes the effects, whose next pass quarantines the GPU now published); the watch
resumes after the server ends its stream; a healthy node holds no watch.
"""

from __future__ import annotations

import threading

import pytest

from healthagent.dra.effects import DraApi, DraEffects
from healthagent.dra.rules import GROUP
from healthagent.dra.slice_watch import SliceWatch
from healthagent.dra.split import NOT_PUBLISHED
from healthagent.effects.kube import NodeEffects
from healthagent.effects.state import StateStore
from healthagent.model import Verdict
from healthagent.policy.scope import ScopePolicy
from tests.dra.slices import gpu_finding, node_body, resource_slice
from tests.dra.test_dra_real import GRACE, _rules
from tests.effects.helpers import T0, settings_for

pytestmark = pytest.mark.integration
WAIT = 30.0


class _CountingApi(DraApi):
    """The real DraApi, counting LISTs and watches of the node's slices."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lists = 0
        self.watches = 0
        self.watching = threading.Event()

    def list_slices(self):
        self.lists += 1
        return super().list_slices()

    def watch_slices(self, resource_version, timeout_seconds):
        self.watches += 1
        stream = super().watch_slices(resource_version, timeout_seconds)
        self.watching.set()
        return stream


def _agent(plane, tmp_path, node: str, gpus: int) -> tuple[DraEffects, _CountingApi, threading.Event]:
    from kubernetes import client

    settings = settings_for(tmp_path, node, kube="kubeconfig", replace_noexecute_grace_seconds=GRACE)
    store = StateStore(settings.state_file)
    store.load()
    api_client = plane.api_client()
    inner = NodeEffects(settings, api_client, store, watch=False, request_timeout=(2.0, 5.0))
    api = _CountingApi(api_client, node)
    effects = DraEffects(inner, api, ScopePolicy(), settings.taint_key, GRACE)
    woken = threading.Event()
    effects.on_change = woken.set
    client.CoreV1Api(api_client).create_node(node_body(node))
    client.CustomObjectsApi(api_client).create_cluster_custom_object(
        GROUP, "v1", "resourceslices", resource_slice(node, gpus))
    effects.startup(T0 - 1, "boot-1")
    return effects, api, woken


def _publish(plane, node: str, gpus: int, generation: int) -> None:
    from kubernetes import client

    custom = client.CustomObjectsApi(plane.api_client())
    name = resource_slice(node, gpus)["metadata"]["name"]
    current = custom.get_cluster_custom_object(GROUP, "v1", "resourceslices", name)
    current["spec"] = resource_slice(node, gpus, generation)["spec"]
    custom.replace_cluster_custom_object(GROUP, "v1", "resourceslices", name, current)


def test_a_slice_change_reaches_the_agent_without_a_poll(dra_plane, tmp_path):
    node = "watch-change"
    effects, api, woken = _agent(dra_plane, tmp_path, node, gpus=3)  # GPU 3 not published yet
    bad = Verdict.of([gpu_finding(3)], T0)
    effects.reconcile(bad, T0, "boot-1")
    assert effects.status()["fallbacks"] == [NOT_PUBLISHED] and _rules(dra_plane, node) == []
    assert api.lists == 1 and api.watching.wait(WAIT)
    woken.clear()
    _publish(dra_plane, node, gpus=8, generation=2)
    assert woken.wait(WAIT)  # the watch delivered the change and woke the effects
    effects.reconcile(bad, T0 + 1, "boot-1")
    assert [r["spec"]["deviceSelector"]["device"] for r in _rules(dra_plane, node)] == ["gpu-3"]
    assert api.lists == 1  # no LIST since the first: the watch carried the change
    effects.reconcile(Verdict.of([], T0 + 2), T0 + 2, "boot-1")  # the finding cleared
    assert _rules(dra_plane, node) == [] and effects._watch is None  # the watch is closed with it
    effects.close()


def test_the_watch_resumes_after_the_server_ends_its_stream(dra_plane, tmp_path):
    node = "watch-resume"
    effects, api, woken = _agent(dra_plane, tmp_path, node, gpus=3)
    effects.reconcile(Verdict.of([gpu_finding(3)], T0), T0, "boot-1")
    watch = effects._watch
    assert isinstance(watch, SliceWatch)
    watch.stop()  # the same watch again, but ended by the server after one second each time
    resumed = threading.Event()
    real = api.watch_slices

    def watch_slices(version, _timeout):
        if api.watches >= 2:
            resumed.set()
        return real(version, 1)

    api.watch_slices = watch_slices
    effects._watch = SliceWatch(api, node, on_change=woken.set, tally=effects._tally)
    items, version = DraApi.list_slices(api)
    effects._watch.start(items, version)
    assert resumed.wait(WAIT)  # a second watch request after the first stream ended
    woken.clear()
    _publish(dra_plane, node, gpus=8, generation=2)
    assert woken.wait(WAIT)
    effects.reconcile(Verdict.of([gpu_finding(3)], T0 + 1), T0 + 1, "boot-1")
    assert len(_rules(dra_plane, node)) == 1
    effects.close()


def test_a_healthy_node_holds_no_watch(dra_plane, tmp_path):
    node = "watch-none"
    effects, api, _ = _agent(dra_plane, tmp_path, node, gpus=8)
    for step in range(20):
        effects.reconcile(Verdict.of([], T0 + step), T0 + step, "boot-1")
    assert effects._watch is None and api.lists == 0 and api.watches == 0
    effects.close()
