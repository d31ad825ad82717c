"""The kernel-log source without /dev/kmsg: the ring buffer through syslog(2) (klogctl).

The source is driven through its injectable ``klogctl``: ``FakeKernel`` (``tests/support/klog_kernel.py``) stands behind glibc's
calling convention and hands back buffers in READ_ALL's real format (the fixtures
``tests/fixtures/kmsg/klogctl-*.txt``). Where the kernel itself can refuse (a mode-000 file opened
by an unprivileged user, this machine's real ``klogctl``), the tests use the kernel.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.klogctl import SYSLOG_ACTION_READ_ALL
from healthagent.sources.kernel_log.offline import iter_events
from healthagent.sources.kernel_log.parser import XidLineParser
from healthagent.sources.kernel_log.ring import RingPosition, line_usec
from tests.support.klog_kernel import host  # noqa: F401 (a fixture)
from tests.support.klog_kernel import (
    FIXTURE_LINES,
    FIXTURES,
    NO_TIME_FIXTURE,
    ONLY_READ_ACTIONS,
    READ_ALL_FIXTURE,
    FakeKernel,
    drain,
    expected_keys,
    keys,
    line,
    noise,
    restart,
    source_for,
    xid_line,
)
from tests.support.kmsg_host import BOOT_A, BOOT_B, BTIME, NOW, DeviceFollower, make_host, record, xid_text


# -- reading a ring ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, errors", [(READ_ALL_FIXTURE, {}), (NO_TIME_FIXTURE, {"untimestamped": 1})])
def test_a_real_format_ring_yields_the_fixture_events_through_the_one_parser(host, name, errors):
    text = (FIXTURES / name).read_text()
    kernel = FakeKernel(text)
    source = source_for(host, kernel)
    result = source.collect(NOW)
    assert result.health.up
    assert result.health.detail == (f"klogctl (syslog(2) READ_ALL), because {host}/dev/kmsg not found")
    assert keys(result.xids) == expected_keys(name)
    # The same text through `healthagent classify`'s reader gives the same events: one parser.
    assert keys(result.xids) == keys(iter_events(text.splitlines(keepends=True), NOW, host_root=str(host)))
    assert result.health.errors == errors
    assert set(kernel.actions) == ONLY_READ_ACTIONS  # never READ (2) or a clear (4, 5)
    assert source.collect(NOW).xids == ()


def digest(text: str) -> str:
    """The cursor's digest of a line (without its newline)."""
    return hashlib.blake2b(text.rstrip("\n").encode(), digest_size=8).hexdigest()


def test_the_cursor_is_the_last_lines_stamp_how_many_lines_carried_it_and_its_digest(host):
    kernel = FakeKernel((FIXTURES / READ_ALL_FIXTURE).read_text())
    source = source_for(host, kernel)
    source.collect(NOW)
    assert source.cursor == KmsgCursor(boot_id=BOOT_A, usec=7_100_000_000, same=1,
                                       tail=(digest(FIXTURE_LINES[-1]),))
    kernel.log(xid_line(7_100_000_000, 31) + xid_line(7_100_000_000, 43))
    assert [e.xid for e in source.collect(NOW).xids] == [31, 43]
    assert source.cursor == KmsgCursor(boot_id=BOOT_A, usec=7_100_000_000, same=3,
                                       tail=(digest(xid_line(7_100_000_000, 43)),))


def test_growth_between_polls_returns_each_new_line_once(host):
    kernel = FakeKernel((FIXTURES / READ_ALL_FIXTURE).read_text())
    source = source_for(host, kernel)
    assert len(source.collect(NOW).xids) == 11
    for step, xid in enumerate((13, 31, 94, 94, 79)):
        usec = 8_000_000_000 + step * 1000
        kernel.log(noise(usec) + xid_line(usec + 1, xid, pid=step))
        assert [(e.xid, e.pid) for e in source.collect(NOW).xids] == [(xid, step)]
        assert source.collect(NOW).xids == ()
    assert source.cursor.usec == 8_000_004_001


def test_polls_decode_and_parse_only_what_is_new(host):
    """Old lines are never decoded or parsed again: their errors are counted once, not per poll."""
    kernel = FakeKernel(line(1_000, "bad bytes \xff", 6).encode("latin-1")
                        + line(2_000, "NVRM: Xid (PCI:0000:a8:00): x").encode())
    source = source_for(host, kernel)
    assert source.collect(NOW).health.errors == {"decode": 1, "parse": 1}
    for step in range(50):
        kernel.log(noise(10_000 + step))
        assert source.collect(NOW).xids == ()
    kernel.log(xid_line(20_000, 48))
    result = source.collect(NOW)
    assert [e.xid for e in result.xids] == [48]
    assert result.health.errors == {"decode": 1, "parse": 1}


