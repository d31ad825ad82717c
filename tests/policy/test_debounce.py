"""When a finding may open: the per-code rules of the policy file (count within a window, sustain,
a grace after the boot), the built-in table they merge over, and the one function that judges them.
"""

import pytest

from healthagent.model import Action
from healthagent.policy.debounce import ALIASES, AT_ONCE, BUILT_IN, EMPTY, Rule, Tally, alias_default, step
from healthagent.policy.findings import FINDING_CODES
from healthagent.policy.settings import THRESHOLDS, Policy, PolicyError, parse_policy
from tests.support.policy import T0, classifier, collect, efa, gpu, only, verdict_of, xid

MIN = 60.0
BOOT = T0  # the node booted at T0 in these tests
READINGS = {"gpu": 10.0, "efa": 10.0, "inventory": 10.0}
NVLINK_RULE = {"findings": {"GPU_NVLINK_ERRORS": {"count": 3, "window": "10m", "after_boot_grace": "15m"}}}


def at(clf, t, **fields):
    """One observation of GPU 3 at ``t`` on a node that booted at ``BOOT``."""
    collection = collect(t, gpus=[gpu(3, t, **fields)])
    return verdict_of(clf, collection.__class__(**{**collection.__dict__, "boot_time": BOOT}))


def link_errors(clf, minutes):
    """NVLink recovery errors that grow at each of ``minutes`` after the boot (a link retraining),
    with a reading without growth between them; the verdict after each growth."""
    verdicts, value = {}, 0
    for minute in minutes:
        at(clf, BOOT + minute * MIN - 30, nvlink_errors={"replay": 0, "recovery": value})
        value += 2
        verdicts[minute] = at(clf, BOOT + minute * MIN, nvlink_errors={"replay": 0, "recovery": value})
    return verdicts


# -- the operator's story: NVLink links train for minutes after a boot ------------------------------

def test_nvlink_errors_while_links_train_after_boot_open_no_finding_three_later_do():
    clf = classifier(parse_policy(NVLINK_RULE, readings=READINGS))
    verdicts = link_errors(clf, [5, 17, 20])
    assert verdicts[5].findings == ()  # boot + 5 min: inside the 15 min grace, ignored
    assert verdicts[17].findings == ()  # the first after the grace: 1 of 3
    assert verdicts[20].findings == ()  # 2 of 3 (the one at boot + 5 min was never counted)
    finding = only(link_errors(clf, [24])[24], "GPU_NVLINK_ERRORS")  # 3 within 10 min: opens
    assert finding.action is Action.MONITOR and "NVLink replay+recovery errors" in finding.evidence


def test_without_the_policy_file_the_same_errors_open_at_once():
    verdicts = link_errors(classifier(), [5])
    assert only(verdicts[5], "GPU_NVLINK_ERRORS").action is Action.MONITOR


def test_occurrences_further_apart_than_the_window_never_open():
    clf = classifier(parse_policy(NVLINK_RULE, readings=READINGS))
    verdicts = link_errors(clf, [16, 24, 32, 40, 48])  # one every 8 min: never 3 within 10
    assert all(v.findings == () for v in verdicts.values())


def test_an_unknown_boot_time_applies_no_grace():
    clf = classifier(parse_policy({"findings": {"GPU_NVLINK_ERRORS": {"after_boot_grace": "15m"}}}))
    verdict_of(clf, collect(BOOT + 4 * MIN, gpus=[gpu(3, BOOT + 4 * MIN, nvlink_errors={"recovery": 0})]))
    grew = verdict_of(clf, collect(BOOT + 5 * MIN, gpus=[gpu(3, BOOT + 5 * MIN, nvlink_errors={"recovery": 2})]))
    assert only(grew, "GPU_NVLINK_ERRORS")


def test_a_boot_time_after_the_observation_is_no_boot_time():
    clf = classifier(parse_policy({"findings": {"GPU_NVLINK_ERRORS": {"after_boot_grace": "15m"}}}))
    future = T0 + 10 * 86400  # garbage: it would silence the signal for ten days
    for t, value in ((T0, 0), (T0 + MIN, 2)):
        collection = collect(t, gpus=[gpu(3, t, nvlink_errors={"recovery": value})])
        verdict = verdict_of(clf, collection.__class__(**{**collection.__dict__, "boot_time": future}))
    assert only(verdict, "GPU_NVLINK_ERRORS")


