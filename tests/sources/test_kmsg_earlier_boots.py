"""A kernel-log *file* keeps earlier boots: their XIDs are history (``XidEvent.previous_boot``).

Real files under the bundled demo host root (its ``proc/stat`` btime is two hours ago) and a real
rsyslog-format ``kern.log`` fixture whose XIDs are from a boot in January 2024.
"""

from __future__ import annotations

import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from healthagent.demo.node import build_demo_root
from healthagent.sources.kernel_log.boot import BOOT_TIME_SLACK_SECONDS, read_boot_time
from healthagent.sources.kernel_log.source import KmsgSource

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "kmsg" / "kern-earlier-boots.log"


def rsyslog_line(t: float, text: str) -> str:
    stamp = datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="microseconds")
    return f"{stamp} gpu-node-17 kernel: [ 7215.118003] {text}\n"


@pytest.fixture
def node(tmp_path):
    return build_demo_root(tmp_path / "host")


def kern_log(tmp_path: Path, *extra: str) -> Path:
    path = tmp_path / "kern.log"
    shutil.copyfile(FIXTURE, path)
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(extra)
    return path


def test_xids_stamped_before_this_boot_are_marked_earlier_boot(node, tmp_path):
    now = time.time()
    boot = read_boot_time(str(node.root), now)
    log = kern_log(tmp_path,
                   rsyslog_line(now - 30, "NVRM: Xid (PCI:0000:53:00): 13, pid=88, name=python, Graphics Exception"),
                   # A minute before btime is inside the slack (btime's whole seconds, an early clock step).
                   rsyslog_line(boot - BOOT_TIME_SLACK_SECONDS / 2, "NVRM: Xid (PCI:0000:64:00): 31, pid=9, name=x, MMU Fault"))
    result = KmsgSource(str(node.root), kernel_log=str(log)).collect(now)
    assert result.health.up is True
    assert [(e.kind, e.xid, e.previous_boot) for e in result.xids] == [
        ("xid", 94, True), ("xid", 154, True), ("sxid", 20034, True),  # January 2024: an earlier boot
        ("xid", 13, False), ("xid", 31, False),                        # this boot
    ]
    old = result.xids[0]
    assert old.timestamp == datetime(2024, 1, 10, 3, 14, 15, 123456, tzinfo=timezone.utc).timestamp()
    assert old.pci_bus_id == "0000:86:00.0"


def test_without_a_known_boot_time_nothing_is_judged_earlier(tmp_path):
    """No /proc/stat and no /proc/uptime under the host root: the boot time is unknown, and a guess
    ("now") would wrongly retire every real fault in the file, so no line is marked."""
    host = tmp_path / "bare"
    host.mkdir()
    result = KmsgSource(str(host), kernel_log=str(kern_log(tmp_path))).collect(time.time())
    assert [e.previous_boot for e in result.xids] == [False, False, False]


def test_kmsg_records_are_always_this_boot(node):
    """/dev/kmsg-format records (the demo's dev/kmsg file, a real /dev/kmsg) carry a sequence
    number and hold only the running kernel's log: never marked, whatever their stamp."""
    node.inject_xid(3, 94)
    result = KmsgSource(str(node.root)).collect(time.time())
    assert [(e.xid, e.seq is not None, e.previous_boot) for e in result.xids] == [(94, True, False)]
