"""GPU counter and condition rules, each driven by a sequence of Collections: growth, resets,
unsupported (None) values, flapping, and the persistence of each class."""

from healthagent.model import Action, EccCounts, RemapState, RetiredPages, SourceHealth
from tests.support.policy import verdict_of, P5_PCI, T0, classifier, collect, gpu, gpus, only, policy

DAY = 86400.0


def run(clf, samples, step=30.0, **kw):
    """Observe one GPU-3 sample per step; returns the verdicts."""
    verdicts = []
    for i, fields in enumerate(samples):
        t = T0 + i * step
        verdicts.append(verdict_of(clf, collect(t, gpus=[gpu(3, t, **fields)], **kw)))
    return verdicts


def ecc(vol_unc=None, agg_unc=None, vol_cor=None, agg_cor=None):
    return {"ecc": EccCounts(volatile_corrected=vol_cor, volatile_uncorrected=vol_unc,
                             aggregate_corrected=agg_cor, aggregate_uncorrected=agg_unc)}


# -- ECC ------------------------------------------------------------------------------------------

def test_dbe_growth_is_reset_gpu_with_the_numbers():
    verdicts = run(classifier(), [ecc(0), ecc(0), ecc(2)])
    assert verdicts[1].findings == ()
    finding = only(verdicts[2], "GPU_ECC_DBE")
    assert finding.action is Action.RESET_GPU
    assert finding.evidence == "volatile DBE 0 -> 2 in 30 s"
    assert (finding.gpu_index, finding.pci_bus_id) == (3, P5_PCI[3])
    assert "nvidia-smi -r -i 3" in finding.next_steps
    assert finding.next_steps.endswith("Runbook: docs/findings.md#gpu_ecc_dbe")


def test_nonzero_volatile_dbe_on_first_sight_is_reported():
    finding = only(run(classifier(), [ecc(3)])[0], "GPU_ECC_DBE")
    assert "volatile DBE count is 3" in finding.evidence


def test_counter_reset_is_not_a_fault_and_none_is_never_a_finding():
    verdicts = run(classifier(), [ecc(agg_unc=10), ecc(agg_unc=10), ecc(agg_unc=4), ecc(agg_unc=4), ecc()])
    assert all(v.findings == () for v in verdicts)
    grown = run(classifier(), [ecc(agg_unc=4), ecc(agg_unc=6)])
    assert only(grown[1], "GPU_ECC_DBE").evidence == "aggregate DBE 4 -> 6 in 30 s"


def test_dbe_finding_expires_after_the_counter_window_without_growth():
    clf = classifier(policy(counter_window_seconds=600))
    run(clf, [ecc(0), ecc(1)])
    assert verdict_of(clf, collect(T0 + 600, gpus=[gpu(3, T0 + 600, **ecc(1))])).action is Action.RESET_GPU
    assert verdict_of(clf, collect(T0 + 700, gpus=[gpu(3, T0 + 700, **ecc(1))])).findings == ()


def test_sbe_storm_needs_a_high_and_accelerating_rate():
    clf = classifier(policy(sbe_window_seconds=600, sbe_storm_per_minute=10, counter_quiet_seconds=300))
    counts, value = [], 0
    for minute in range(40):  # 20 minutes at 1/min, then 200/min
        value += 1 if minute < 20 else 200
        counts.append(ecc(vol_cor=value))
    verdicts = run(clf, counts, step=60)
    assert all(v.findings == () for v in verdicts[:20])
    storm = only(verdicts[20], "GPU_SBE_STORM")
    assert storm.action is Action.MONITOR
    assert "corrected ECC +" in storm.evidence and "/min" in storm.evidence


def test_steady_corrected_errors_below_the_storm_rate_never_raise():
    verdicts = run(classifier(), [ecc(vol_cor=5 * i) for i in range(60)], step=60)
    assert all(v.findings == () for v in verdicts)


# -- row remapping, retired pages ------------------------------------------------------------------