# -- the same rule for every kind of signal -------------------------------------------------------

def test_xids_inside_the_grace_open_no_incident_and_a_count_needs_its_window():
    pol = parse_policy({"findings": {"GPU_XID": {"count": 2, "window": "5m", "after_boot_grace": "10m"}}})
    clf = classifier(pol)

    def xids(t, number=74):
        collection = collect(t, xids=[xid(number, t=t)])
        return clf.observe(collection.__class__(**{**collection.__dict__, "boot_time": BOOT}))

    early = xids(BOOT + 2 * MIN)
    assert early.verdict.findings == () and len(early.counted_xids) == 1  # counted, not judged
    assert xids(BOOT + 11 * MIN).verdict.findings == ()  # 1 of 2
    assert xids(BOOT + 20 * MIN).verdict.findings == ()  # 9 min later: the first is out of the window
    opened = only(xids(BOOT + 23 * MIN).verdict, "GPU_XID")
    assert opened.action is Action.RESET_GPU and opened.xids == (74,)


def test_a_sustain_set_in_the_file_replaces_the_built_in_five_minutes():
    pol = parse_policy({"findings": {"GPU_THERMAL_THROTTLE": {"sustain": "2m"}}})
    clf = classifier(pol)
    hot = {"throttle_reasons": ("hw_thermal_slowdown",)}
    opened = [bool(at(clf, BOOT + 3600 + i * MIN, **hot).findings) for i in range(4)]
    assert opened == [False, False, True, True]


def test_efa_drops_over_the_limit_must_be_sustained_and_a_good_reading_restarts_the_clock():
    clf = classifier(parse_policy({"findings": {"EFA_RX_DROPS": {"sustain": "2m"}}}))
    drops, opened = 0, []
    for minute, over in enumerate([True, True, False, True, True, True]):
        drops += 1000 if over else 0
        t = T0 + minute * MIN
        opened.append(bool(verdict_of(clf, collect(t, efa=[efa("rdmap79s0", t, rx_drops=drops)])).findings))
    # the reading at minute 0 is the baseline; minutes 1 over, 2 not, 3-5 over: 2 min at minute 5
    assert opened == [False, False, False, False, False, True]


def test_condition_raise_evaluations_is_the_count_of_every_condition():
    by_alias = parse_policy({"thresholds": {"condition_raise_evaluations": 2}})
    by_entry = parse_policy({"findings": {"GPU_ROW_REMAP_PENDING": {"count": 2}}})
    assert by_alias.rule("GPU_ROW_REMAP_PENDING") == by_entry.rule("GPU_ROW_REMAP_PENDING") == Rule(count=2)
    assert by_alias.rule("GPU_LOST") == Rule(count=2) and by_entry.rule("GPU_LOST") == AT_ONCE
    from healthagent.model import RemapState

    pending = {"remap": RemapState(0, 1, True, False)}
    for pol in (by_alias, by_entry):
        clf = classifier(pol)
        assert [bool(at(clf, T0 + i * 30, **pending).findings) for i in range(3)] == [False, True, True]


def test_an_entry_for_one_code_wins_over_the_alias_and_says_where_each_field_came_from():
    pol = parse_policy({"thresholds": {"throttle_sustain_seconds": 60},
                        "findings": {"GPU_POWER_THROTTLE": {"sustain": "10m", "after_boot_grace": 300}}})
    assert pol.rule("GPU_THERMAL_THROTTLE") == Rule(sustain=60.0)
    assert pol.rule("GPU_POWER_THROTTLE") == Rule(sustain=600.0, after_boot_grace=300.0)
    assert pol.rules.origin("GPU_THERMAL_THROTTLE", "sustain") == "thresholds.throttle_sustain_seconds"
    assert pol.rules.origin("GPU_POWER_THROTTLE", "sustain") == "findings.GPU_POWER_THROTTLE.sustain"
    assert pol.rules.origin("GPU_POWER_THROTTLE", "count") == "built-in"


