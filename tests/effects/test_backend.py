"""The API backend: preconditions of node writes, no client-level retries, error kinds."""

import logging

import pytest

from healthagent.effects.backend import (
    ApiBackend,
    ApiRejected,
    ApiUnavailable,
    Conflict,
    json_patch_ops,
    pointer_get,
    split_api_conditions,
)
from healthagent.model import API_CONDITION_KINDS

TAINT_KEY = "healthagent.io/unhealthy"
FOREIGN = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}


def node(taints=None, labels=None, annotations=None, uid="u-1"):
    meta = {"name": "n", "uid": uid}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": {} if taints is None else {"taints": taints}}


def preconditions(ops):
    return {op["path"]: op["value"] for op in ops if op["op"] == "test"}


def test_adding_the_taint_tests_the_uid_and_the_taint_list_as_read():
    basis = node(taints=[FOREIGN], labels={"team": "ml"})
    new = [FOREIGN, {"key": TAINT_KEY, "value": "replace_node", "effect": "NoSchedule"}]
    ops = json_patch_ops(basis, {"spec": {"taints": new}, "metadata": {"labels": {"healthagent.io/health": "x"}}})
    assert preconditions(ops) == {"/metadata/uid": "u-1", "/spec/taints": [FOREIGN]}
    assert {"op": "add", "path": "/spec/taints", "value": new} in ops
    # setting an owned label needs no precondition: the key is the agent's own
    assert {"op": "add", "path": "/metadata/labels/healthagent.io~1health", "value": "x"} in ops


def test_a_node_without_taints_is_tested_for_none():
    ops = json_patch_ops(node(), {"spec": {"taints": [FOREIGN]}})
    assert preconditions(ops)["/spec/taints"] is None


def test_removing_a_label_tests_its_value_and_a_missing_map_is_created_whole():
    basis = node(labels={"healthagent.io/health": "replace-required", "team": "ml"})
    ops = json_patch_ops(basis, {"metadata": {"labels": {"healthagent.io/health": None}}})
    assert ops[1:] == [{"op": "test", "path": "/metadata/labels/healthagent.io~1health", "value": "replace-required"},
                       {"op": "remove", "path": "/metadata/labels/healthagent.io~1health"}]
    ops = json_patch_ops(node(), {"metadata": {"annotations": {"healthagent.io/clear-handled": "t1", "gone": None}}})
    assert ops[1:] == [{"op": "test", "path": "/metadata/annotations", "value": None},
                       {"op": "add", "path": "/metadata/annotations", "value": {"healthagent.io/clear-handled": "t1"}}]


def test_removing_a_label_that_is_already_gone_is_no_operation():
    ops = json_patch_ops(node(labels={"team": "ml"}), {"metadata": {"labels": {"healthagent.io/health": None}}})
    assert ops == [{"op": "test", "path": "/metadata/uid", "value": "u-1"}]


def test_pointer_get_reads_escaped_keys_and_missing_parts_as_none():
    doc = {"metadata": {"labels": {"a/b": "1", "c~d": "2"}}, "spec": {"taints": [{"key": "k"}]}}
    assert pointer_get(doc, "/metadata/labels/a~1b") == "1"
    assert pointer_get(doc, "/metadata/labels/c~0d") == "2"
    assert pointer_get(doc, "/spec/taints/0/key") == "k"
    assert pointer_get(doc, "/spec/taints/3") is None and pointer_get(doc, "/status/conditions") is None


def test_api_conditions_and_internal_errors_are_told_apart():
    internal, api = split_api_conditions({"unavailable": 3, "rejected_403": 1, "node_not_found": 2,
                                          "budget_count_failed": 1, "internal": 1})
    assert internal == {"rejected_403": 1, "internal": 1}
    assert api == {"unavailable": 3, "node_not_found": 2, "budget_count_failed": 1}
    assert set(api) <= set(API_CONDITION_KINDS)


@pytest.mark.integration
def test_a_failed_test_is_a_conflict_carrying_the_fresh_node_and_a_real_refusal_is_not(fake):
    fake.seed_nodes(1)
    backend = ApiBackend(fake.api_client(), "gpu-node-0")
    basis = backend.read_node()
    fake.update_node("gpu-node-0", lambda n: n["spec"].update(taints=[FOREIGN]))  # a foreign taint lands
    with pytest.raises(Conflict) as info:
        backend.patch_node({"spec": {"taints": [{"key": TAINT_KEY, "value": "v", "effect": "NoSchedule"}]}}, basis)
    assert info.value.node["spec"]["taints"] == [FOREIGN]  # the re-read node, for the next plan
    assert fake.node("gpu-node-0")["spec"]["taints"] == [FOREIGN]  # nothing lost
    fresh = backend.read_node()
    with pytest.raises(ApiRejected) as refused:  # the server refuses the patch itself: not a conflict
        backend.patch_node({"spec": {"taints": [{"key": TAINT_KEY, "effect": "NoWhenever"}]}}, fresh)
    assert refused.value.status == 422 and not isinstance(refused.value, Conflict)


@pytest.mark.integration
def test_the_client_does_not_retry_by_itself(fake, caplog):
    """One refused connection is one failed call: the agent's own backoff decides what next,
    and urllib3 logs no 'Retrying' warning per attempt."""
    fake.seed_nodes(1)
    api_client = fake.api_client()
    backend = ApiBackend(api_client, "gpu-node-0", request_timeout=(1.0, 2.0))
    assert api_client.configuration.retries is False
    fake.go_down()
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ApiUnavailable):
        backend.read_node()
    assert not [r for r in caplog.records if r.name.startswith("urllib3") and r.levelno >= logging.WARNING]
    fake.come_up()
    fake.fail_next(1, status=503)
    before = len(fake.requests())
    with pytest.raises(ApiUnavailable):
        backend.read_node()
    assert len(fake.requests()) == before + 1  # one request, not four
