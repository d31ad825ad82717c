"""Following the kernel log live: cursor, restarts, reboots, rotation, floods, bad input.

Everything runs over real files in a tmp host root shaped like a node (``dev/kmsg``,
``proc/stat``, ``proc/sys/kernel/random/boot_id``), plus the machine's real ``/dev/kmsg`` where
this machine lets a test open it. No reader is mocked.
"""

from __future__ import annotations

import errno
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthagent.sources.kernel_log import file_reader
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.source import KmsgSource
from healthagent.sources.kernel_log.wording import describe_unreadable
from tests.support.kmsg_host import (
    BOOT_A,
    BOOT_B,
    BTIME,
    NOW,
    append,
    backlogged,
    boot_log,
    file_fingerprint,
    make_host,
    record,
    restart,
    seqs,
    xid_text,
)


@pytest.fixture
def host(tmp_path: Path) -> Path:
    return make_host(tmp_path / "host")


# -- reading and restarting ------------------------------------------------------------------------

def test_fresh_source_reads_the_whole_log_so_boot_time_xids_are_not_missed(host):
    log = host / "dev" / "kmsg"
    log.write_text(boot_log(0, 60, {5: 79, 40: 94}))
    source = KmsgSource(str(host))
    result = source.collect(NOW)
    assert [(e.seq, e.xid, e.pci_bus_id) for e in result.xids] == [(5, 79, "0000:a8:00.0"), (40, 94, "0000:a8:00.0")]
    assert all(e.boot_id == BOOT_A for e in result.xids)
    assert [e.timestamp for e in result.xids] == [BTIME + 0.005, BTIME + 0.040]
    assert result.health.up and result.health.source == "kmsg" and result.health.errors == {}
    assert source.cursor == KmsgCursor(boot_id=BOOT_A, seq=60, path=str(log), inode=log.stat().st_ino,
                                       offset=log.stat().st_size, fingerprint=file_fingerprint(log))
    assert source.collect(NOW).xids == ()


def test_append_while_following_returns_each_new_record_once(host):
    log = host / "dev" / "kmsg"
    log.write_text(boot_log(0, 9, {}))
    source = KmsgSource(str(host))
    assert source.collect(NOW).xids == ()
    append(log, record(10, xid_text(94), priority=4))
    assert seqs(source.collect(NOW)) == [10]
    assert source.collect(NOW).xids == ()
    append(log, boot_log(11, 13, {12: 48}) + record(14, xid_text(63, "b9"), priority=4))
    assert [(e.seq, e.xid, e.pci_bus_id) for e in source.collect(NOW).xids] == [(12, 48, "0000:a8:00.0"),
                                                                               (14, 63, "0000:b9:00.0")]
    assert source.cursor.seq == 14


@pytest.mark.parametrize("how", ["appended in place", "replaced by a longer copy"])
def test_restart_in_the_same_boot_neither_repeats_nor_skips(host, how):
    log = host / "dev" / "kmsg"
    log.write_text(boot_log(0, 20, {3: 79, 17: 94}))
    first = KmsgSource(str(host))
    assert seqs(first.collect(NOW)) == [3, 17]
    more = boot_log(21, 30, {21: 13, 29: 31})  # logged while the agent was down
    if how == "appended in place":
        append(log, more)
    else:  # same records in a new file (new inode): only the sequence numbers can tell
        replacement = host / "dev" / "kmsg.new"
        replacement.write_text(log.read_text() + more)
        replacement.rename(log)
    second = restart(first, host)
    assert seqs(second.collect(NOW)) == [21, 29]
    assert second.collect(NOW).xids == ()
    assert second.cursor.seq == 30


def test_restart_after_a_reboot_reads_the_new_log_from_its_start(host):
    log = host / "dev" / "kmsg"
    log.write_text(boot_log(0, 500, {450: 94}))
    first = KmsgSource(str(host))
    assert seqs(first.collect(NOW)) == [450]
    # Reboot: new boot id, a new ring whose sequence numbers are all below the old cursor's.
    make_host(host, boot_id=BOOT_B, kmsg_text=None)
    replacement = host / "dev" / "kmsg.new"
    replacement.write_text(boot_log(0, 40, {7: 79, 39: 48}))
    replacement.rename(log)
    second = restart(first, host)
    result = second.collect(NOW)
    assert [(e.seq, e.xid, e.boot_id) for e in result.xids] == [(7, 79, BOOT_B), (39, 48, BOOT_B)]
    assert second.cursor.boot_id == BOOT_B and second.cursor.seq == 40


