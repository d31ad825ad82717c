"""Following the kernel log through the machine's real ``/dev/kmsg`` (where this machine lets a test
open it) and a host root whose ``dev/kmsg`` is a character device: resuming within a boot,
reboots, record boundaries, records lost to the ring, and a reader without the privilege.
No reader is mocked.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import pytest

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.parser import XidLineParser
from healthagent.sources.kernel_log.source import KmsgSource
from tests.support.kmsg_host import (
    BOOT_A,
    BOOT_B,
    BTIME,
    NOW,
    DeviceFollower,
    make_host,
    record,
    restart,
    run_unprivileged,
    xid_text,
)


# -- the real /dev/kmsg ----------------------------------------------------------------------------

def _open_real_kmsg_or_skip() -> None:
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        pytest.skip(f"cannot open the real /dev/kmsg here ({exc.strerror}; a container without "
                    f"CAP_SYSLOG gets EPERM)")


def test_the_real_dev_kmsg_through_the_source():
    _open_real_kmsg_or_skip()
    real_boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    first = KmsgSource("/")
    result = first.collect(time.time())
    assert result.health.up, result.health.detail
    cursor = first.cursor
    assert cursor.boot_id == real_boot_id and cursor.path == "/dev/kmsg" and isinstance(cursor.seq, int)
    assert all(e.seq <= cursor.seq and e.boot_id == real_boot_id for e in result.xids)
    second = restart(first, Path("/"))
    again = second.collect(time.time())
    assert again.health.up
    assert all(e.seq > cursor.seq for e in again.xids)  # nothing handed over twice
    assert second.cursor.seq >= cursor.seq
    second.close()


def _device_host(tmp_path: Path, boot_id: str) -> Path:
    """A host root whose dev/kmsg is a character-device node of the kernel's kmsg (1, 11)."""
    _open_real_kmsg_or_skip()
    host = make_host(tmp_path / "host", boot_id=boot_id, kmsg_text=None)
    try:
        os.mknod(host / "dev" / "kmsg", 0o600 | stat.S_IFCHR, os.makedev(1, 11))
    except OSError as exc:
        pytest.skip(f"cannot create a kmsg device node here ({exc.strerror}; needs CAP_MKNOD)")
    return host


def test_device_resume_skips_what_this_boot_handed_over_and_a_reboot_reads_the_ring_again(tmp_path):
    real_boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    host = _device_host(tmp_path, real_boot_id)
    reader = KmsgSource(str(host))
    reader.collect(time.time())
    newest = reader.cursor.seq
    reader.close()
    assert isinstance(newest, int)
    # Same boot, a cursor past everything in the ring: every record is skipped, none re-reported.
    ahead = KmsgSource(str(host), cursor=KmsgCursor(boot_id=real_boot_id, seq=newest + 10**9))
    result = ahead.collect(time.time())
    assert result.xids == () and ahead.cursor.seq == newest + 10**9
    ahead.close()
    # Another boot's cursor means nothing here: the ring is read from its start again.
    other = KmsgSource(str(host), cursor=KmsgCursor(boot_id=BOOT_B, seq=newest + 10**9))
    other.collect(time.time())
    assert newest <= other.cursor.seq < newest + 10**9
    other.close()


def test_permission_denied_on_the_real_dev_kmsg_says_what_is_missing():
    """An unprivileged user on this machine: the real /dev/kmsg and the real klogctl both refuse
    (EPERM) where kernel.dmesg_restrict=1. Host root "/" is this kernel, so klogctl is tried."""
    def check():
        result = KmsgSource("/").collect(time.time())
        return [result.health.up, result.health.detail, dict(result.health.errors)]

    up, detail, errors = run_unprivileged(check)
    if up:
        pytest.skip("an unprivileged user may read the kernel log here (kernel.dmesg_restrict=0)")
    assert detail.startswith("permission denied reading /dev/kmsg (Operation not permitted), and klogctl "
                             "(syslog(2) READ_ALL) was refused too (Operation not permitted): reading the "
                             "kernel log needs CAP_SYSLOG")
    assert "CAP_SYSLOG" in detail and "privileged" in detail
    assert errors == {"unreadable": 1}


def test_device_reader_keeps_record_boundaries_skips_handed_over_records_and_counts_lost_ones():
    """A SOCK_SEQPACKET socket reads like /dev/kmsg: one record per read(), EAGAIN when empty."""
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    tally = ErrorTally("kmsg")
    parser = XidLineParser(tally, boot_time=BTIME, now=NOW, boot_id=BOOT_A)
    follower = DeviceFollower("/dev/kmsg", os.dup(ours.fileno()), parser, tally, resume_after=100)
    try:
        for seq, text in [(99, xid_text(13)), (100, xid_text(31)), (104, xid_text(94)), (105, "noise")]:
            kernel.send(record(seq, text, "SUBSYSTEM=pci", "DEVICE=+pci:0000:a8:00.0", priority=4).encode())
        events: list = []
        assert follower.read(50, events) is False  # caught up (EAGAIN)
        assert [(e.seq, e.xid, e.boot_id) for e in events] == [(104, 94, BOOT_A)]
        assert tally.snapshot() == {"overrun": 3}  # 101..103 were overwritten before we read them
        # usec/same: the last record's stamp, so a restart that reads through klogctl resumes there.
        assert follower.cursor(BOOT_A) == KmsgCursor(boot_id=BOOT_A, seq=105, path="/dev/kmsg", usec=105_000,
                                                     same=1)
        for seq in range(106, 110):
            kernel.send(record(seq, xid_text(48), priority=4).encode())
        events = []
        assert follower.read(2, events) is True  # the budget ran out first; the rest stays queued
        assert [e.seq for e in events] == [106, 107]
        events = []
        assert follower.read(50, events) is False
        assert [e.seq for e in events] == [108, 109]
    finally:
        follower.close()
        ours.close()
        kernel.close()


def test_device_reader_resuming_after_an_sxid_headline_does_not_count_its_detail_lines_again():
    """The headline was handed over before the restart; its Severity/Data records follow it."""
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    tally = ErrorTally("kmsg")
    follower = DeviceFollower("/dev/kmsg", os.dup(ours.fileno()),
                              XidLineParser(tally, boot_time=BTIME, now=NOW), tally, resume_after=7)
    sxid = "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 22013, "
    try:
        for seq, text in [(7, sxid + "Non-fatal, Link 02"), (8, sxid + "Severity 0 Engine instance 02"),
                          (9, sxid + "Data {0x00000002}"), (10, xid_text(94))]:
            kernel.send(record(seq, text, priority=4).encode())
        events: list = []
        follower.read(50, events)
        assert [(e.seq, e.xid) for e in events] == [(10, 94)]
        assert tally.snapshot() == {}
    finally:
        follower.close()
        ours.close()
        kernel.close()
