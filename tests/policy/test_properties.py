"""Property tests: whatever text, events, counters or saved state reach the policy, nothing escapes,
nothing internal fails, and the state stays JSON."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthagent.model import (Action, Collection, EccCounts, EfaSample, GpuSample, RemapState,
                               RetiredPages, SourceHealth, XidEvent)
from healthagent.policy.catalog import load_catalog
from healthagent.policy.classify import classify_event
from healthagent.policy.settings import Policy
from tests.support.policy import verdict_of, P5_PCI, T0, classifier

PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

counts = st.one_of(st.none(), st.integers(min_value=-5, max_value=2**64))
times = st.one_of(st.floats(min_value=T0 - 1e6, max_value=T0 + 1e7, allow_nan=False),
                  st.just(0.0), st.just(float("nan")), st.just(float("inf")), st.just(-1.0))
pci_ids = st.one_of(st.sampled_from(P5_PCI), st.just(""), st.text(max_size=20))

KMSG_LINES = [
    "NVRM: Xid (PCI:0000:86:00): 94, pid=1234, name=python, Contained: CE User Channel (0x9)",
    "NVRM: Xid (PCI:0000:86:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
    "NVRM: Xid (PCI:0000:53:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)",
    "NVRM: GPU 0000:a8:00.0: GPU has fallen off the bus.",
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
    "6,1234,5678901,-;NVRM: Xid (PCI:0000:ca:00): 79, GPU has fallen off the bus.",
    "[Wed May  1 09:51:12 2024] NVRM: Xid (PCI:0000:64:00): 48, pid=99, DBE (0x1)",
]


@st.composite
def kernel_log(draw) -> str:
    lines = draw(st.lists(st.one_of(st.sampled_from(KMSG_LINES), st.text(max_size=200),
                                    st.builds(lambda a, b: a + b, st.sampled_from(KMSG_LINES), st.text(max_size=40))),
                          max_size=30))
    return "\n".join(lines)


xid_events = st.builds(
    XidEvent, xid=st.integers(min_value=-10, max_value=2**40), pci_bus_id=pci_ids,
    message=st.text(max_size=120), line=st.text(max_size=120), timestamp=times,
    source=st.sampled_from(["kmsg", "nvml", "", "dcgm"]),
    kind=st.sampled_from(["xid", "sxid", "fallen_off_bus", "weird"]),
    gpu_index=st.one_of(st.none(), st.integers(-2, 20)), uuid=st.text(max_size=10),
)


# Strategies built once: a composite that builds them on every draw spends most of its time
# validating them again.
maybe_bool = st.one_of(st.none(), st.booleans())
maybe_float = st.one_of(st.none(), st.floats(allow_nan=True))
throttle_lists = st.lists(st.sampled_from(["hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_power_cap", "", "x"]),
                          max_size=3).map(tuple)
nvlink_counters = st.dictionaries(st.sampled_from(["replay", "recovery", "crc_flit", "crc_data", "x"]),
                                  st.integers(-3, 2**40), max_size=4)
ecc_counts = st.builds(EccCounts, counts, counts, counts, counts)
remap_states = st.builds(RemapState, counts, counts, maybe_bool, maybe_bool)
retired_pages = st.builds(RetiredPages, counts, counts, maybe_bool)


@st.composite
def gpu_sample(draw, t) -> GpuSample:
    index = draw(st.integers(0, 7))
    return GpuSample(
        index=index, uuid=draw(st.sampled_from([f"GPU-{index}", f"GPU-{index}-new", ""])),
        pci_bus_id=draw(st.one_of(st.just(P5_PCI[index]), pci_ids)), timestamp=draw(st.one_of(st.just(t), times)),
        lost=draw(st.booleans()), ecc=draw(ecc_counts), remap=draw(remap_states),
        retired_pages=draw(retired_pages), throttle_reasons=draw(throttle_lists),
        nvlink_errors=draw(nvlink_counters), pcie_replay=draw(counts), temperature_c=draw(maybe_float),
        power_w=draw(maybe_float),
    )


@st.composite
def efa_sample(draw, t) -> EfaSample:
    names = ["rx_drops", "cmds_err", "no_completion_cmds", "unresponsive_remote_events",
             "impaired_remote_conn_events", "retrans_timeout_events", "rdma_read_wr_err", "rdma_write_wr_err"]
    return EfaSample(device=draw(st.sampled_from(["rdmap79s0", "rdmap80s0", "efa_0", ""])), port=1,
                     counters=draw(st.dictionaries(st.sampled_from(names), st.integers(-3, 2**40), max_size=8)),
                     timestamp=draw(st.one_of(st.just(t), times)))


@st.composite
def collections(draw) -> list[Collection]:
    out, t = [], T0
    for _ in range(draw(st.integers(1, 8))):
        t += draw(st.one_of(st.floats(min_value=-100, max_value=5000, allow_nan=False), st.just(0.0)))
        out.append(Collection(
            timestamp=draw(st.one_of(st.just(t), times)),
            gpus=tuple(draw(st.lists(gpu_sample(t), max_size=9))),
            xids=tuple(draw(st.lists(xid_events, max_size=6))),
            efa=tuple(draw(st.lists(efa_sample(t), max_size=4))),
            health=tuple(draw(st.lists(st.builds(SourceHealth, source=st.sampled_from(["nvml", "efa", "dcgm"]),
                                                 up=st.booleans()), max_size=3))),
            boot_id=draw(st.sampled_from(["b1", "b1", "b2", ""])),
            expected_gpus=draw(st.one_of(st.none(), st.integers(0, 9))),
            expected_efa_devices=draw(st.one_of(st.none(), st.integers(0, 4))),
        ))
    return out


def check_sane(clf, verdict) -> None:
    assert clf.internal_errors == 0
    assert isinstance(verdict.action, Action)
    assert all(f.summary and f.evidence and f.next_steps for f in verdict.findings)
    json.dumps(clf.export_state(), allow_nan=False)


@PROPERTY
@given(kernel_log())
def test_random_kernel_log_text_through_the_kmsg_parser(text):
    from healthagent.sources.kernel_log.offline import iter_events

    catalog = load_catalog(Policy())
    events = list(iter_events(text.splitlines(), T0))
    for event in events:
        row = classify_event(event, catalog)
        assert row["action"] in {a.value for a in Action}
        json.dumps(row)
    clf = classifier()
    check_sane(clf, verdict_of(clf, Collection(timestamp=T0, xids=tuple(events))))


@PROPERTY
@given(st.lists(xid_events, max_size=40))
def test_random_xid_events(events):
    catalog = load_catalog(Policy())
    for event in events:
        classify_event(event, catalog)
    clf = classifier()
    check_sane(clf, verdict_of(clf, Collection(timestamp=T0 + 100, xids=tuple(events))))


@settings(PROPERTY, max_examples=50)  # each example is up to 8 whole-node collections
@given(collections())
def test_random_counter_sequences(sequence):
    clf = classifier()
    for collection in sequence:
        verdict = verdict_of(clf, collection)
        check_sane(clf, verdict)
    restored = classifier()
    restored.restore_state(json.loads(json.dumps(clf.export_state())))
    assert restored.restore_errors == 0
    assert restored.export_state() == clf.export_state()
    clf.clear(T0, "property test")
    check_sane(clf, verdict_of(clf, sequence[-1]))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=30)


@PROPERTY
@given(st.one_of(json_values, st.fixed_dictionaries({"version": st.just(1)}, optional={
    "book": json_values, "incidents": json_values, "gpus": json_values, "efa": json_values,
    "known_gpus": json_values, "known_efa": json_values, "boot_id": json_values, "now": json_values})))
def test_random_saved_state_never_raises(garbage):
    clf = classifier()
    clf.restore_state(garbage)
    check_sane(clf, verdict_of(clf, Collection(timestamp=T0, xids=(XidEvent(94, P5_PCI[3], "m", "l", T0),))))
