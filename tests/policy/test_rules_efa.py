"""EFA rules: missing devices (there is no port-down rule), a stuck admin queue, error rates."""

import pytest

from healthagent.model import Action, SourceHealth
from tests.support.policy import verdict_of, T0, classifier, codes, collect, efa, only, policy

DEVICES = [f"rdmap{79 + i}s0" for i in range(4)]


def fleet(t, skip=(), **counters):
    return [efa(d, t, **counters) for d in DEVICES if d not in skip]


def test_fewer_devices_than_expected():
    verdict = verdict_of(classifier(), collect(T0, efa=fleet(T0, skip=DEVICES[:1]), expected_efa_devices=4))
    finding = only(verdict, "EFA_DEVICE_MISSING")
    assert finding.action is Action.REBOOT_NODE
    assert finding.evidence == "3 EFA devices read, expected 4"


def test_a_device_that_vanished_is_named_and_survives_until_reboot():
    clf = classifier()
    verdict_of(clf, collect(T0, efa=fleet(T0), boot_id="b1"))
    gone = only(verdict_of(clf, collect(T0 + 10, efa=fleet(T0 + 10, skip=[DEVICES[2]]), boot_id="b1")),
                "EFA_DEVICE_MISSING")
    assert "not seen any more: rdmap81s0" in gone.evidence
    back = verdict_of(clf, collect(T0 + 20, efa=fleet(T0 + 20), boot_id="b1"))
    assert only(back, "EFA_DEVICE_MISSING").action is Action.REBOOT_NODE
    assert verdict_of(clf, collect(T0 + 900, efa=fleet(T0 + 900), boot_id="b2")).findings == ()


def test_port_state_is_not_a_signal():
    down_looking = [s.__class__(**{**s.__dict__, "port_state": "1: DOWN"}) for s in fleet(T0)]
    assert verdict_of(classifier(), collect(T0, efa=down_looking, expected_efa_devices=4)).findings == ()


def test_driver_gone_is_missing_but_an_unreadable_sysfs_is_not():
    gone = SourceHealth(source="efa", up=True, detail="no sys/class/infiniband (no RDMA devices on this host)")
    finding = only(verdict_of(classifier(), collect(T0, health=[gone], expected_efa_devices=32)), "EFA_DEVICE_MISSING")
    assert finding.evidence == "0 EFA devices read, expected 32"
    unreadable = SourceHealth(source="efa", up=False, detail="cannot read sys/class/infiniband")
    clf = classifier()
    verdict_of(clf, collect(T0, efa=fleet(T0), health=[SourceHealth(source="efa", up=True)]))
    assert verdict_of(clf, collect(T0 + 10, health=[unreadable], expected_efa_devices=4)).findings == ()
    assert verdict_of(classifier(), collect(T0, expected_efa_devices=32)).findings == ()  # no EFA source at all


def test_admin_queue_stuck_is_reboot_class():
    clf = classifier()
    verdict_of(clf, collect(T0, efa=fleet(T0, no_completion_cmds=0)))
    verdict = verdict_of(clf, collect(T0 + 10, efa=[efa(DEVICES[0], T0 + 10, no_completion_cmds=1)]
                                  + fleet(T0 + 10, skip=DEVICES[:1], no_completion_cmds=0)))
    finding = only(verdict, "EFA_ADMIN_QUEUE_STUCK")
    assert (finding.fabric_device, finding.action, finding.evidence) == (
        DEVICES[0], Action.REBOOT_NODE, "no_completion_cmds 0 -> 1")
    later = verdict_of(clf, collect(T0 + 7200, efa=[efa(DEVICES[0], T0 + 7200, no_completion_cmds=1)]
                                + fleet(T0 + 7200, skip=DEVICES[:1], no_completion_cmds=0)))
    assert only(later, "EFA_ADMIN_QUEUE_STUCK").subject == DEVICES[0]