@pytest.mark.parametrize("budget", [1, 2, 3, 7, 50])
def test_work_per_collect_is_bounded_and_nothing_is_lost(host, budget):
    kernel = FakeKernel("".join(xid_line(1_000 * i, 13, pid=i) for i in range(40)))
    source = source_for(host, kernel, max_records_per_cycle=budget)
    pids: list[int] = []
    reports = 0
    for _ in range(100):
        result = source.collect(NOW)
        assert len(result.xids) <= budget
        pids += [e.pid for e in result.xids]
        reports += sum(e.repeats for e in result.xids)
        backlogged = "; backlog: " in result.health.detail
        assert backlogged == (reports < 40) == source.backlog
        if not backlogged:
            break
    # Within one read a run of XID 13 beyond its first eight is one event: the last, with the count.
    assert reports == 40 and pids == sorted(pids) and pids[-1] == 39
    assert pids[:8] == list(range(8))


def test_the_ring_is_read_at_most_once_per_interval_of_the_loops_clock_unless_backlogged(host):
    kernel = FakeKernel("".join(xid_line(1_000 * i, 13, pid=i) for i in range(5)))
    source = source_for(host, kernel, klog_poll_seconds=1.0, max_records_per_cycle=2)

    def reads() -> int:
        return kernel.actions.count(SYSLOG_ACTION_READ_ALL)

    pids = [e.pid for e in source.collect(NOW).xids]
    pids += [e.pid for e in source.collect(NOW + 0.1).xids]  # backlogged: read at once
    pids += [e.pid for e in source.collect(NOW + 0.2).xids]
    assert pids == [0, 1, 2, 3, 4] and reads() == 3
    kernel.log(xid_line(9_000, 94, pid=9))
    assert source.collect(NOW + 0.3).xids == () and source.collect(NOW + 1.1).xids == ()
    assert reads() == 3  # not yet an interval after the read at NOW + 0.2
    assert [e.pid for e in source.collect(NOW + 1.25).xids] == [9] and reads() == 4
    kernel.log(xid_line(9_500, 31, pid=10))
    assert [e.pid for e in source.collect(NOW - 60).xids] == [10]  # the clock went back: read


# -- wraps, restarts, reboots ------------------------------------------------------------------

def test_a_ring_that_wrapped_past_the_cursor_counts_overrun_and_finds_the_new_xids(host):
    kernel = FakeKernel("".join(noise(i) for i in range(20)), capacity=4096)
    source = source_for(host, kernel)
    assert source.collect(NOW).xids == ()
    # More than the ring holds is logged before the next poll: the cursor's line is overwritten.
    flood = [xid_line(1_000 + i, 94 if i % 10 == 0 else 13, pid=i) for i in range(120)]
    kernel.log("".join(flood))
    surviving = [int(re.search(rb"pid=(\d+)", raw).group(1)) for raw in kernel.lines]
    assert 0 < len(surviving) < 120 and surviving[-1] == 119
    result = source.collect(NOW)
    # Each surviving line once: XID 13 beyond its first eight folded into the last, with the count.
    assert sum(e.repeats for e in result.xids) == len(surviving)
    assert {e.pid for e in result.xids} <= set(surviving) and result.xids[-1].pid == surviving[-1]
    assert [e.pid for e in result.xids if e.xid == 94] == [p for p in surviving if p % 10 == 0]
    assert result.health.errors == {"overrun": 1}
    kernel.log(xid_line(5_000, 64, pid=500))
    after = source.collect(NOW)
    assert [e.pid for e in after.xids] == [500] and after.health.errors == {"overrun": 1}


def test_a_ring_cleared_by_someone_else_loses_nothing_that_follows(host):
    kernel = FakeKernel(xid_line(1_000, 13, pid=1))
    source = source_for(host, kernel)
    assert [e.pid for e in source.collect(NOW).xids] == [1]
    kernel.clear()
    assert source.collect(NOW).xids == ()
    kernel.log(xid_line(2_000, 94, pid=2))
    result = source.collect(NOW)
    assert [e.pid for e in result.xids] == [2]
    assert result.health.errors == {"overrun": 1}  # what was logged and cleared between polls is unknown



@pytest.mark.parametrize("cut", range(1, len(FIXTURE_LINES) + 1))
def test_a_restart_after_any_line_neither_repeats_nor_skips(host, cut):
    """Every cut point of the fixture, same-stamp groups (three lines at 1843.308145, two XIDs at
    5123.456789 and at 7000.000000) included; lines logged while the agent was down follow."""
    kernel = FakeKernel("".join(FIXTURE_LINES))
    first = source_for(host, kernel, max_records_per_cycle=cut)
    before = list(first.collect(NOW).xids)
    assert first.cursor.usec == line_usec(FIXTURE_LINES[cut - 1].encode(), 0)
    kernel.log(xid_line(7_200_000_000, 48) + xid_line(7_200_000_000, 31))
    second = restart(first, host, kernel)
    after = drain(second)
    assert keys(before + after) == expected_keys(READ_ALL_FIXTURE) + [
        ("xid", 48, "0000:a8:00.0", 4242, round(BTIME + 7200, 6)),
        ("xid", 31, "0000:a8:00.0", 4242, round(BTIME + 7200, 6))]
    assert second.tally.snapshot() == {}  # the ring held the cursor: nothing was lost


