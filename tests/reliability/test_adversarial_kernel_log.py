"""The kernel log as the worst node writes it: each case ends in a false node action, a lost or
doubled fault, or an agent that falls behind, unless the agent handles it.

The sources here are the real ones (``KmsgSource`` following a file under a fake host root, the
parser through ``iter_events``) feeding the real classifier; the storm test runs the real agent
(``healthagent run``) in a subprocess, so its memory and its log are its own.
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from healthagent.agent import xid_summary
from healthagent.common import ErrorTally
from healthagent.config import load_settings
from healthagent.model import INIT_FAILED, Action, Collection, GpuSample, SourceHealth, XidEvent
from healthagent.sources.kernel_log.repeats import REPEATS_KEPT
from healthagent.sources.kernel_log.source import KmsgSource
from healthagent.sources.kernel_log.offline import iter_events
from healthagent.wiring import build_classifier
from tests.reliability.helpers import NODE, events_by_reason, our_taints
from tests.support.floods import append_xid_storm, warm_flood_agent
from tests.support.live_agent import wait_until

pytestmark = [pytest.mark.reliability]

BOOT = "3f1c2f0e-9a8b-4c7d-8e9f-0a1b2c3d4e5f"
BTIME = 1_795_150_000
NOW = 1_795_176_000.0
GPUS = [f"0000:{bus}:00.0" for bus in ("18", "29", "3a", "4b", "5c", "6d", "7e", "8f")]


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host root with a boot id and a boot time: what the kernel-log source reads besides the log."""
    root = tmp_path / "host"
    (root / "proc" / "sys" / "kernel" / "random").mkdir(parents=True)
    (root / "proc" / "sys" / "kernel" / "random" / "boot_id").write_text(BOOT + "\n")
    (root / "proc" / "stat").write_text(f"cpu 1 2 3 4\nbtime {BTIME}\n")
    (root / "dev").mkdir()
    return root


def gpu_samples(pci_ids: list[str]) -> tuple[GpuSample, ...]:
    return tuple(GpuSample(index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", pci_bus_id=pci,
                           timestamp=NOW) for i, pci in enumerate(pci_ids))


def judge(events, gpus: tuple[GpuSample, ...] = (), nvml_up: bool | None = True, expected: int | None = 8):
    """The verdict the real classifier gives for ``events`` with NVML listing ``gpus``."""
    health = () if nvml_up is None else (SourceHealth(source="nvml", up=nvml_up),)
    classifier = build_classifier(load_settings(env={}, flags={}))
    return classifier.observe(Collection(timestamp=NOW, xids=tuple(events), gpus=gpus, health=health,
                                         expected_gpus=expected, boot_id=BOOT)).verdict


def follow(host: Path, path: Path) -> KmsgSource:
    return KmsgSource(str(host), kernel_log=str(path))


def xids(result) -> list[int]:
    return [e.xid for e in result.xids for _ in range(e.repeats)]


# -- whose GPU fell off the bus ------------------------------------------------------------------

def test_a_gpu_falling_off_the_bus_right_after_another_is_blamed_for_itself_never_the_other():
    text = ("[  100.000000] NVRM: GPU 0000:29:00.0: GPU has fallen off the bus.\n"
            "[  100.000100] NVRM: GPU 18:00.0: GPU has fallen off the bus.\n"
            "[  100.000200] NVRM: GPU zz:00.0: GPU has fallen off the bus.\n"
            "[  100.000300] NVRM: GPU 0000:29:00.0: GPU has fallen off the bus.\n"
            "[  100.000400] NVRM: fallen off the bus\n")
    tally = ErrorTally("kmsg")
    events = list(iter_events(text.splitlines(), NOW, host_root="/nonexistent", tally=tally))
    # its own PCI id (the driver's form without the domain), or none: never the line before's
    assert [(e.kind, e.pci_bus_id) for e in events] == [("fallen_off_bus", "0000:29:00.0"),
                                                        ("fallen_off_bus", "0000:18:00.0"),
                                                        ("fallen_off_bus", ""),
                                                        ("fallen_off_bus", "0000:29:00.0"),
                                                        ("fallen_off_bus", "")]
    assert tally.snapshot() == {"parse": 2}
    verdict = judge(events, gpu_samples(GPUS))
    assert sorted(f.subject for f in verdict.findings) == ["0000:18:00.0", "0000:29:00.0", "node"]