def test_after_a_reboot_a_byte_offset_into_a_rewritten_file_is_not_trusted(host):
    """A rebuilt kmsg file can keep its inode; in another boot the saved offset means nothing."""
    log = host / "dev" / "kmsg"
    log.write_text(boot_log(0, 10, {}))
    first = KmsgSource(str(host))
    first.collect(NOW)
    make_host(host, boot_id=BOOT_B, kmsg_text=None)
    with open(log, "r+") as fh:  # rewritten in place: same inode, longer than the old offset
        fh.truncate(0)
        fh.write(boot_log(0, 30, {2: 79, 25: 94}))
    second = restart(first, host)
    assert seqs(second.collect(NOW)) == [2, 25]


def test_a_text_kernel_log_resumes_by_offset_across_restarts_and_reboots(host, tmp_path):
    """--kernel-log with dmesg text: no sequence numbers, the cursor is path + inode + offset."""
    log = tmp_path / "kern.log"
    log.write_text("[    1.000000] Linux version 5.15\n"
                   "[ 5123.456789] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, SM\n")
    first = KmsgSource(str(host), kernel_log=str(log))
    [event] = first.collect(NOW).xids
    assert (event.xid, event.seq, event.boot_id, event.timestamp) == (13, None, "", BTIME + 5123.456789)
    assert first.cursor == KmsgCursor(boot_id=BOOT_A, seq=None, path=str(log), inode=log.stat().st_ino,
                                      offset=log.stat().st_size, fingerprint=file_fingerprint(log))
    append(log, "[ 5200.000000] NVRM: Xid (PCI:0000:cb:00): 109, pid=7, name=p, CTX SWITCH TIMEOUT\n")
    make_host(host, boot_id=BOOT_B, kmsg_text=None)  # a persistent log file outlives a reboot
    second = KmsgSource(str(host), kernel_log=str(log), cursor=KmsgCursor.from_dict(first.cursor.to_dict()))
    assert [e.xid for e in second.collect(NOW).xids] == [109]


# -- files changing under the reader ---------------------------------------------------------------

def test_partial_last_line_waits_for_its_newline(host):
    log = host / "dev" / "kmsg"
    log.write_text(boot_log(0, 2, {}))
    source = KmsgSource(str(host))
    source.collect(NOW)
    whole = record(3, xid_text(94), priority=4)
    append(log, whole[:25])
    assert source.collect(NOW).xids == ()
    assert source.cursor.offset == log.stat().st_size - 25 and source.cursor.seq == 2
    append(log, whole[25:])
    assert [(e.seq, e.xid) for e in source.collect(NOW).xids] == [(3, 94)]


def test_truncation_restarts_from_the_start_and_is_counted(host):
    log = host / "dev" / "kmsg"
    log.write_text(boot_log(0, 30, {10: 13}))
    source = KmsgSource(str(host))
    assert seqs(source.collect(NOW)) == [10]
    with open(log, "r+") as fh:  # copytruncate: same inode, emptied, then written again
        fh.truncate(0)
    append(log, boot_log(31, 33, {32: 94}))
    result = source.collect(NOW)
    assert seqs(result) == [32]
    assert result.health.errors == {"rotated": 1}
    assert source.cursor.offset == log.stat().st_size


def test_rotation_by_rename_drains_the_old_file_then_follows_the_new(host):
    log = host / "dev" / "kmsg"
    log.write_text(boot_log(0, 5, {}))
    source = KmsgSource(str(host))
    source.collect(NOW)
    append(log, record(6, xid_text(48), priority=4))  # written just before the rotation
    log.rename(host / "dev" / "kmsg.1")
    log.write_text(record(7, xid_text(94), priority=4))
    result = source.collect(NOW)
    assert [(e.seq, e.xid) for e in result.xids] == [(6, 48), (7, 94)]
    assert result.health.errors == {"rotated": 1}
    assert source.cursor.inode == log.stat().st_ino


def test_a_copy_of_records_already_read_is_not_read_again_after_rotation(host):
    log = host / "dev" / "kmsg"
    log.write_text(boot_log(0, 9, {4: 79}))
    source = KmsgSource(str(host))
    assert seqs(source.collect(NOW)) == [4]
    copy = host / "dev" / "kmsg.new"
    copy.write_text(log.read_text() + record(10, xid_text(94), priority=4))
    copy.rename(log)
    assert seqs(source.collect(NOW)) == [10]


# -- bounded work ----------------------------------------------------------------------------------