@pytest.mark.parametrize("counter,code", [
    ("unresponsive_remote_events", "EFA_UNRESPONSIVE_REMOTE"),
    ("impaired_remote_conn_events", "EFA_IMPAIRED_REMOTE"),
    ("retrans_timeout_events", "EFA_RETRANS_TIMEOUT"),
    ("cmds_err", "EFA_CMD_ERRORS"),
    ("rx_drops", "EFA_RX_DROPS"),
    ("rdma_read_wr_err", "EFA_WR_ERRORS"),
    ("rdma_write_wr_err", "EFA_WR_ERRORS"),
])
def test_error_rates_over_100_a_minute(counter, code):
    clf = classifier()
    steps = [0, 60, 100, 250]  # +60 and +40 are tolerated, +150 in a minute is not
    verdicts = [verdict_of(clf, collect(T0 + 30 * i, efa=[efa("rdmap79s0", T0 + 30 * i, **{counter: v})]))
                for i, v in enumerate(steps)]
    assert [v.findings for v in verdicts[:3]] == [(), (), ()]
    finding = only(verdicts[3], code)
    assert finding.action is Action.MONITOR and finding.fabric_device == "rdmap79s0"
    assert "+190 in 60 s (limit 100/min)" in finding.evidence
    assert f"docs/findings.md#{code.lower()}" in finding.next_steps


def test_counter_reset_and_unsupported_counters():
    clf = classifier()
    values = [5000, 5100, 10, 20]  # a driver reload between the 2nd and 3rd reading
    verdicts = [verdict_of(clf, collect(T0 + 30 * i, efa=[efa("rdmap79s0", T0 + 30 * i, rx_drops=v)]))
                for i, v in enumerate(values)]
    assert all(v.findings == () for v in verdicts)
    bare = [verdict_of(clf, collect(T0 + 200 + i, efa=[efa("rdmap79s0", T0 + 200 + i), efa("rdmap80s0", T0 + 200 + i)]))
            for i in range(3)]
    assert all(v.findings == () for v in bare)


def test_rate_finding_clears_after_a_quiet_period_and_flapping_keeps_it():
    clf = classifier(policy(counter_quiet_seconds=300))
    value, actions = 0, []
    for i in range(20):  # a burst every other minute for 20 minutes
        value += 500 if i % 2 == 0 else 0
        verdict = verdict_of(clf, collect(T0 + 60 * i, efa=[efa("rdmap79s0", T0 + 60 * i, rx_drops=value)]))
        actions.append(verdict.action)
    assert actions[0] is Action.NONE and set(actions[2:]) == {Action.MONITOR}
    for i in range(20, 30):
        verdict = verdict_of(clf, collect(T0 + 60 * i, efa=[efa("rdmap79s0", T0 + 60 * i, rx_drops=value)]))
        actions.append(verdict.action)
    assert actions[-1] is Action.NONE
    assert actions[20:24] == [Action.MONITOR] * 4


def test_exact_values_hold_the_same_points_as_the_history_whatever_cut_it():
    """The exact integers kept for the evidence follow the float history point for point: as the
    window moves on, after a counter reset, and after the clock stepped back."""
    from healthagent.policy.rules_efa import EfaTrack

    track = EfaTrack()
    series = "EFA_RX_DROPS"

    def note(t, value):
        track.counter(series).add(t, value, 60.0)
        track.note_exact(series, t, value)
        assert sorted(track.exact[series]) == [p for p, _ in track.counter(series).points]

    for i in range(40):  # the window (60 s) moves on: the oldest go
        note(T0 + 10 * i, 2**64 - 1000 + i)
    assert track.exact_at(series, T0 + 390) == 2**64 - 1000 + 39  # exact beyond a float's precision
    note(T0 + 400, 5)  # a reset: the history starts again
    note(T0 + 410, 6)
    note(T0 + 405, 7)  # the clock stepped back
    assert track.exact_at(series, T0 + 405) == 7


def test_a_value_that_is_no_number_is_skipped_and_the_rest_of_its_rule_still_counts():
    """Only finite numbers count: a NaN, a bool or text in one counter of a summed rule leaves the
    other counter judged on its own, and the admin queue ignores what is no count."""
    clf = classifier()
    odd = dict(rdma_read_wr_err=float("nan"), no_completion_cmds=True, cmds_err="12")
    verdicts = [verdict_of(clf, collect(T0 + 30 * i, efa=[efa("rdmap79s0", T0 + 30 * i, rdma_write_wr_err=v, **odd)]))
                for i, v in enumerate([0, 60, 100, 250])]
    assert [v.findings for v in verdicts[:3]] == [(), (), ()]
    finding = only(verdicts[3], "EFA_WR_ERRORS")
    assert finding.evidence == "rdma_read_wr_err+rdma_write_wr_err +190 in 60 s (limit 100/min)"
    assert codes(verdicts[3]) == ["EFA_WR_ERRORS"]
