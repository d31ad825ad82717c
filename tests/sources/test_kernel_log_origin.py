"""In a file that mixes every program's lines with the kernel's (``/var/log/messages`` on AL2/RHEL),
a line is the kernel's only when its header says so: the syslog tag ``kernel`` (no pid), a priority
of facility 0, dmesg ``-x``'s ``kern``, or no header at all (dmesg, ``journalctl -k -o cat``).
``logger -t myapp`` quoting an XID 94 or a ConnectX fatal sentence is someone's text: ignored,
counted ``not_kernel_facility``, never a node action. Every format the kernel's lines arrive in
still reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from healthagent.common import ErrorTally
from healthagent.config import load_settings
from healthagent.model import Action, AdapterEvent, Collection
from healthagent.sources.kernel_log.parser import XidLineParser
from healthagent.sources.kernel_log.source import KmsgSource
from healthagent.wiring import build_classifier
from tests.support.kmsg_host import BTIME, NOW, make_host, record, xid_text

XID_94 = xid_text(94)
FATAL = "mlx5_core 0000:41:00.0: poll_health:785:(pid 0): Fatal error 1 detected"
REFUSED = {"not_kernel_facility": 1}


def parsed(*lines: str):
    tally = ErrorTally("kmsg")
    events = list(XidLineParser(tally, boot_time=BTIME, now=NOW).scan(lines))
    return events, tally.snapshot()


# Each line form (its id: the format, or the trick) -> whether the kernel wrote it. "{}" is the report.
LINE_FORMS: dict[str, tuple[str, bool]] = {
    "logger -t myapp": ("Nov 20 10:11:12 host myapp: {}", False),
    "logger -t myapp -i": ("Nov 20 10:11:12 host myapp[123]: {}", False),
    "kernel: inside the message": ("Nov 20 10:11:12 host myapp: kernel: {}", False),
    "host named kernel": ("Nov 20 10:11:12 kernel myapp: {}", False),
    "host name holding kernel": ("Nov 20 10:11:12 kernel-node-7 myapp: {}", False),
    "tag kernelx": ("Nov 20 10:11:12 host kernelx: {}", False),
    "tag Kernel": ("Nov 20 10:11:12 host Kernel: {}", False),
    "tag xkernel": ("Nov 20 10:11:12 host xkernel: {}", False),
    "tag kernel with a pid": ("Nov 20 10:11:12 host kernel[123]: {}", False),
    "pid that is no number": ("Nov 20 10:11:12 host myapp[x]: {}", False),
    "short-precise": ("Nov 20 10:11:12.123456 host myapp: {}", False),
    "rsyslog high precision": ("2026-11-20T10:11:12.123456+00:00 host myapp: {}", False),
    "short-iso": ("2026-11-20T10:11:12+0000 host myapp: {}", False),
    "short-monotonic": ("[ 5123.456789] host myapp: {}", False),
    "short-unix": ("1795169472.123456 host myapp: {}", False),
    "short-full": ("Fri 2026-11-20 10:11:12 UTC host myapp: {}", False),
    "busybox syslogd: no tag read": ("Nov 20 10:11:12 host user.notice myapp: {}", False),
    "rfc 5424 user": ("<14>1 2026-11-20T10:11:12Z host myapp 123 - - {}", False),
    "rfc 5424 facility 0, tag myapp": ("<0>1 2026-11-20T10:11:12Z host myapp - - - {}", False),
    "rfc 3164 facility 0, tag myapp": ("<0>Nov 20 10:11:12 host myapp: {}", False),
    "journal export field": ("MESSAGE={}", False),
    "journal json-pretty field": ('\t"MESSAGE" : "{}",', False),
    "dmesg": ("[ 5123.456789] {}", True),
    "dmesg -T": ("[Fri Nov 20 10:11:12 2026] {}", True),
    "dmesg --time-format iso": ("2026-11-20T10:11:12,123456+00:00 {}", True),
    "dmesg -x": ("kern  :err   : [ 5123.456789] {}", True),
    "dmesg -r": ("<3>[ 5123.456789] {}", True),
    "dmesg --notime, journalctl -o cat": ("{}", True),
    "journalctl -k, host name holding kernel": ("Nov 20 10:11:12 kernel-node-7 kernel: {}", True),
    "kernel: host named kernel": ("Nov 20 10:11:12 kernel kernel: {}", True),
    "kernel: short-precise": ("Nov 20 10:11:12.123456 host kernel: {}", True),
    "kernel: short-iso": ("2026-11-20T10:11:12+0000 host kernel: {}", True),
    "kernel: short-monotonic": ("[ 5123.456789] host kernel: {}", True),
    "kernel: short-unix": ("1795169472.123456 host kernel: {}", True),
    "kernel: short-full": ("Fri 2026-11-20 10:11:12 UTC host kernel: {}", True),
    "rsyslog traditional": ("Nov 20 10:11:12 host kernel: [ 5123.456789] {}", True),
    "kernel: rsyslog high precision": ("2026-11-20T10:11:12.123456+00:00 host kernel: {}", True),
    "syslog without host names": ("Nov 20 10:11:12 kernel: {}", True),
    "rfc 5424 kernel": ("<4>1 2026-11-20T10:11:12Z host kernel - - - {}", True),
    "kmsg record": ("4,100,5000,-;{}", True),
}


@pytest.mark.parametrize("report", [XID_94, FATAL], ids=["xid 94", "connectx fatal"])
@pytest.mark.parametrize("form", LINE_FORMS)
def test_only_the_kernels_lines_are_reports_in_every_format(form, report):
    """Another program's line is ignored and counted; the kernel's own is read in every format."""
    line, from_kernel = LINE_FORMS[form]
    events, errors = parsed(line.format(report))
    if not from_kernel:
        assert events == [] and errors == REFUSED
    else:
        assert len(events) == 1 and errors == {}
        assert events[0].xid == 94 if report == XID_94 else isinstance(events[0], AdapterEvent)


def journal_json(message: str, transport: str, **fields: str) -> str:
    return json.dumps({"__REALTIME_TIMESTAMP": "1795169472000000", "_TRANSPORT": transport,
                       "SYSLOG_IDENTIFIER": "kernel", "MESSAGE": message, **fields})


def test_journal_json_is_the_kernels_only_when_the_journal_says_its_transport_is():
    events, errors = parsed(journal_json(XID_94, "kernel", SYSLOG_FACILITY="0"))
    assert [(e.xid, e.timestamp) for e in events] == [(94, 1795169472.0)] and errors == {}
    for forged in (journal_json(XID_94, "syslog", SYSLOG_FACILITY="0"),  # logger -t kernel -p kern.err
                   journal_json(XID_94, "journal", SYSLOG_FACILITY="0"),  # a native client naming facility 0
                   journal_json(FATAL, "stdout"),
                   journal_json(XID_94, "kernel", SYSLOG_FACILITY="1")):
        assert parsed(forged) == ([], REFUSED), forged


def test_a_continuation_line_is_its_header_lines_writers():
    """journalctl prints a multi-line message's further lines indented, with no header: a program's
    message with a newline must not lend its second line the kernel's standing. The kernel's own
    multi-line report (the probe-time fallen-off-the-bus report) still reads."""
    user = ["Nov 20 10:11:12 host myapp[12]: look:", f"                                   {XID_94}"]
    assert parsed(*user) == ([], REFUSED)
    kernel = ["Nov 20 10:11:12 host kernel: NVRM: The NVIDIA GPU 0000:b3:00.0",
              "                             NVRM: (PCI ID: 10de:26b5) installed in this system has",
              "                             NVRM: fallen off the bus and is not responding to commands."]
    events, errors = parsed(*kernel)
    assert [(e.kind, e.pci_bus_id) for e in events] == [("fallen_off_bus", "0000:b3:00.0")] and errors == {}


def test_a_benign_kernel_line_that_reads_like_a_header_counts_nothing():
    """``usb 1-1: ...`` after dmesg's stamp reads like "host tag:"; it holds no report, so it is
    neither an event nor a refusal worth counting."""
    assert parsed("[   12.000000] usb 1-1: device has fallen off the hub",
                  "[    1.000000] usb 1-1: Xidian keyboard attached") == ([], {})


def test_a_messages_file_with_logger_lines_takes_no_node_action_and_reads_the_kernels(tmp_path: Path):
    """``/var/log/messages`` followed as the kernel log: two ``logger -t`` lines (an XID 94 and a
    ConnectX fatal error) are counted and judged nothing; the kernel's XID 13 after them is read."""
    host = make_host(tmp_path / "host")
    messages = tmp_path / "messages"
    messages.write_text(f"Nov 20 10:11:10 gpu-node-17 systemd[1]: Started Session 7 of user ubuntu.\n"
                        f"Nov 20 10:11:11 gpu-node-17 myapp: {XID_94}\n"
                        f"Nov 20 10:11:12 gpu-node-17 myapp: {FATAL}\n")
    source = KmsgSource(str(host), kernel_log=str(messages))
    result = source.collect(NOW)
    assert result.health.up and result.xids == () and result.adapter_events == ()
    assert result.health.errors == {"not_kernel_facility": 2}
    judge = build_classifier(load_settings(env={}, flags={}))
    verdict = judge.observe(Collection(timestamp=NOW, xids=result.xids, adapter_events=result.adapter_events,
                                       health=(result.health,))).verdict
    assert verdict.action is Action.NONE and verdict.findings == ()
    with messages.open("a") as fh:
        fh.write(f"Nov 20 10:11:13 gpu-node-17 kernel: {xid_text(13)}\n")
    assert [e.xid for e in source.collect(NOW).xids] == [13]
    source.close()


def test_the_kmsg_record_form_is_judged_by_its_facility_not_its_text():
    """A record's text is the kernel's words whatever they look like: ``myapp: ...`` in a facility-0
    record is the kernel's (nothing in a record is a syslog header)."""
    events, errors = parsed(record(1, f"[ 1.0] myapp: {XID_94}", priority=4).rstrip("\n"))
    assert [e.xid for e in events] == [94] and errors == {}
