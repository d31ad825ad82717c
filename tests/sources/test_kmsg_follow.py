"""Following the kernel log live: cursor, restarts, reboots, rotation, floods, bad input.

Everything runs over real files in a tmp host root shaped like a node (``dev/kmsg``,
``proc/stat``, ``proc/sys/kernel/random/boot_id``), plus the machine's real ``/dev/kmsg`` where
this machine lets a test open it. No reader is mocked.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import socket
import stat
import time
import tracemalloc
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log import file_reader
from healthagent.sources.kernel_log.file_reader import FINGERPRINT_BYTES, fingerprint
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.device_reader import KmsgDeviceReader
from healthagent.sources.kernel_log.parser import XidLineParser
from healthagent.sources.kernel_log.ring import RingPosition
from healthagent.sources.kernel_log.source import KmsgSource
from healthagent.sources.kernel_log.wording import describe_unreadable

BTIME = 1795150000
NOW = 1795176000.0
BOOT_A = "6d1c2f0e-9a8b-4c7d-8e9f-0a1b2c3d4e5f"
BOOT_B = "0b7e51a2-33c4-4d15-9e26-7f3801a2b4c6"


# -- a host root -----------------------------------------------------------------------------------

def make_host(root: Path, boot_id: str = BOOT_A, kmsg_text: str | None = "") -> Path:
    (root / "proc" / "sys" / "kernel" / "random").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "sys" / "kernel" / "random" / "boot_id").write_text(boot_id + "\n")
    (root / "proc" / "stat").write_text(f"cpu  1 2 3 4 5 6 7 0 0 0\nbtime {BTIME}\nprocesses 9\n")
    (root / "dev").mkdir(exist_ok=True)
    if kmsg_text is not None:
        (root / "dev" / "kmsg").write_text(kmsg_text)
    return root


def record(seq: int, text: str, *fields: str, usec: int | None = None, priority: int = 6) -> str:
    """One /dev/kmsg record with its dictionary lines."""
    usec = seq * 1000 if usec is None else usec
    return f"{priority},{seq},{usec},-;{text}\n" + "".join(f" {f}\n" for f in fields)


def file_fingerprint(path: Path) -> str:
    """The fingerprint of a whole file read to its end: its first and last bytes."""
    data = path.read_bytes()
    return fingerprint(data[:FINGERPRINT_BYTES], data[-FINGERPRINT_BYTES:])


def xid_text(xid: int, bus: str = "a8") -> str:
    return f"NVRM: Xid (PCI:0000:{bus}:00): {xid}, pid=4242, name=python, seq-test"


def boot_log(first: int, last: int, xids: dict[int, int]) -> str:
    """Records ``first..last``; the seqs in ``xids`` are XID records, the rest is device noise."""
    return "".join(
        record(seq, xid_text(xids[seq]), priority=4) if seq in xids
        else record(seq, f"pci 0000:{seq % 256:02x}:00.0: enabling device (0000 -> 0002)",
                    "SUBSYSTEM=pci", f"DEVICE=+pci:0000:{seq % 256:02x}:00.0")
        for seq in range(first, last + 1))


def append(path: Path, text: str | bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(text.encode() if isinstance(text, str) else text)


def seqs(result) -> list[int]:
    return [e.seq for e in result.xids]


def backlogged(result) -> bool:
    """The detail names the input, plus "backlog: ..." while the per-cycle cap left records unread."""
    return "; backlog: " in result.health.detail


def restart(source: KmsgSource, host: Path, **kw) -> KmsgSource:
    """What the agent does across a restart: save the cursor as JSON, build a new source from it."""
    saved = json.loads(json.dumps(source.cursor.to_dict()))
    source.close()
    return KmsgSource(str(host), cursor=KmsgCursor.from_dict(saved), **kw)


class DeviceFollower:
    """The /dev/kmsg reader feeding a parser, as ``KmsgSource`` drives the two: ``read`` appends
    the events of up to ``budget`` records and says whether the budget ran out first."""

    def __init__(self, path: str, fd: int, parser: XidLineParser, tally: ErrorTally, resume_after: int | None,
                 saved: RingPosition = RingPosition()) -> None:
        self.reader = KmsgDeviceReader(path, fd, tally, resume_after, saved)
        self.parser = parser

    def read(self, budget: int, events: list) -> bool:
        return self.reader.read(budget, self.parser.now, lambda chunk: events.extend(self.parser.feed(chunk)))

    def cursor(self, boot_id: str) -> KmsgCursor:
        return self.reader.cursor(boot_id)

    def close(self) -> None:
        self.reader.close()


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


def run_forked(prepare: Callable[[], None], check: Callable[[], object]) -> object:
    """``check()``'s JSON-able result, computed in a forked child after ``prepare()`` (which gives up
    privileges for good; the child never returns into pytest)."""
    codecs.lookup("ascii")  # the child may not be able to load codecs from root's Python install
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            prepare()
            os.write(writer, json.dumps(check()).encode())
        except BaseException as exc:  # noqa: BLE001 - handed to the parent, which fails the test
            os.write(writer, json.dumps({"child_error": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(writer)
    os.waitpid(pid, 0)
    with os.fdopen(reader, "rb") as fh:
        reply = json.loads(fh.read())
    assert not (isinstance(reply, dict) and "child_error" in reply), reply
    return reply


def run_unprivileged(check: Callable[[], object]) -> object:
    """``check()``'s result as uid/gid 65534: in a forked child when this is root, else right here."""
    if os.geteuid() != 0:
        return json.loads(json.dumps(check()))

    def drop_root() -> None:
        os.setgid(65534)
        os.setuid(65534)

    return run_forked(drop_root, check)


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
