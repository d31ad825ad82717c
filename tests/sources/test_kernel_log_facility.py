"""Only the kernel's records are reports: what user space writes into the kernel log is not.

A record's priority is facility * 8 + level. The kernel logs with facility 0; anything a process
writes to /dev/kmsg gets another (LOG_USER, 1, unless it names one), so ``12,...;`` (/dev/kmsg),
``<12>`` (READ_ALL, dmesg -r) or ``user  :warn  :`` (dmesg -x) quoting an XID 94 is someone's
text, never the driver's report: ignored, counted ``not_kernel_facility``, never judged. Read
through the real readers: a followed file of /dev/kmsg records under a tmp host root, and the ring
through ``syslog(2)`` over the fake kernel of ``tests/support/klog_kernel.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from healthagent.common import ErrorTally
from healthagent.config import load_settings
from healthagent.model import Action, Collection
from healthagent.sources.kernel_log.parser import XidLineParser
from healthagent.sources.kernel_log.repeats import REPEATS_KEPT, RepeatFolder
from healthagent.sources.kernel_log.source import KmsgSource
from healthagent.wiring import build_classifier
from tests.support.klog_kernel import FakeKernel, line, source_for
from tests.support.kmsg_host import BTIME, NOW, make_host, record, xid_text

XID_94 = xid_text(94)


def parsed(text: str):
    tally = ErrorTally("kmsg")
    event = XidLineParser(tally, boot_time=BTIME, now=NOW).parse(text)
    return event, tally.snapshot()


@pytest.mark.parametrize("text, from_kernel", [
    (f"12,100,5000,-;{XID_94}", False),               # /dev/kmsg: LOG_USER | LOG_WARNING
    (f"14,100,5000,-;{XID_94}", False),               # LOG_USER | LOG_INFO, what `echo > /dev/kmsg` gets
    (f"30,100,5000,-;{XID_94}", False),               # LOG_DAEMON
    (f"4,100,5000,-;{XID_94}", True),                 # the kernel's own warning
    (f"0,100,5000,-;{XID_94}", True),
    (f"<12>[ 5.000000] {XID_94}", False),             # READ_ALL / dmesg -r
    (f"<13>Nov 20 10:11:12 host {XID_94}", False),    # a raw syslog line
    (f"<4>[ 5.000000] {XID_94}", True),
    (f"user  :warn  : [ 5.000000] {XID_94}", False),  # dmesg -x
    (f"local3:err   : [ 5.000000] {XID_94}", False),
    (f"kern  :warn  : [ 5.000000] {XID_94}", True),
    (f"[ 5.000000] {XID_94}", True),                  # no priority named: dmesg, kern.log as before
    (f"Nov 20 10:11:12 host kernel: {XID_94}", True),
])
def test_only_facility_0_is_the_driver(text, from_kernel):
    event, errors = parsed(text)
    if from_kernel:
        assert event is not None and event.xid == 94 and errors == {}
    else:
        assert event is None and errors == {"not_kernel_facility": 1}


def test_other_facilities_are_counted_only_when_they_look_like_a_report():
    """systemd and friends write to /dev/kmsg all day: only a record that quotes a report counts."""
    tally = ErrorTally("kmsg")
    parser = XidLineParser(tally, boot_time=BTIME, now=NOW)
    lines = ["30,1,10,-;systemd[1]: Started Journal Service.", f"12,2,20,-;{XID_94}",
             "14,3,30,-;fallen off the bus: NVRM: GPU 0000:a8:00.0: GPU has fallen off the bus.",
             "12,4,40,-;NVRM: GPU 0000:a8:00.0: RmInitAdapter failed! (0x62:0xffff:1863)"]
    assert list(parser.scan(lines)) == []
    assert tally.snapshot() == {"not_kernel_facility": 3}


def file_host(tmp_path: Path, text: str) -> Path:
    return make_host(tmp_path / "host", kmsg_text=text)


def test_a_user_record_in_the_followed_kernel_log_is_no_xid(tmp_path):
    host = file_host(tmp_path, record(1, XID_94, priority=12) + record(2, "eth0: link up", priority=6))
    source = KmsgSource(str(host))
    first = source.collect(NOW)
    assert first.health.up and first.xids == ()
    assert first.health.errors == {"not_kernel_facility": 1}
    with open(host / "dev" / "kmsg", "a") as fh:
        fh.write(record(3, XID_94, priority=4))  # the driver's own report is still one
    second = source.collect(NOW)
    assert [(e.xid, e.seq) for e in second.xids] == [(94, 3)]
    assert second.health.errors == {"not_kernel_facility": 1}


def test_a_user_line_in_the_ring_read_through_klogctl_is_no_xid(tmp_path):
    host = make_host(tmp_path / "host", kmsg_text=None)  # no /dev/kmsg: the ring through syslog(2)
    usec = 5_000_000
    kernel = FakeKernel(line(usec, XID_94, priority=12) + line(usec + 1, XID_94, priority=4))
    result = source_for(host, kernel).collect(NOW)
    assert result.health.up, result.health.detail
    assert [e.xid for e in result.xids] == [94]
    assert result.health.errors == {"not_kernel_facility": 1}


def test_a_user_flood_of_the_drivers_text_never_adds_to_its_count():
    """After a run of kernel XID 94s long enough to fold, user records with the very same text are
    still ignored one by one, never counted as repeats of the driver's report."""
    tally = ErrorTally("kmsg")
    parser = XidLineParser(tally, boot_time=BTIME, now=NOW, repeats=RepeatFolder())
    kernel = [record(n, XID_94, priority=4).rstrip("\n") for n in range(1, REPEATS_KEPT + 3)]
    user = [record(n, XID_94, priority=12).rstrip("\n") for n in range(100, 150)]
    events = list(parser.scan(kernel + user)) + parser.take_repeats()
    assert sum(e.repeats for e in events) == len(kernel)
    assert tally.snapshot() == {"not_kernel_facility": len(user)}


def test_a_user_written_xid_94_takes_no_node_action(tmp_path):
    host = file_host(tmp_path, record(1, XID_94, priority=12))
    result = KmsgSource(str(host)).collect(NOW)
    judge = build_classifier(load_settings(env={}, flags={}))
    verdict = judge.observe(Collection(timestamp=NOW, xids=result.xids, health=(result.health,))).verdict
    assert verdict.action is Action.NONE and verdict.findings == ()