def test_a_restart_whose_cursor_was_overwritten_counts_overrun_and_reads_the_ring(host):
    kernel = FakeKernel("".join(xid_line(1_000 + i, 13, pid=i) for i in range(5)))
    first = source_for(host, kernel)
    first.collect(NOW)
    kernel.clear()  # as if the ring had wrapped while the agent was down
    kernel.log("".join(xid_line(9_000 + i, 94, pid=100 + i) for i in range(3)))
    second = restart(first, host, kernel)
    result = second.collect(NOW)
    assert [e.pid for e in result.xids] == [100, 101, 102]
    assert result.health.errors == {"overrun": 1}


def test_a_new_boot_reads_the_whole_ring(host):
    """Another boot's cursor means nothing: XIDs from driver initialisation are reported."""
    kernel = FakeKernel((FIXTURES / READ_ALL_FIXTURE).read_text())
    stale = KmsgCursor(boot_id=BOOT_B, usec=10**12, same=5)
    source = source_for(host, kernel, cursor=stale)
    assert keys(source.collect(NOW).xids) == expected_keys(READ_ALL_FIXTURE)
    assert source.cursor.boot_id == BOOT_A and source.tally.snapshot() == {}


def test_a_cursor_of_the_same_boot_past_every_line_reads_nothing(host):
    kernel = FakeKernel((FIXTURES / READ_ALL_FIXTURE).read_text())
    source = source_for(host, kernel, cursor=KmsgCursor(boot_id=BOOT_A, usec=10**12, same=1))
    assert source.collect(NOW).xids == ()
    kernel.log(xid_line(10**12 + 1, 79))
    assert [e.xid for e in source.collect(NOW).xids] == [79]


# -- printk.time off ---------------------------------------------------------------------------

def test_without_timestamps_lines_are_told_apart_by_the_content_of_the_tail(host):
    kernel = FakeKernel((FIXTURES / NO_TIME_FIXTURE).read_text())
    source = source_for(host, kernel)
    assert [e.xid for e in source.collect(NOW).xids] == [94, 22013, 48]
    repeat = "<4>NVRM: Xid (PCI:0000:53:00): 48, pid='<unknown>', name=<unknown>, DBE\n"
    kernel.log(repeat)
    kernel.log(repeat)  # the same text twice: two reports, both new
    assert [e.xid for e in source.collect(NOW).xids] == [48, 48]
    assert source.collect(NOW).xids == ()
    cursor = source.cursor
    assert cursor.usec is None and len(cursor.tail) == 8 and cursor.boot_id == BOOT_A
    kernel.log(repeat)  # logged while the agent restarts
    second = restart(source, host, kernel)
    result = second.collect(NOW)
    assert [e.xid for e in result.xids] == [48]
    assert result.health.errors == {"untimestamped": 1}
    assert result.xids[0].timestamp == NOW  # no stamp in the line: stamped when read


def test_without_timestamps_a_wrap_past_the_tail_counts_overrun(host):
    kernel = FakeKernel("".join(f"<6>noise {i}\n" for i in range(10)), capacity=400)
    source = source_for(host, kernel)
    source.collect(NOW)
    kernel.log("".join(f"<4>NVRM: Xid (PCI:0000:a8:00): 13, pid={i}, name=p, x\n" for i in range(30)))
    result = source.collect(NOW)
    assert [e.pid for e in result.xids] == [int(re.search(rb"pid=(\d+)", raw).group(1)) for raw in kernel.lines]
    assert result.health.errors == {"untimestamped": 1, "overrun": 1}


# -- switching between /dev/kmsg and klogctl across restarts -----------------------------------

