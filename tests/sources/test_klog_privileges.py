"""The kernel-log source when the kernel refuses: what is missing is said and counted once, and
reading recovers; ``klogctl`` taken where /dev/kmsg cannot be opened; the C library wrapper; and
this machine's real ``klogctl`` where the kernel lets a test use it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.klogctl import (
    READ_BUFFER_FACTOR,
    SYSLOG_ACTION_READ_ALL,
    SYSLOG_ACTION_SIZE_BUFFER,
    KernelLog,
)
from healthagent.sources.kernel_log.ring import line_usec
from healthagent.sources.kernel_log.source import KmsgSource
from healthagent.sources.kernel_log.wording import describe_both_unreadable
from tests.support.klog_kernel import host  # noqa: F401 (a fixture)
from tests.support.klog_kernel import FIXTURES, READ_ALL_FIXTURE, FakeKernel, expected_keys, keys, source_for, xid_line
from tests.support.kmsg_host import BOOT_A, BOOT_B, NOW, make_host, record, run_forked, run_unprivileged, xid_text


# -- privileges --------------------------------------------------------------------------------

def test_refused_everywhere_says_what_is_missing_is_counted_once_and_recovers(host):
    kernel = FakeKernel(xid_line(1_000, 94))
    kernel.refuse = errno.EPERM
    source = source_for(host, kernel)
    results = [source.collect(NOW) for _ in range(3)]
    for result in results:
        assert not result.health.up and result.xids == ()
        assert result.health.detail == (
            f"{host}/dev/kmsg not found, and klogctl (syslog(2) READ_ALL) was refused too (Operation not "
            f"permitted): reading the kernel log needs CAP_SYSLOG (kernel.dmesg_restrict=1); add it to the "
            f"container (capabilities add SYSLOG, as uid 0, with a seccomp profile that allows syslog, as "
            f"RuntimeDefault does then), which is enough for klogctl, or run the container privileged to "
            f"open /dev/kmsg")
    assert results[-1].health.errors == {"unreadable": 1}  # one outage, not one per retry
    kernel.refuse = None  # CAP_SYSLOG granted
    recovered = source.collect(NOW)
    assert recovered.health.up and [e.xid for e in recovered.xids] == [94]
    assert recovered.health.errors == {"unreadable": 1}
    assert recovered.health.detail.startswith("klogctl")


def test_klogctl_failing_while_followed_is_reported_and_the_next_open_resumes(host):
    kernel = FakeKernel(xid_line(1_000, 13, pid=1))
    source = source_for(host, kernel)
    assert [e.pid for e in source.collect(NOW).xids] == [1]
    kernel.refuse = errno.EPERM
    down = source.collect(NOW)
    assert not down.health.up and "was refused too (Operation not permitted)" in down.health.detail
    kernel.refuse = None
    kernel.log(xid_line(2_000, 94, pid=2))
    assert [e.pid for e in source.collect(NOW).xids] == [2]  # resumed from the cursor, no repeat


@pytest.mark.parametrize("code, expected", [
    (errno.EPERM, "P not found, and klogctl (syslog(2) READ_ALL) was refused too (Operation not permitted): "
                  "reading the kernel log needs CAP_SYSLOG"),
    (errno.EACCES, "P not found, and klogctl (syslog(2) READ_ALL) was refused too (Permission denied): "
                   "reading the kernel log needs CAP_SYSLOG"),
    (errno.ENOSYS, "P not found, and klogctl (syslog(2) READ_ALL) failed too (Function not implemented); "
                   "run the container privileged to open /dev/kmsg, or pass --kernel-log FILE"),
])
def test_both_unreadable_details(code, expected):
    assert describe_both_unreadable("P not found", OSError(code, os.strerror(code))).startswith(expected)


def test_a_host_root_of_another_boot_is_never_read_through_this_kernel(host):
    """klogctl reads the running kernel: a copied or demo host root must not get its lines."""
    kernel = FakeKernel(xid_line(1_000, 94))
    source = source_for(host, kernel, boot_id=BOOT_B)
    result = source.collect(NOW)
    assert not result.health.up and result.xids == ()
    assert result.health.detail == (
        f"{host}/dev/kmsg not found (mount the host's /dev/kmsg into the pod, or pass --kernel-log FILE) "
        f"(klogctl not tried: it reads this machine's kernel, boot id {BOOT_B}, and {host} is boot {BOOT_A})")
    assert kernel.actions == []


def test_a_kernel_log_file_never_falls_back(tmp_path, host):
    kernel = FakeKernel(xid_line(1_000, 94))
    result = source_for(host, kernel, kernel_log=str(tmp_path / "missing.log")).collect(NOW)
    assert not result.health.up and result.health.detail == f"{tmp_path}/missing.log not found"
    assert kernel.actions == []


@pytest.fixture
def world_readable_host():
    """A host root an unprivileged user can walk (pytest's tmp dirs are private to root), removed
    after the test."""
    root = Path(tempfile.mkdtemp(prefix="healthagent-klog-"))
    try:
        root.chmod(0o755)
        host = make_host(root / "host", boot_id=BOOT_A, kmsg_text=None)
        for folder in (host, *(p for p in host.rglob("*") if p.is_dir())):
            folder.chmod(0o755)
        yield host
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_klogctl_is_taken_when_the_kernel_refuses_to_open_dev_kmsg(world_readable_host):
    """dev/kmsg is a file of mode 000, opened by an unprivileged user: the kernel answers EACCES,
    as a device cgroup answers EPERM for the real device (which this machine has no cgroup to show)."""
    host = world_readable_host
    kmsg = host / "dev" / "kmsg"
    kmsg.write_text(record(1, xid_text(13), priority=4))  # must not be read: the kernel refuses it
    kmsg.chmod(0)
    ring = FakeKernel((FIXTURES / READ_ALL_FIXTURE).read_text())

    def check():
        try:
            os.close(os.open(kmsg, os.O_RDONLY))
            return {"opened": True}
        except PermissionError:
            pass
        result = source_for(host, ring).collect(NOW)
        return {"up": result.health.up, "detail": result.health.detail, "keys": keys(result.xids),
                "errors": dict(result.health.errors)}

    reply = run_unprivileged(check)
    if reply.get("opened"):
        pytest.skip("this user can open a mode-000 file (CAP_DAC_OVERRIDE without root?)")
    assert reply["up"] and reply["errors"] == {}
    assert reply["detail"] == (f"klogctl (syslog(2) READ_ALL), because permission denied reading {kmsg} "
                               f"(Permission denied): a container that is not privileged may not open the "
                               f"device; klogctl needs CAP_SYSLOG only")
    assert [tuple(k) for k in reply["keys"]] == expected_keys(READ_ALL_FIXTURE)


# -- the C library wrapper ---------------------------------------------------------------------

def test_kernel_log_sizes_its_buffer_from_size_buffer_and_reads_with_read_all_only():
    kernel = FakeKernel(xid_line(1_000, 94), capacity=3000)
    reader = KernelLog(klogctl=kernel, boot_id=BOOT_A)
    assert reader.open() == 3000
    assert reader.read_all() == xid_line(1_000, 94).encode()
    assert kernel.actions == [SYSLOG_ACTION_SIZE_BUFFER, SYSLOG_ACTION_READ_ALL]
    assert reader.boot_id() == BOOT_A
    # READ_ALL's text (a prefix on every line) can be longer than the records SIZE_BUFFER measures.
    assert kernel.lengths == [0, 3000 * READ_BUFFER_FACTOR]
    reader.close()
    assert reader.read_all() == xid_line(1_000, 94).encode()  # reopens: sizes the buffer again
    assert kernel.actions[2:] == [SYSLOG_ACTION_SIZE_BUFFER, SYSLOG_ACTION_READ_ALL]


@pytest.mark.parametrize("code", [errno.EPERM, errno.EACCES, errno.ENOSYS])
def test_kernel_log_turns_minus_one_and_errno_into_oserror(code):
    kernel = FakeKernel()
    kernel.refuse = code
    with pytest.raises(OSError) as raised:
        KernelLog(klogctl=kernel).read_all()
    assert (raised.value.errno, raised.value.strerror) == (code, os.strerror(code))


def _real_ring_or_skip() -> bytes:
    try:
        return KernelLog().read_all()
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            pytest.skip(f"this machine refuses klogctl READ_ALL ({exc.strerror}): no CAP_SYSLOG here")
        raise


CAP_SYSLOG = 34
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _keep_only_capabilities(mask: int) -> None:
    """capset(2): effective and permitted become ``mask`` (uid stays 0). Dropping needs no privilege."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    halves = (Data * 2)(Data(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0), Data(mask >> 32, mask >> 32, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.capset(ctypes.byref(Header(_LINUX_CAPABILITY_VERSION_3, 0)), halves) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def test_the_real_kernel_lets_klogctl_through_with_cap_syslog_alone():
    """uid 0 with every capability dropped but CAP_SYSLOG (the DaemonSet's set) reads the ring through
    klogctl; with CAP_SYSLOG dropped too, the kernel refuses it (kernel.dmesg_restrict=1)."""
    _real_ring_or_skip()
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to a chosen capability set in a child")
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() != "1":
        pytest.skip("kernel.dmesg_restrict=0 here: klogctl needs no capability at all")

    def attempt() -> str:
        try:
            return f"read {len(KernelLog(boot_id='').read_all())} bytes"
        except OSError as exc:
            return errno.errorcode[exc.errno]

    def check() -> list[str]:
        with_syslog = attempt()
        _keep_only_capabilities(0)
        return [with_syslog, attempt()]

    with_syslog, without = run_forked(lambda: _keep_only_capabilities(1 << CAP_SYSLOG), check)
    assert with_syslog.startswith("read ") and with_syslog != "read 0 bytes"
    assert without == "EPERM"


def test_the_real_klogctl_returns_read_all_lines():
    data = _real_ring_or_skip()
    assert data.endswith(b"\n")
    lines = data.split(b"\n")[:-1]
    assert lines and all(re.match(rb"<\d{1,3}>", raw) for raw in lines)
    stamps = [line_usec(raw, 0) for raw in lines]
    assert all(s is not None for s in stamps) or all(s is None for s in stamps)  # printk.time is global


def test_the_real_klogctl_through_the_source_parses_without_error_and_resumes(tmp_path):
    """This machine's ring through the source: a host root of this boot without dev/kmsg."""
    _real_ring_or_skip()
    real_boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    host = make_host(tmp_path / "host", boot_id=real_boot_id, kmsg_text=None)
    first = KmsgSource(str(host))
    result = first.collect(time.time())
    assert result.health.up, result.health.detail
    assert result.health.detail.startswith(f"klogctl (syslog(2) READ_ALL), because {host}/dev/kmsg not found")
    assert not {"parse", "decode", "unreadable", "overrun"} & set(result.health.errors)
    cursor = first.cursor
    assert cursor.boot_id == real_boot_id and (cursor.usec is not None or cursor.tail)
    second = KmsgSource(str(host), cursor=KmsgCursor.from_dict(json.loads(json.dumps(cursor.to_dict()))))
    again = second.collect(time.time())
    assert again.health.up and not {"parse", "decode", "unreadable"} & set(again.health.errors)
    if cursor.usec is not None:
        newest = KernelLog().read_all()
        assert cursor.usec <= second.cursor.usec <= line_usec(newest, newest.rfind(b"\n", 0, -1) + 1)
        assert not {e.line for e in result.xids} & {e.line for e in again.xids}  # nothing twice
    first.close()
    second.close()