def test_backlog_beyond_max_records_is_carried_to_the_next_call_with_nothing_lost(host):
    log = host / "dev" / "kmsg"
    xids = {seq: 13 for seq in range(7, 1000, 100)}
    log.write_text(boot_log(0, 999, xids))  # 3 lines per noise record, 1 per XID record
    source = KmsgSource(str(host), max_records_per_cycle=200)
    seen: list[int] = []
    details = []
    for _ in range(40):  # bound; each call reads at most 200 lines
        before = source.cursor.offset
        result = source.collect(NOW)
        with open(log, "rb") as fh:
            fh.seek(before)
            assert fh.read(source.cursor.offset - before).count(b"\n") <= 200
        seen += seqs(result)
        details.append(result.health.detail)
        if not backlogged(result):
            break
    assert seen == sorted(xids)
    mode = f"file {log}"
    assert details[0].startswith(f"{mode}; backlog: 200 records") and details[-1] == mode
    assert len(details) > 10


def test_restart_in_the_middle_of_a_backlog_loses_and_repeats_nothing(host):
    log = host / "dev" / "kmsg"
    xids = {seq: 94 for seq in range(3, 600, 37)}
    log.write_text(boot_log(0, 599, xids))
    source = KmsgSource(str(host), max_records_per_cycle=250)
    seen = seqs(source.collect(NOW))
    source = restart(source, host, max_records_per_cycle=250)
    for _ in range(20):
        result = source.collect(NOW)
        seen += seqs(result)
        if not backlogged(result):
            break
    assert seen == sorted(xids)


def test_a_million_line_flood_is_read_in_bounded_steps_with_bounded_memory(host):
    log = host / "dev" / "kmsg"
    with open(log, "w") as fh:
        for seq in range(1_000_000):
            fh.write(f"4,{seq},{seq},-;NVRM: Xid (PCI:0000:a8:00): 13, pid=1, name=p, flood\n" if seq % 100 == 0
                     else f"6,{seq},{seq},-;noise noise noise noise noise noise noise {seq}\n")
    source = KmsgSource(str(host))  # default: 50,000 records per cycle
    tracemalloc.start()
    try:
        first = source.collect(NOW)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 1024 * 1024  # a 1 MiB read chunk and 500 events, not the ~70 MB file
    # 500 XID 13s in the first read: the first eight as they are, the rest one event with the count.
    assert len(first.xids) == 9 and first.xids[-1].repeats == 492 and source.cursor.seq == 49_999
    total = sum(e.repeats for e in first.xids)
    for _ in range(30):
        result = source.collect(NOW)
        total += sum(e.repeats for e in result.xids)
        if not backlogged(result):
            break
    assert total == 10_000 and source.cursor.seq == 999_999


# -- bad input -------------------------------------------------------------------------------------

def test_garbage_and_truncated_records_are_counted_and_real_faults_still_come_through(host):
    log = host / "dev" / "kmsg"
    log.write_bytes(
        record(0, "Linux version 6.1").encode()
        + b"4,1,\xff\xfe\xfd;NVRM: Xid (PCI:0000:53:00): 48, bad bytes\n"
        + b"4,2,2000,-;NVRM: Xid (PCI:0000:a8\n"  # cut off inside the record
        + b"4,3,;NVRM: Xid\n"
        + b"\x00\x01\x02 binary junk \xc3\x28\n"
        + record(4, "NVRM: Xid (PCI:zzzz): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
                 priority=4).encode()
        + record(5, xid_text(94), priority=4).encode())
    source = KmsgSource(str(host))
    result = source.collect(NOW)
    assert [(e.xid, e.pci_bus_id, e.seq) for e in result.xids] == [
        (48, "0000:53:00.0", None), (79, "", 4), (94, "0000:a8:00.0", 5)]
    assert result.health.up
    assert result.health.errors == {"decode": 2, "parse": 3}
    assert source.cursor.seq == 5 and source.cursor.offset == log.stat().st_size


def test_an_overlong_line_is_skipped_counted_and_reading_goes_on(host, monkeypatch):
    monkeypatch.setattr(file_reader, "FILE_CHUNK_BYTES", 4096)
    log = host / "dev" / "kmsg"
    log.write_text(record(0, "x" * 20_000) + record(1, xid_text(94), priority=4))
    source = KmsgSource(str(host))
    result = source.collect(NOW)
    assert seqs(result) == [1]
    assert result.health.errors == {"oversized": 1}