def test_records_handed_over_from_dev_kmsg_are_not_repeated_through_klogctl(host):
    """The agent ran privileged (device reader), restarts without privilege (klogctl reader)."""
    ours, kernel_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    tally = ErrorTally("kmsg")
    device = DeviceFollower("/dev/kmsg", os.dup(ours.fileno()), XidLineParser(tally, boot_time=BTIME, now=NOW),
                            tally, resume_after=None)
    texts = {seq: xid_text(13 if seq % 2 else 94) for seq in range(1, 6)}
    try:
        for seq in range(1, 4):  # records 1..3 reach the device reader (two share a stamp)
            kernel_side.send(record(seq, texts[seq], usec=5_000 if seq > 1 else 1_000, priority=4).encode())
        handed: list = []
        device.read(50, handed)
        cursor = device.cursor(BOOT_A)
    finally:
        device.close()
        ours.close()
        kernel_side.close()
    assert (cursor.usec, cursor.same, [e.seq for e in handed]) == (5_000, 2, [1, 2, 3])
    # The same ring, as READ_ALL prints it, plus two records logged after the restart.
    ring = FakeKernel(line(1_000, texts[1]) + line(5_000, texts[2]) + line(5_000, texts[3])
                      + line(5_000, texts[4]) + line(9_000, texts[5]))
    source = source_for(host, ring, cursor=KmsgCursor.from_dict(json.loads(json.dumps(cursor.to_dict()))))
    assert [e.xid for e in source.collect(NOW).xids] == [94, 13]  # records 4 and 5 only


@pytest.mark.parametrize("same, new", [(2, [4, 5, 6]), (3, [5, 6])])
def test_records_handed_over_through_klogctl_are_not_repeated_by_the_device_reader(same, new):
    """The other way: klogctl's cursor (no sequence number) resumes a /dev/kmsg reader. Record 5 is
    stamped by another CPU's clock a microsecond before the cursor but logged after it: new."""
    ours, kernel_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    tally = ErrorTally("kmsg")
    device = DeviceFollower("/dev/kmsg", os.dup(ours.fileno()), XidLineParser(tally, boot_time=BTIME, now=NOW),
                            tally, resume_after=None, saved=RingPosition(usec=5_000, same=same))
    try:
        stamps = {1: 1_000, 2: 5_000, 3: 5_000, 4: 5_000, 5: 4_999, 6: 9_000}
        for seq, usec in stamps.items():
            kernel_side.send(record(seq, xid_text(94), usec=usec, priority=4).encode())
        events: list = []
        device.read(50, events)
    finally:
        device.close()
        ours.close()
        kernel_side.close()
    assert [e.seq for e in events] == new
    assert device.cursor(BOOT_A) == KmsgCursor(boot_id=BOOT_A, seq=6, path="/dev/kmsg", usec=9_000, same=1)


# -- never a repeat, never a skip --------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["log", "collect", "restart", "clear"]),
                                st.integers(min_value=1, max_value=30),
                                st.integers(min_value=0, max_value=2)), max_size=30),
       budget=st.integers(min_value=1, max_value=10),
       timestamps=st.booleans(),
       capacity=st.integers(min_value=300, max_value=1 << 16))
def test_no_line_is_handed_over_twice_none_the_ring_still_holds_is_skipped_and_losses_are_counted(
        steps, budget, timestamps, capacity):
    """Lines are logged (stamps that repeat or advance, or none), collected with a small budget; the
    agent restarts, someone clears the ring, small rings wrap. Whatever happens: no line comes out
    twice or out of order, every line still in the ring comes out, and a line that never came out
    although it was logged after a read is counted as ``overrun``."""
    with tempfile.TemporaryDirectory() as tmp:
        host = make_host(Path(tmp), kmsg_text=None)
        kernel = FakeKernel(capacity=capacity)
        source = source_for(host, kernel, max_records_per_cycle=budget)
        logged = 0
        usec = 1_000
        seen: list[int] = []
        read_once_at: int | None = None  # lines logged from here on were logged after a read
        overruns = 0
        for action, count, advance in steps:
            if action == "log":
                for _ in range(count):
                    usec += advance
                    # three XIDs in turn: no run of one is long enough within a read to be folded
                    text = f"NVRM: Xid (PCI:0000:a8:00): {13 + logged % 3}, pid={logged}, name=p, x"
                    kernel.log(line(usec, text) if timestamps else f"<4>{text}\n")
                    logged += 1
            elif action == "collect":
                seen += [e.pid for e in source.collect(NOW).xids]
                if read_once_at is None and seen:
                    read_once_at = logged
            elif action == "clear":
                kernel.clear()
            else:
                overruns += source.tally.snapshot().get("overrun", 0)
                source = restart(source, host, kernel, max_records_per_cycle=budget)
        seen += [e.pid for e in drain(source, bound=500)]
        overruns += source.tally.snapshot().get("overrun", 0)
        assert seen == sorted(set(seen))
        assert {int(re.search(rb"pid=(\d+)", raw).group(1)) for raw in kernel.lines} <= set(seen)
        lost = [pid for pid in range(read_once_at or logged, logged) if pid not in seen]
        cleared = any(action == "clear" for action, _, _ in steps)
        assert overruns > 0 or not lost or cleared, lost
        if capacity == 1 << 16 and not cleared:
            assert seen == list(range(logged))  # a ring that never wraps: every line exactly once