def test_the_tallies_survive_a_restart():
    pol = parse_policy(NVLINK_RULE, readings=READINGS)
    clf = classifier(pol)
    link_errors(clf, [16, 18])
    restarted = classifier(pol)
    restarted.restore_state(clf.export_state())
    assert restarted.restore_errors == 0
    assert only(link_errors(restarted, [20])[20], "GPU_NVLINK_ERRORS")


def test_a_reboot_starts_every_count_again():
    pol = parse_policy({"findings": {"GPU_NVLINK_ERRORS": {"count": 2, "window": "1h"}}})
    clf = classifier(pol)
    for t, value, boot in ((T0, 0, "b1"), (T0 + MIN, 2, "b1"), (T0 + 2 * MIN, 0, "b2"), (T0 + 3 * MIN, 2, "b2")):
        verdict = verdict_of(clf, collect(t, gpus=[gpu(3, t, nvlink_errors={"recovery": value})], boot_id=boot))
    assert verdict.findings == ()


# -- the table and the function -------------------------------------------------------------------

def test_every_finding_code_has_a_row_in_the_one_table():
    missing = [code for code in FINDING_CODES if code not in BUILT_IN]
    assert not missing, f"add a row for {missing} to BUILT_IN in healthagent/policy/debounce.py"
    assert set(BUILT_IN) <= set(FINDING_CODES)


def test_the_old_threshold_keys_default_to_the_table():
    for key in ALIASES:
        assert THRESHOLDS[key].default == alias_default(key)
    assert Policy().rule("GPU_THERMAL_THROTTLE") == Rule(sustain=300.0)
    assert Policy().rule("RDMA_PORT_DOWN") == Rule(sustain=30.0, after_boot_grace=300.0)
    assert Policy().rule("RDMA_LINK_FLAPPING") == Rule(count=5, window=60.0)
    assert Policy().rule("PCIE_AER_CORRECTABLE") == Rule(sustain=300.0)
    assert all(Policy().rule(code) == AT_ONCE for code in FINDING_CODES
               if "THROTTLE" not in code and code not in ("RDMA_PORT_DOWN", "RDMA_LINK_FLAPPING",
                                                          "PCIE_AER_CORRECTABLE"))


@pytest.mark.parametrize("rule,readings,opened", [
    (AT_ONCE, [(0, True)], [True]),
    (Rule(count=3), [(0, True), (10, True), (20, False), (30, True), (40, True), (50, True)],
     [False, False, False, False, False, True]),
    (Rule(count=2, window=60), [(0, True), (30, False), (50, True), (200, True), (300, True)],
     [False, False, True, False, False]),
    (Rule(sustain=60), [(0, True), (30, True), (60, True), (70, False), (80, True), (130, True), (140, True)],
     [False, False, True, False, False, False, True]),
    (Rule(count=2, window=600, sustain=60), [(0, True), (10, True), (60, True)], [False, False, True]),
])
def test_step(rule, readings, opened):
    tally, got = EMPTY, []
    for t, present in readings:
        tally, opens = step(rule, tally, float(t), present)
        got.append(opens)
    assert got == opened


def test_a_folded_flood_counts_its_occurrences_and_the_tally_stays_small():
    tally, opens = step(Rule(count=5, window=60), EMPTY, 0.0, True, occurrences=5)
    assert opens
    for t in range(1, 2000):
        tally, _ = step(Rule(count=3, window=10_000), tally, float(t), True)
    assert len(tally.hits) == 3
    assert Tally.from_dict(tally.to_dict()) == tally


# -- mistakes stop start-up with one line naming the key and the fix ------------------------------