def test_remap_pending_raises_and_clears_after_good_evaluations():
    clf = classifier(policy(condition_clear_evaluations=3))
    pending, done = {"remap": RemapState(0, 1, True, False)}, {"remap": RemapState(0, 1, False, False)}
    verdicts = run(clf, [pending, done, done, done])
    finding = only(verdicts[0], "GPU_ROW_REMAP_PENDING")
    assert finding.action is Action.RESET_GPU
    assert "uncorrectable 1" in finding.evidence
    assert [len(v.findings) for v in verdicts] == [1, 1, 1, 0]


def test_flapping_remap_pending_does_not_flip_the_verdict():
    clf = classifier(policy(condition_clear_evaluations=3))
    flags = [{"remap": RemapState(0, 1, i % 2 == 0, False)} for i in range(12)]
    assert {v.action for v in run(clf, flags)} == {Action.RESET_GPU}


def test_stale_samples_do_not_count_as_evaluations():
    clf = classifier(policy(condition_clear_evaluations=3))
    run(clf, [{"remap": RemapState(0, 1, True, False)}])
    healed = gpu(3, T0 + 30, remap=RemapState(0, 1, False, False))
    for i in range(5):  # kernel-log wake-ups re-run policy with the same sample
        verdict = verdict_of(clf, collect(T0 + 30 + i, gpus=[healed]))
    assert verdict.action is Action.RESET_GPU
    for i in range(2):
        verdict = verdict_of(clf, collect(T0 + 60 + 30 * i, gpus=[gpu(3, T0 + 60 + 30 * i, remap=RemapState(0, 1, False, False))]))
    assert verdict.findings == ()


def test_remap_failure_is_replace_and_stays_quiet_after_clear_until_it_changes():
    clf = classifier()
    failed, fine = {"remap": RemapState(0, 8, False, True)}, {"remap": RemapState(0, 8, False, False)}
    verdicts = run(clf, [failed, fine, fine, fine, fine])
    assert {v.action for v in verdicts} == {Action.REPLACE_NODE}  # sticky
    assert only(verdicts[-1], "GPU_ROW_REMAP_FAILURE").pci_bus_id == P5_PCI[3]
    assert clf.clear(T0 + 200, "RMA filed") == 1
    assert verdict_of(clf, collect(T0 + 210, gpus=[gpu(3, T0 + 210, **failed)])).findings == ()
    verdict_of(clf, collect(T0 + 220, gpus=[gpu(3, T0 + 220, **fine)]))
    again = verdict_of(clf, collect(T0 + 230, gpus=[gpu(3, T0 + 230, **failed)]))
    assert only(again, "GPU_ROW_REMAP_FAILURE").action is Action.REPLACE_NODE


def test_remap_none_is_unsupported():
    assert run(classifier(), [{"remap": RemapState()}])[0].findings == ()


def test_retired_pages_total_limit():
    finding = only(run(classifier(), [{"retired_pages": RetiredPages(40, 20, False)}])[0], "GPU_RETIRED_PAGES")
    assert finding.action is Action.REPLACE_NODE
    assert "40 single-bit + 20 double-bit = 60 (limit 60)" in finding.evidence


def test_retired_dbe_pages_past_soft_limit_that_keep_growing():
    clf = classifier()
    assert run(clf, [{"retired_pages": RetiredPages(0, 16, False)}])[0].findings == ()
    later = verdict_of(clf, collect(T0 + DAY, gpus=[gpu(3, T0 + DAY, retired_pages=RetiredPages(0, 18, False))]))
    assert only(later, "GPU_RETIRED_PAGES").action is Action.REPLACE_NODE
    slow = classifier()
    run(slow, [{"retired_pages": RetiredPages(0, 16, False)}])
    month = verdict_of(slow, collect(T0 + 30 * DAY, gpus=[gpu(3, T0 + 30 * DAY, retired_pages=RetiredPages(0, 17, False))]))
    assert month.findings == ()