def test_the_probe_time_report_split_by_dmesg_still_names_its_gpu():
    text = ("[    5.000000] NVRM: The NVIDIA GPU 0000:53:00.0 (PCI ID: 10de:2330)\n"
            "[    5.000000] NVRM: installed in this system has fallen off the bus and is\n"
            "[    5.000000] NVRM: not responding to commands.\n")
    [event] = iter_events(text.splitlines(), NOW, host_root="/nonexistent")
    assert (event.kind, event.pci_bus_id) == ("fallen_off_bus", "0000:53:00.0")


# -- a GPU the driver could not initialise ----------------------------------------------------------

INIT_FAILED_LINES = ("[    9.100000] NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x62:0xffff:1863)\n"
                     "[    9.100100] NVRM: GPU 0000:18:00.0: rm_init_adapter failed, device minor number 0\n")


def test_rminitadapter_failed_is_one_report_naming_its_gpu(host):
    log = host / "kern.log"
    log.write_text(INIT_FAILED_LINES)
    [event] = follow(host, log).collect(NOW).xids
    assert (event.kind, event.pci_bus_id, event.xid) == (INIT_FAILED, "0000:18:00.0", 0)
    assert "RmInitAdapter failed" in event.message
    assert list(iter_events(INIT_FAILED_LINES.splitlines(), NOW, host_root="/nonexistent")) == []  # no XID


def test_a_gpu_that_failed_to_initialise_and_is_not_listed_takes_the_node_out(host):
    log = host / "kern.log"
    log.write_text(INIT_FAILED_LINES)
    events = follow(host, log).collect(NOW).xids
    verdict = judge(events, gpu_samples(GPUS[1:]))  # NVML lists 7 of 8: not 0000:18:00.0
    failed = [f for f in verdict.findings if f.code == "GPU_INIT_FAILED"]
    assert [(f.pci_bus_id, f.action) for f in failed] == [("0000:18:00.0", Action.REBOOT_NODE)]
    assert "lists 7 working GPUs, not this one (expected 8)" in failed[0].evidence
    assert {f.code for f in verdict.findings} == {"GPU_INIT_FAILED", "GPU_MISSING"}
    assert verdict.action is Action.REBOOT_NODE


def test_a_gpu_that_initialised_on_a_later_attempt_is_on_record_not_a_node_action(host):
    log = host / "kern.log"
    log.write_text(INIT_FAILED_LINES)
    verdict = judge(follow(host, log).collect(NOW).xids, gpu_samples(GPUS))  # NVML lists it working now
    [finding] = verdict.findings
    assert (finding.code, finding.action, finding.gpu_index) == ("GPU_INIT_FAILED", Action.MONITOR, 0)
    assert verdict.exit_code == 1


def test_a_failed_initialisation_nobody_could_check_stays_a_node_action():
    """No GPU source answered: the kernel log saw the GPU fail and nothing saw it recover."""
    [event] = XidLineParserEvents("NVRM: RmInitAdapter failed! (0x26:0xffff:1307)")
    assert (event.kind, event.pci_bus_id) == (INIT_FAILED, "")
    verdict = judge([event], (), nvml_up=False)
    [finding] = verdict.findings
    assert (finding.code, finding.subject, finding.action) == ("GPU_INIT_FAILED", "node", Action.REBOOT_NODE)


def XidLineParserEvents(line: str) -> list[XidEvent]:  # noqa: N802 - reads as the parser's output
    from healthagent.sources.kernel_log.parser import XidLineParser

    return list(XidLineParser(ErrorTally("kmsg"), boot_time=BTIME, now=NOW).scan([line]))


# -- malformed numbers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("line", [
    "NVRM: Xid (PCI:0000:18:00): 1234567890, pid=1, name=p, Graphics Exception",
    "NVRM: Xid (PCI:0000:18:00): 00000000094, pid=1, name=p, Contained",
    "NVRM: Xid (PCI:0000:18:00) 9999999999999, pid=1",
])
def test_an_xid_number_over_nine_digits_is_malformed_never_cut(line):
    tally = ErrorTally("kmsg")
    assert list(iter_events([line], NOW, host_root="/nonexistent", tally=tally)) == []
    assert tally.snapshot() == {"parse": 1}


# -- logs that change under the reader --------------------------------------------------------------

