"""The GPU-to-device map and the verdict split, on slices shaped as NVIDIA's DRA driver v0.4.1
publishes them and on hostile ones: anything missing, malformed or ambiguous leaves the GPU
unmapped (its findings stay with the node), never a guess."""

from __future__ import annotations

import copy

import pytest

from healthagent.dra.slices import device_map
from healthagent.dra.split import NOT_PUBLISHED, NOT_SERVED, TOO_MANY, split_verdict
from healthagent.model import Action, Verdict
from healthagent.policy.scope import ScopePolicy
from tests.dra.slices import gpu_finding, pci, resource_slice, uuid

NODE = "node-a"


def test_every_gpu_of_the_drivers_slice_maps_by_uuid_and_pci():
    devices = device_map([resource_slice(NODE, 8)], NODE)
    assert [d.device for d in devices.devices] == [f"gpu-{i}" for i in range(8)]
    ref = devices.find(uuid(3), pci(3))
    assert ref is not None and ref.path == f"gpu.nvidia.com/{NODE}/gpu-3"
    assert devices.find("", pci(3).upper().replace("0000:", "00000000:")) == ref  # NVML's 8-digit domain
    assert devices.find(uuid(3), pci(4)) is None  # the two names disagree
    assert devices.find("", "") is None


def _broken(edit) -> dict:
    data = resource_slice(NODE, 8)
    edit(data["spec"]["devices"][3])
    return data


@pytest.mark.parametrize("edit", [
    lambda d: d["attributes"].pop("uuid"),
    lambda d: d["attributes"].pop("resource.kubernetes.io/pciBusID"),
    lambda d: d["attributes"].update({"resource.kubernetes.io/pciBusID": {"string": "not-a-bus"}}),
    lambda d: d["attributes"].update({"uuid": {"int": 3}}),
    lambda d: d["attributes"].update({"type": {"string": "mig"}}),
    lambda d: d.update({"attributes": "x"}),
    lambda d: d.update({"name": ""}),
    lambda d: d["attributes"].update({"uuid": {"string": uuid(4)}}),  # published twice: both unmapped
], ids=["no-uuid", "no-pci", "bad-pci", "uuid-not-string", "mig", "attributes-not-map", "no-name", "uuid-twice"])
def test_a_device_not_understood_leaves_its_gpu_unmapped(edit):
    devices = device_map([_broken(edit)], NODE)
    assert devices.find(uuid(3), pci(3)) is None
    assert devices.skipped >= 1
    assert devices.find(uuid(5), pci(5)) is not None


def test_other_nodes_drivers_pools_and_old_generations_are_ignored():
    other = resource_slice("node-b", 8)
    foreign = copy.deepcopy(resource_slice(NODE, 8))
    foreign["spec"]["driver"] = "example.com/gpu"
    old = resource_slice(NODE, 8, generation=1)
    new = resource_slice(NODE, 2, generation=2)
    devices = device_map([other, foreign, old, new, "junk", {"spec": None}], NODE)
    assert [d.device for d in devices.devices] == ["gpu-0", "gpu-1"]


def test_the_split_moves_one_gpu_off_the_node():
    devices = device_map([resource_slice(NODE, 8)], NODE)
    verdict = Verdict.of([gpu_finding(3)], 1.0)
    split = split_verdict(verdict, ScopePolicy(noexecute=True), devices)
    assert split.node_verdict.findings == () and split.node_verdict.action is Action.NONE
    assert [(q.ref.device, q.effect) for q in split.quarantines] == [("gpu-3", "NoExecute")]
    assert [q.effect for q in split_verdict(verdict, ScopePolicy(), devices).quarantines] == ["NoExecute"]
    held = split_verdict(verdict, ScopePolicy(noexecute=False), devices)  # scope: {noexecute: false}
    assert [q.effect for q in held.quarantines] == ["NoSchedule"]


def test_without_dra_the_verdict_is_the_nodes_unchanged():
    verdict = Verdict.of([gpu_finding(3)], 1.0)
    split = split_verdict(verdict, ScopePolicy(), None)
    assert split.node_verdict is verdict and split.fallbacks == (NOT_SERVED,)
    assert split_verdict(verdict, ScopePolicy(dra="off"), device_map([resource_slice(NODE, 8)], NODE)
                         ).node_verdict is verdict


def test_node_scope_actions_and_unpublished_gpus_stay_with_the_node():
    devices = device_map([resource_slice(NODE, 8)], NODE)
    replace = gpu_finding(3, action=Action.REPLACE_NODE)
    unknown = gpu_finding(4, pci="0000:ee:00.0", uuid="GPU-unknown")
    split = split_verdict(Verdict.of([replace, unknown], 1.0), ScopePolicy(), devices)
    assert split.quarantines == ()
    assert {f.key for f in split.node_verdict.findings} == {replace.key, unknown.key}
    assert split.fallbacks == (NOT_PUBLISHED,)


def test_more_gpus_than_the_limit_make_a_reboot_node_finding():
    devices = device_map([resource_slice(NODE, 8)], NODE)
    verdict = Verdict.of([gpu_finding(i) for i in (1, 3, 5)], 1.0)
    split = split_verdict(verdict, ScopePolicy(), devices)
    assert split.quarantines == () and split.fallbacks == (TOO_MANY,)
    assert split.node_verdict.action is Action.REBOOT_NODE
    assert all("the node is the unit" in f.summary for f in split.node_verdict.findings)
    two = split_verdict(Verdict.of([gpu_finding(i) for i in (1, 3)], 1.0), ScopePolicy(), devices)
    assert len(two.quarantines) == 2


def test_monitor_findings_show_as_none_only_when_asked():
    devices = device_map([resource_slice(NODE, 8)], NODE)
    verdict = Verdict.of([gpu_finding(2, action=Action.MONITOR)], 1.0)
    assert split_verdict(verdict, ScopePolicy(), devices).quarantines == ()
    shown = split_verdict(verdict, ScopePolicy(monitor_taints=True), devices)
    assert [(q.ref.device, q.effect) for q in shown.quarantines] == [("gpu-2", "None")]
    assert shown.node_verdict.findings == verdict.findings  # a warning stays visible on the node too