def test_retired_pages_pending():
    finding = only(run(classifier(), [{"retired_pages": RetiredPages(1, 0, True)}])[0], "GPU_RETIRED_PAGES_PENDING")
    assert finding.action is Action.RESET_GPU


# -- lost and missing GPUs ------------------------------------------------------------------------

def test_lost_gpu_is_reboot_class_and_escalates_when_it_survives_a_reboot():
    clf = classifier()
    verdict = verdict_of(clf, collect(T0, gpus=gpus(g3={"lost": True}), boot_id="b1"))
    assert only(verdict, "GPU_LOST").action is Action.REBOOT_NODE
    back = verdict_of(clf, collect(T0 + 60, gpus=gpus(T0 + 60), boot_id="b1"))
    assert only(back, "GPU_LOST").action is Action.REBOOT_NODE  # stays until the reboot
    again = verdict_of(clf, collect(T0 + 600, gpus=gpus(T0 + 600, g3={"lost": True}), boot_id="b2"))
    escalated = only(again, "GPU_LOST")
    assert escalated.action is Action.REPLACE_NODE
    assert "came back after a reboot" in escalated.summary


def test_lost_gpu_cleared_by_a_reboot_that_fixed_it():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=gpus(g3={"lost": True}), boot_id="b1"))
    assert verdict_of(clf, collect(T0 + 600, gpus=gpus(T0 + 600), boot_id="b2")).findings == ()
    later = verdict_of(clf, collect(T0 + 900, gpus=gpus(T0 + 900, g3={"lost": True}), boot_id="b2"))
    assert only(later, "GPU_LOST").action is Action.REBOOT_NODE  # not escalated: the reboot had passed


def test_fewer_gpus_than_expected():
    verdict = verdict_of(classifier(), collect(T0, gpus=gpus(count=7), expected_gpus=8))
    finding = only(verdict, "GPU_MISSING")
    assert finding.action is Action.REBOOT_NODE and finding.subject == "node"
    assert finding.evidence == "7 GPUs read, expected 8"


def test_a_gpu_that_vanished_is_named():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=gpus()))
    present = [g for g in gpus(T0 + 30) if g.index != 5]
    finding = only(verdict_of(clf, collect(T0 + 30, gpus=present)), "GPU_MISSING")
    assert "not seen any more: GPU 5 (0000:a8:00.0)" in finding.evidence


def test_no_gpu_source_is_not_missing_gpus():
    down = SourceHealth(source="nvml", up=False, detail="libnvidia-ml.so.1 not found")
    assert verdict_of(classifier(), collect(T0, expected_gpus=8, health=[down])).findings == ()
    assert verdict_of(classifier(), collect(T0, expected_gpus=8)).findings == ()
    up = SourceHealth(source="nvml", up=True)
    assert only(verdict_of(classifier(), collect(T0, expected_gpus=8, health=[up])), "GPU_MISSING")


# -- NVLink, PCIe, throttling -----------------------------------------------------------------------

def test_nvlink_replay_growth_and_crc_rate():
    verdicts = run(classifier(), [{"nvlink_errors": {"replay": 0, "recovery": 0, "crc_flit": 0}},
                                  {"nvlink_errors": {"replay": 0, "recovery": 0, "crc_flit": 1000}},
                                  {"nvlink_errors": {"replay": 1, "recovery": 0, "crc_flit": 1000}}], step=60)
    assert verdicts[1].findings == ()  # 1000 CRC in 60 s is 17/s, under DCGM's 100/s
    finding = only(verdicts[2], "GPU_NVLINK_ERRORS")
    assert finding.action is Action.MONITOR
    assert "NVLink replay+recovery errors +1 in 60 s" in finding.evidence
    crc = run(classifier(), [{"nvlink_errors": {"crc_data": 0}}, {"nvlink_errors": {"crc_data": 9000}}], step=60)
    assert "NVLink CRC errors +9000" in only(crc[1], "GPU_NVLINK_ERRORS").evidence