LINE_31 = "[  200.000000] NVRM: Xid (PCI:0000:18:00): 31, pid=7, name=p, MMU Fault\n"
LINE_62 = ("[  300.000000] NVRM: Xid (PCI:0000:29:00): 62, pid='<unknown>', name=<unknown>, "
           "Internal micro-controller halt\n")
LINE_94 = "[  400.000000] NVRM: Xid (PCI:0000:3a:00): 94, pid=9, name=p, Contained: SM (0x1)\n"
NOISE = "".join(f"[  {100 + n}.000000] eth0: link flap {n} {'x' * 60}\n" for n in range(40))


def test_a_log_replaced_by_its_copy_plus_a_line_counts_each_xid_once(host):
    """cp kern.log kern.log.new; echo ... >> kern.log.new; mv kern.log.new kern.log"""
    log = host / "kern.log"
    log.write_text(NOISE + LINE_31)
    source = follow(host, log)
    assert xids(source.collect(NOW)) == [31]
    copy = host / "kern.log.new"
    copy.write_bytes(log.read_bytes() + LINE_62.encode())
    os.rename(copy, log)
    assert xids(source.collect(NOW)) == [62]
    assert xids(source.collect(NOW)) == []
    # and after a restart on the saved cursor, the copy is still recognised
    log.write_bytes(log.read_bytes())  # same bytes, another write: nothing new
    restarted = KmsgSource(str(host), kernel_log=str(log), cursor=source.cursor)
    assert xids(restarted.collect(NOW)) == []


def test_a_log_replaced_by_a_copy_while_the_agent_was_down_resumes_after_what_it_read(host):
    log = host / "kern.log"
    log.write_text(NOISE + LINE_31)
    source = follow(host, log)
    assert xids(source.collect(NOW)) == [31]
    saved = source.cursor
    source.close()
    copy = host / "kern.log.new"
    copy.write_bytes(log.read_bytes() + LINE_62.encode())
    os.rename(copy, log)  # another inode, the same log: identified by its bytes, not its inode
    assert xids(KmsgSource(str(host), kernel_log=str(log), cursor=saved).collect(NOW)) == [62]


def test_truncated_then_at_once_rewritten_longer_the_new_xid_is_counted_once(host):
    log = host / "kern.log"
    log.write_text(NOISE[:600] + LINE_31)
    source = follow(host, log)
    assert xids(source.collect(NOW)) == [31]
    with open(log, "r+b") as fh:  # truncate, then at once a longer rewrite: the size never shrinks
        fh.truncate(0)
        fh.write((LINE_62 + NOISE).encode())
    result = source.collect(NOW)
    assert xids(result) == [62]
    assert result.health.errors == {"rotated": 1}
    assert xids(source.collect(NOW)) == []


def test_a_line_appended_to_the_renamed_old_log_after_the_switch_is_read(host):
    """logrotate renames the log and creates a new one; the writer keeps appending to the old file
    until it reopens (syslog before its HUP): those lines are drained from the old file."""
    log = host / "kern.log"
    log.write_text(NOISE + LINE_31)
    source = follow(host, log)
    assert xids(source.collect(NOW)) == [31]
    old = host / "kern.log.1"
    os.rename(log, old)
    log.write_text(LINE_62)
    assert xids(source.collect(NOW)) == [62]  # switched to the new file
    with open(old, "a") as fh:  # the writer has not reopened yet
        fh.write(LINE_94)
    assert xids(source.collect(NOW)) == [94]
    with open(log, "a") as fh:
        fh.write(LINE_31)
    assert xids(source.collect(NOW)) == [31]


# -- a storm of one XID, then the one that matters ----------------------------------------------------

def kmsg_host(host: Path) -> Path:
    log = host / "dev" / "kmsg"
    log.write_text("6,0,1000,-;Linux version 6.1\n")
    return log