@pytest.mark.parametrize("findings,key,fix", [
    ({"GPU_NVLINK_DOWN": {"count": 3}}, "findings.GPU_NVLINK_DOWN", "did you mean GPU_NVLINK_ERRORS?"),
    ({"GPU_NVLINK_ERRORS": {"cout": 3}}, "findings.GPU_NVLINK_ERRORS.cout", "valid keys: count, window"),
    ({"GPU_NVLINK_ERRORS": {"count": 0}}, "findings.GPU_NVLINK_ERRORS.count", "at least 1"),
    ({"GPU_NVLINK_ERRORS": {"count": 2.5}}, "findings.GPU_NVLINK_ERRORS.count", "whole number"),
    ({"GPU_NVLINK_ERRORS": {"count": True}}, "findings.GPU_NVLINK_ERRORS.count", "whole number"),
    ({"GPU_NVLINK_ERRORS": {"count": 5000}}, "findings.GPU_NVLINK_ERRORS.count", "at most 1000"),
    ({"GPU_NVLINK_ERRORS": {"window": -60}}, "findings.GPU_NVLINK_ERRORS.window", "0 or more"),
    ({"GPU_NVLINK_ERRORS": {"sustain": "-5m"}}, "findings.GPU_NVLINK_ERRORS.sustain", "0 or more"),
    ({"GPU_NVLINK_ERRORS": {"window": "10 minutes"}}, "findings.GPU_NVLINK_ERRORS.window", "90s, 10m, 1h"),
    ({"GPU_NVLINK_ERRORS": {"after_boot_grace": "soon"}}, "findings.GPU_NVLINK_ERRORS.after_boot_grace",
     "90s, 10m, 1h"),
    ({"GPU_NVLINK_ERRORS": {"window": ".nan"}}, "findings.GPU_NVLINK_ERRORS.window", "90s, 10m, 1h"),
    ({"GPU_NVLINK_ERRORS": {"window": "60d"}}, "findings.GPU_NVLINK_ERRORS.window", "90s, 10m, 1h"),
    ({"GPU_NVLINK_ERRORS": {"window": 10**9}}, "findings.GPU_NVLINK_ERRORS.window", "at most 30 days"),
    ({"GPU_NVLINK_ERRORS": {"count": 3, "window": "15s"}}, "findings.GPU_NVLINK_ERRORS.window",
     "use a window of at least 20s or a smaller count"),
    ({"GPU_NVLINK_ERRORS": {"count": 3, "window": 0}}, "findings.GPU_NVLINK_ERRORS.window", "longer window"),
    ({"GPU_XID": {"count": 3}}, "findings.GPU_XID.window", "add e.g. window: 10m"),
    ({"GPU_XID": {"sustain": "5m"}}, "findings.GPU_XID.sustain", "use count and window instead"),
    ({"GPU_XID": {"count": 2}, "gpu_xid": {"count": 3}}, "findings.GPU_XID", "keep one"),
    ({"GPU_XID": 3}, "findings.GPU_XID", "must be a mapping"),
    ({"GPU_XID": {}}, "findings.GPU_XID", "must be a mapping"),
    (["GPU_XID"], "findings", "must be a mapping of finding code: rule"),
])
def test_every_mistake_is_one_line_naming_the_key_and_the_fix(findings, key, fix):
    with pytest.raises(PolicyError) as err:
        parse_policy({"findings": findings}, readings=READINGS)
    message = str(err.value)
    assert "\n" not in message and message.startswith(key + ":") and fix in message, message


def test_the_window_a_count_needs_follows_the_configured_reading_interval():
    rule = {"findings": {"EFA_RX_DROPS": {"count": 3, "window": "50s"}}}
    assert parse_policy(rule, readings={**READINGS, "efa": 20.0}).rule("EFA_RX_DROPS").window == 50.0
    with pytest.raises(PolicyError, match=r"^findings.EFA_RX_DROPS.window: .* at least 60s"):
        parse_policy(rule, readings={**READINGS, "efa": 30.0})


def test_the_example_policy_file_sets_the_nvlink_rule():
    from pathlib import Path

    from healthagent.policy.settings import load_policy

    example = Path(__file__).parents[1] / "fixtures" / "policy" / "policy-example.yaml"
    assert load_policy(str(example), READINGS).rule("GPU_NVLINK_ERRORS") == Rule(count=3, window=600.0,
                                                                                 after_boot_grace=900.0)


def test_durations_accept_seconds_and_units():
    pol = parse_policy({"findings": {"GPU_LOST": {"sustain": 90, "after_boot_grace": "1h"},
                                     "GPU_MISSING": {"sustain": "90s", "after_boot_grace": "1.5m"},
                                     "EFA_RX_DROPS": {"sustain": "600"}}})
    assert pol.rule("GPU_LOST") == Rule(sustain=90.0, after_boot_grace=3600.0)
    assert pol.rule("GPU_MISSING") == Rule(sustain=90.0, after_boot_grace=90.0)
    assert pol.rule("EFA_RX_DROPS") == Rule(sustain=600.0)
