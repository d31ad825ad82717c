"""An operator's clear reaches policy as an input (``Collection.operator_clear``), once per token."""

from dataclasses import replace

from healthagent.model import Action
from tests.support.policy import T0, classifier, collect, gpus, xid


def test_a_new_token_forgets_every_open_finding_once_and_survives_a_restart():
    clf = classifier()
    assert clf.observe(collect(T0, gpus=gpus(), xids=[xid(94)])).verdict.action is Action.REPLACE_NODE
    cleared = clf.observe(replace(collect(T0 + 60, gpus=gpus(T0 + 60)), operator_clear="ticket-1"))
    assert cleared.cleared == 1 and cleared.verdict.findings == ()
    # the same token again (every cycle carries it while it is on the node) clears nothing new
    clf.observe(collect(T0 + 70, gpus=gpus(T0 + 70), xids=[xid(94, t=T0 + 70)]))
    again = clf.observe(replace(collect(T0 + 80, gpus=gpus(T0 + 80)), operator_clear="ticket-1"))
    assert again.cleared == 0 and again.verdict.action is Action.REPLACE_NODE
    restarted = classifier()
    restarted.restore_state(clf.export_state())
    assert restarted.clear_token == "ticket-1"
    after = restarted.observe(replace(collect(T0 + 90, gpus=gpus(T0 + 90)), operator_clear="ticket-1"))
    assert after.cleared == 0 and after.verdict.action is Action.REPLACE_NODE
    fresh = restarted.observe(replace(collect(T0 + 95, gpus=gpus(T0 + 95)), operator_clear="ticket-2"))
    assert fresh.cleared == 1 and fresh.verdict.findings == ()