def test_a_text_log_whose_first_line_was_too_long_resumes_after_a_restart_without_a_repeat(host, tmp_path,
                                                                                          monkeypatch):
    """The cursor's fingerprint is of the bytes where they are, also past a line skipped unread."""
    monkeypatch.setattr(file_reader, "FILE_CHUNK_BYTES", 4096)
    log = tmp_path / "kern.log"
    log.write_text("[    1.000000] " + "x" * 20_000 + "\n[    2.000000] NVRM: Xid (PCI:0000:a8:00): 31, pid=1, x\n")
    first = KmsgSource(str(host), kernel_log=str(log))
    assert [e.xid for e in first.collect(NOW).xids] == [31]
    append(log, "[    3.000000] NVRM: Xid (PCI:0000:a8:00): 94, pid=1, x\n")
    again = KmsgSource(str(host), kernel_log=str(log), cursor=KmsgCursor.from_dict(first.cursor.to_dict()))
    result = again.collect(NOW)
    assert [e.xid for e in result.xids] == [94] and "rotated" not in result.health.errors


def test_a_missing_log_is_down_counted_once_retried_and_recovers(host):
    (host / "dev" / "kmsg").unlink()
    source = KmsgSource(str(host))
    first, second = source.collect(NOW), source.collect(NOW)
    expected_path = str(host / "dev" / "kmsg")
    for result in (first, second):
        assert not result.health.up and result.xids == ()
        assert result.health.detail.startswith(f"{expected_path} not found")
        assert "--kernel-log" in result.health.detail
    assert second.health.errors == {"unreadable": 1}  # one outage, not one per 0.1 s retry
    (host / "dev" / "kmsg").write_text(boot_log(0, 3, {2: 79}))
    recovered = source.collect(NOW)
    assert recovered.health.up and recovered.health.detail == f"file {expected_path}"
    assert seqs(recovered) == [2]
    assert recovered.health.errors == {"unreadable": 1}


def test_a_directory_is_not_a_kernel_log(host):
    (host / "dev" / "kmsg").unlink()
    (host / "dev" / "kmsg").mkdir()
    result = KmsgSource(str(host)).collect(NOW)
    assert not result.health.up
    assert "neither a regular file nor a character device" in result.health.detail
    assert result.health.errors == {"unreadable": 1}


@pytest.mark.parametrize("path, exc, device, expected", [
    ("/host/dev/kmsg", FileNotFoundError(errno.ENOENT, "No such file"), False,
     "/host/dev/kmsg not found (mount the host's /dev/kmsg into the pod, or pass --kernel-log FILE)"),
    ("/var/log/kern.log", FileNotFoundError(errno.ENOENT, "No such file"), False, "/var/log/kern.log not found"),
    ("/host/dev/kmsg", PermissionError(errno.EPERM, "Operation not permitted"), True,
     "permission denied reading /host/dev/kmsg (Operation not permitted): reading the kernel log needs "
     "CAP_SYSLOG (kernel.dmesg_restrict) and device access; run the agent's container privileged or add "
     "CAP_SYSLOG, with the host's /dev/kmsg mounted"),
    ("/var/log/kern.log", PermissionError(errno.EACCES, "Permission denied"), False,
     "permission denied reading /var/log/kern.log (Permission denied)"),
    ("/var/log/kern.log", OSError(errno.EIO, "Input/output error"), False,
     "cannot read /var/log/kern.log: EIO: Input/output error"),
    ("/var/log/kern.log", OSError(errno.ELOOP, "Too many levels of symbolic links"), False,
     "cannot read /var/log/kern.log: ELOOP: Too many levels of symbolic links"),
])
def test_unreadable_details_say_what_to_do(path, exc, device, expected):
    assert describe_unreadable(path, exc, device) == expected


# -- never raises ----------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"4,7,1000,-;NVRM: Xid (PCI:0000:a8:00): 94, pid=1, name=p, x\n", b" SUBSYSTEM=pci\n",
                     b"NVRM: Xid (PCI:", b"fallen off the bus", b"\n", b"\xff", b"SXid (", b"4,", b";"])),
    max_size=30), st.integers(min_value=1, max_value=8))
def test_random_bytes_never_raise_from_collect(chunks, max_records):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        host = make_host(Path(tmp), kmsg_text=None)
        (host / "dev" / "kmsg").write_bytes(b"".join(chunks))
        source = KmsgSource(str(host), max_records_per_cycle=max_records)
        for _ in range(40):
            result = source.collect(NOW)
            assert result.health.up
            assert all(e.kind in ("xid", "sxid", "fallen_off_bus") for e in result.xids)
            if not backlogged(result):
                break
        assert not backlogged(result) and result.health.detail.startswith("file ")
        source.close()