def test_a_storm_of_one_xid_costs_the_policy_a_handful_of_events_and_the_94_after_it_comes_at_once(host):
    """250,000 XID 13s on one GPU, then one XID 94: every read hands the policy at most a few
    events per GPU and XID (the count in ``repeats``, exact), memory stays bounded, and the 94 is
    in the read that reaches its line."""
    log = kmsg_host(host)
    source = KmsgSource(str(host))  # the default budget: 50,000 records a read
    source.collect(NOW)
    flood = append_xid_storm(log, GPUS[0], xid=13, lines=250_000, then=94)
    total: dict[int, int] = {}
    reads = 0
    tracemalloc.start()
    try:
        while True:
            result = source.collect(NOW)
            reads += 1
            assert len(result.xids) <= 2 * (REPEATS_KEPT + 1)
            for event in result.xids:
                total[event.xid] = total.get(event.xid, 0) + event.repeats
            if not source.backlog:
                break
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == flood.by_xid == {13: 250_000, 94: 1}
    assert reads == 6  # 50,000 records a read; the 94 in the last, nothing between it and its read
    assert 94 in {e.xid for e in result.xids}
    assert peak < 12 * 1024 * 1024  # a 1 MiB chunk and its lines, never the 37 MB storm
    verdict = judge(result.xids, gpu_samples(GPUS))
    assert verdict.action is Action.REPLACE_NODE


def test_the_loop_logs_a_storm_as_counts_in_one_short_line():
    events = [XidEvent(xid=13, pci_bus_id=GPUS[0], message="", line="", timestamp=NOW, repeats=49_991)]
    events += [XidEvent(xid=13, pci_bus_id=GPUS[0], message="", line="", timestamp=NOW)] * 8
    events += [XidEvent(xid=n, pci_bus_id="", message="", line="", timestamp=NOW) for n in range(1000, 1100)]
    line = xid_summary(events + [XidEvent(xid=94, pci_bus_id="", message="", line="", timestamp=NOW)])
    assert line.startswith("13x49999,94,1000,") and line.endswith(",+90 more") and len(line) < 200


@pytest.mark.integration
def test_the_agent_under_a_million_xid_storm_acts_on_the_94_with_bounded_memory_and_log(demo, fake, tmp_path,
                                                                                         stub_cache):
    agent = warm_flood_agent(demo, fake.url, NODE, tmp_path, stub_cache)
    try:
        peak_before, rss_before = agent.hwm_kib(), agent.rss_kib()
        flood = append_xid_storm(demo.kernel_log, demo.gpu_pci_bus_ids[2], xid=13, lines=1_000_000, then=94)
        done = agent.wait_metric(
            lambda s: s.value("healthagent_findings", code="GPU_XID", action="replace_node") == 1
            and s.total("healthagent_xid_errors_total") >= flood.xids, timeout=300, what="the 94 acted on")
        counted = {int(s.labels["xid"]): s.value for s in done.samples if s.name == "healthagent_xid_errors_total"}
        assert counted == {13: 1_000_000, 94: 1}  # exact: none lost, none twice
        wait_until(lambda: our_taints(fake) == [("replace_node", "NoSchedule")], what="the taint")
        # one incident: its Event, and one more when the 94 escalated it (never one per XID)
        wait_until(lambda: events_by_reason(fake).get("GPU_XID", 0) >= 1, what="the Event")
        assert events_by_reason(fake)["GPU_XID"] <= 2
        assert agent.hwm_kib() - peak_before < 20 * 1024  # +20 MiB at most, for a 150 MB storm
        assert agent.rss_kib() - rss_before < 20 * 1024
        assert max(len(line) for line in agent.log().splitlines()) < 2000  # no "xids=13,13,13,..."
        assert agent.proc.poll() is None
    finally:
        agent.close()


def test_the_loop_reads_a_backlog_again_at_once_instead_of_waiting_its_poll_interval(demo, tmp_path):
    """Between the reads of a storm the loop does not sleep: the XID after it is judged as soon as
    the reads reach it, not one poll interval per 50,000 records later."""
    from healthagent.wiring import AgentRuntime

    runtime = AgentRuntime(load_settings(env={}, flags=dict(
        host_root=str(demo.root), kube="off", nvml="false", state_file=str(tmp_path / "state.json"),
        listen="127.0.0.1:0", kmsg_max_records_per_cycle=1000)))
    agent = runtime.agent
    agent.cycle()
    assert agent.next_wait() > 0  # caught up: wait for the poll interval
    append_xid_storm(demo.kernel_log, demo.gpu_pci_bus_ids[0], xid=13, lines=2500, then=94)
    waits = []
    for _ in range(3):
        agent.cycle()
        waits.append(agent.next_wait())
    assert waits[:2] == [0.0, 0.0] and waits[2] > 0
    assert agent.verdict.action is Action.REPLACE_NODE
    runtime.server.stop()
