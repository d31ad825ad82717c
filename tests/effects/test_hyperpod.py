"""HyperPod's labels as pure rules: the pending value only when the disruptive step is due, never a
step back from replacement to reboot, and never over another writer's request."""

from __future__ import annotations

import pytest

from healthagent.effects.conditions import FIELD_MANAGER, label_managers
from healthagent.effects.hyperpod import (
    HYPERPOD_FAULT_REASONS_LABEL,
    HYPERPOD_FAULT_TYPES_LABEL,
    HYPERPOD_HEALTH_LABEL,
    HYPERPOD_PENDING_REBOOT,
    HYPERPOD_PENDING_REPLACEMENT,
    HYPERPOD_SCHEDULABLE,
    hyperpod_kept,
    hyperpod_labels,
    hyperpod_request,
)
from healthagent.model import Action

REPLACE, REBOOT = Action.REPLACE_NODE, Action.REBOOT_NODE
THEIR_FAULT = {HYPERPOD_FAULT_TYPES_LABEL: "Gpu", HYPERPOD_FAULT_REASONS_LABEL: "NvidiaErrorTerminal"}


def node(value: str | None = None, managers: tuple[str, ...] | None = None, **labels: str) -> dict:
    """A node whose HyperPod label is ``value``, owned by ``managers`` (None: no managedFields)."""
    all_labels = dict(labels)
    if value is not None:
        all_labels[HYPERPOD_HEALTH_LABEL] = value
    meta: dict = {"labels": all_labels}
    if managers is not None:
        meta["managedFields"] = [
            {"manager": m, "operation": "Update", "fieldsV1": {"f:metadata": {"f:labels": {
                f"f:{HYPERPOD_HEALTH_LABEL}": {}}}}} for m in managers
        ] + [{"manager": "kubelet", "operation": "Update", "fieldsV1": {"f:status": {}}}]
    return {"metadata": meta}


def wanted(n: dict, taint: Action | None, ready: bool = True, held: bool = False, agent: Action | None = None):
    return hyperpod_labels(n, agent, taint, disruptive_ready=ready, held=held, leading_code="GPU_XID")


@pytest.mark.parametrize("n,agent,expect", [
    (node(), None, ("", None)),
    (node(HYPERPOD_SCHEDULABLE, ("sagemaker-agent",)), None, ("", None)),  # no request stands
    (node(HYPERPOD_PENDING_REPLACEMENT, ("sagemaker-agent",)), REPLACE, (HYPERPOD_PENDING_REPLACEMENT, False)),
    (node(HYPERPOD_PENDING_REBOOT, (FIELD_MANAGER,)), None, (HYPERPOD_PENDING_REBOOT, True)),
    (node(HYPERPOD_PENDING_REBOOT, (FIELD_MANAGER, "kubectl-label")), REBOOT, (HYPERPOD_PENDING_REBOOT, False)),
    (node(HYPERPOD_PENDING_REBOOT, ()), REBOOT, (HYPERPOD_PENDING_REBOOT, False)),  # owned by nobody named
    # without managedFields (dry-run): the agent's when it matches the agent's own health label
    (node(HYPERPOD_PENDING_REBOOT), REBOOT, (HYPERPOD_PENDING_REBOOT, True)),
    (node(HYPERPOD_PENDING_REPLACEMENT), REBOOT, (HYPERPOD_PENDING_REPLACEMENT, False)),
    (node(HYPERPOD_PENDING_REPLACEMENT), None, (HYPERPOD_PENDING_REPLACEMENT, False)),
])
def test_who_wrote_the_request(n, agent, expect):
    assert hyperpod_request(n, agent) == expect


def test_label_managers_reads_managed_fields_and_says_when_there_are_none():
    assert label_managers(node(HYPERPOD_PENDING_REBOOT), HYPERPOD_HEALTH_LABEL) is None
    assert label_managers(node(HYPERPOD_PENDING_REBOOT, ("a", "b", "a")), HYPERPOD_HEALTH_LABEL) == ("a", "b")
    assert label_managers(node(HYPERPOD_PENDING_REBOOT, ("a",)), "other/label") == ()
    broken = {"metadata": {"managedFields": ["x", {"fieldsV1": None}, {"manager": "m", "fieldsV1": {
        "f:metadata": {"f:labels": "not a map"}}}]}}
    assert label_managers(broken, HYPERPOD_HEALTH_LABEL) == ()


def test_the_pending_value_only_once_the_disruptive_step_is_due():
    assert wanted(node(), REPLACE, ready=False) == {}
    assert wanted(node(), REPLACE) == {HYPERPOD_HEALTH_LABEL: HYPERPOD_PENDING_REPLACEMENT,
                                       HYPERPOD_FAULT_TYPES_LABEL: "GPU", HYPERPOD_FAULT_REASONS_LABEL: "GPU_XID"}
    assert wanted(node(HYPERPOD_SCHEDULABLE, ("sagemaker-agent",)), REBOOT)[HYPERPOD_HEALTH_LABEL] == \
        HYPERPOD_PENDING_REBOOT


@pytest.mark.parametrize("value", [HYPERPOD_PENDING_REPLACEMENT, HYPERPOD_PENDING_REBOOT, "Unschedulable"])
@pytest.mark.parametrize("taint", [REBOOT, REPLACE])
def test_another_writers_request_is_never_overwritten_nor_given_back(value, taint):
    theirs = node(value, ("sagemaker-agent",), **THEIR_FAULT)
    assert wanted(theirs, taint) == {}
    assert hyperpod_kept(theirs, None, taint, True) == value
    assert wanted(theirs, None, ready=False) == {}  # the agent's taint gone: still not the agent's to reset
    assert wanted(theirs, taint, ready=False, held=True) == {}


def test_the_agents_replacement_never_steps_back_to_a_reboot():
    ours = node(HYPERPOD_PENDING_REPLACEMENT, (FIELD_MANAGER,))
    assert wanted(ours, REBOOT) == {}
    assert hyperpod_kept(ours, REPLACE, REBOOT, True) == ""  # its own value: nothing to say
    # a reboot the agent asked for does become a replacement
    assert wanted(node(HYPERPOD_PENDING_REBOOT, (FIELD_MANAGER,)), REPLACE)[HYPERPOD_HEALTH_LABEL] == \
        HYPERPOD_PENDING_REPLACEMENT


def test_the_agents_own_value_is_given_back_when_its_taint_ends_or_the_budget_takes_the_slot():
    ours = node(HYPERPOD_PENDING_REPLACEMENT, (FIELD_MANAGER,))
    back = {HYPERPOD_HEALTH_LABEL: HYPERPOD_SCHEDULABLE, HYPERPOD_FAULT_TYPES_LABEL: None,
            HYPERPOD_FAULT_REASONS_LABEL: None}
    assert wanted(ours, None, ready=False) == back
    assert wanted(ours, REPLACE, ready=False, held=True) == back
    assert wanted(ours, REPLACE, ready=False) == {}  # in the grace: left as it is