def test_nvlink_unsupported_is_silent():
    assert all(v.findings == () for v in run(classifier(), [{"nvlink_errors": {}}] * 3))


def test_pcie_replay_rate_reset_and_quiet_period():
    clf = classifier(policy(counter_quiet_seconds=120))
    verdicts = run(clf, [{"pcie_replay": 100}, {"pcie_replay": 108}, {"pcie_replay": 130},
                         {"pcie_replay": 3}, {"pcie_replay": 3}, {"pcie_replay": 3}, {"pcie_replay": 3}], step=60)
    assert verdicts[1].findings == ()  # 8 a minute is DCGM's limit, not over it
    assert "PCIe replays +22 in 60 s (limit 8/min)" in only(verdicts[2], "GPU_PCIE_REPLAY").evidence
    assert [bool(v.findings) for v in verdicts[3:]] == [True, True, False, False]  # reset, then quiet 120 s


def test_thermal_throttle_must_be_sustained():
    clf = classifier(policy(throttle_sustain_seconds=300, condition_clear_evaluations=2))
    hot = {"throttle_reasons": ("hw_thermal_slowdown",), "temperature_c": 88.0}
    cool = {"throttle_reasons": ()}
    verdicts = run(clf, [hot] * 6 + [cool] * 2, step=60)
    assert [bool(v.findings) for v in verdicts] == [False] * 5 + [True, True, False]
    finding = only(verdicts[5], "GPU_THERMAL_THROTTLE")
    assert finding.action is Action.MONITOR and finding.evidence == "hw_thermal_slowdown active for 5 min; 88 C"


def test_flapping_throttle_is_never_sustained():
    hot, cool = {"throttle_reasons": ("hw_thermal_slowdown",)}, {"throttle_reasons": ()}
    assert all(v.findings == () for v in run(classifier(), [hot, cool] * 10, step=60))


def test_power_brake_and_disabled_rule():
    brake = {"throttle_reasons": ("HwPowerBrakeSlowdown",)}
    verdicts = run(classifier(policy(throttle_sustain_seconds=60)), [brake] * 2, step=60)
    assert only(verdicts[1], "GPU_POWER_THROTTLE").action is Action.MONITOR
    from healthagent.policy.settings import parse_policy

    off = classifier(parse_policy({"disabled_rules": ["GPU_POWER_THROTTLE"],
                                   "thresholds": {"throttle_sustain_seconds": 60}}))
    assert run(off, [brake] * 3, step=60)[-1].findings == ()


def test_lost_gpu_numbers_are_not_judged():
    verdict = run(classifier(), [{"lost": True, **ecc(7)}])[0]
    assert [f.code for f in verdict.findings] == ["GPU_LOST"]


def test_clock_stepping_back_is_neither_a_reset_nor_a_fault():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=[gpu(3, T0, **ecc(2))]))  # reported on first sight
    clf.clear(T0 + 1, "seen")
    back = verdict_of(clf, collect(T0 - 500, gpus=[gpu(3, T0 - 500, **ecc(2))]))
    assert back.findings == ()
    grew = verdict_of(clf, collect(T0 - 470, gpus=[gpu(3, T0 - 470, **ecc(3))]))
    assert only(grew, "GPU_ECC_DBE").evidence == "volatile DBE 2 -> 3 in 30 s"


def test_escalated_finding_keeps_its_words_while_the_fault_lasts():
    clf = classifier()
    verdict_of(clf, collect(T0, gpus=gpus(g3={"lost": True}), boot_id="b1"))
    for i in range(3):
        t = T0 + 600 + 30 * i
        verdict = verdict_of(clf, collect(t, gpus=gpus(t, g3={"lost": True}), boot_id="b2"))
    finding = only(verdict, "GPU_LOST")
    assert finding.action is Action.REPLACE_NODE and "came back after a reboot" in finding.summary
