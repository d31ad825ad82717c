"""Scope as policy data: the defaults from scope.csv, the policy file's ``scope:`` section and its
one-line errors, and ``explain``'s scope line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from healthagent.model import Action
from healthagent.policy.scope import GPU, NODE, ScopePolicy, explain_scope
from healthagent.policy.settings import PolicyError, parse_policy
from tests.dra.slices import gpu_finding


@pytest.mark.parametrize("action,scope", [
    (Action.RESET_GPU, GPU), (Action.RESTART_APP, GPU), (Action.MONITOR, GPU),
    (Action.REBOOT_NODE, NODE), (Action.REPLACE_NODE, NODE)])
def test_default_scope_by_action(action, scope):
    assert ScopePolicy().scope_of(gpu_finding(1, action=action)) == scope


def test_a_finding_without_a_gpu_is_node_scope():
    assert ScopePolicy().scope_of(replace(gpu_finding(1), pci_bus_id="", uuid="")) == NODE


def test_the_policy_file_overrides_codes_and_actions():
    policy = parse_policy({"scope": {"codes": {"GPU_XID": "node"}, "actions": {"replace_node": "gpu"},
                                     "gpu_quarantine_max": 4, "noexecute": False}})
    assert policy.scope.scope_of(gpu_finding(1)) == NODE
    assert policy.scope.gpu_quarantine_max == 4 and not policy.scope.noexecute
    assert ScopePolicy().noexecute and parse_policy({"scope": {}}).scope.noexecute  # on by default
    finding = gpu_finding(1, action=Action.REPLACE_NODE)
    finding = replace(finding, code="GPU_ROW_REMAP_FAILURE")
    assert policy.scope.scope_of(finding) == GPU


@pytest.mark.parametrize("section,words", [
    ({"codes": {"NOT_A_CODE": "gpu"}}, "scope.codes.NOT_A_CODE"),
    ({"actions": {"reset_gpu": "rack"}}, "scope.actions.reset_gpu"),
    ({"actions": {"explode": "gpu"}}, "scope.actions.explode"),
    ({"gpu_quarantine_max": -1}, "scope.gpu_quarantine_max"),
    ({"gpu_quarantine_max": True}, "scope.gpu_quarantine_max"),
    ({"noexecute": "yes"}, "scope.noexecute"),
    ({"dra": "maybe"}, "scope.dra"),
    ({"nope": 1}, "scope: unknown key"),
    ("gpu", "scope: must be a mapping"),
])
def test_a_bad_scope_section_is_one_line_naming_the_key(section, words):
    with pytest.raises(PolicyError) as caught:
        parse_policy({"scope": section})
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_explain_says_the_scope_and_where_it_came_from():
    assert explain_scope("GPU_XID", Action.RESET_GPU, ScopePolicy()).startswith(
        "Scope: gpu, from action reset_gpu (scope.csv)")
    custom = parse_policy({"scope": {"codes": {"GPU_XID": "node"}}}).scope
    assert explain_scope("GPU_XID", Action.RESET_GPU, custom).startswith("Scope: node, from code GPU_XID (policy file)")
    assert explain_scope("NVSWITCH_SXID", Action.REBOOT_NODE, ScopePolicy()).startswith(
        "Scope: node, from code NVSWITCH_SXID (scope.csv)")


def test_check_says_a_gpu_finding_is_quarantined_as_one_gpu():
    from healthagent.check_report import render_check
    from healthagent.model import Collection, Verdict

    verdict = Verdict.of([gpu_finding(3), gpu_finding(4, action=Action.REPLACE_NODE)], 1.0)
    text = render_check(Collection(timestamp=1.0), verdict, scope=ScopePolicy())
    assert text.count("  scope: gpu (one GPU, not the node") == 1
    assert text.count("GPU scope: the agent quarantines this one GPU") == 1
    assert "scope: gpu" not in render_check(Collection(timestamp=1.0), verdict)
    off = render_check(Collection(timestamp=1.0), verdict, scope=ScopePolicy(dra="off"))
    assert "DRA is off in the policy file" in off
