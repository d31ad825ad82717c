"""The pure kernel-log modules alone: ``formats`` and ``parser`` over tables of lines, no I/O.

Every row is kernel-log text as one of the inputs delivers it and the events (or nothing) it must
give, with the errors it must count. The parser is built directly with a known boot time, so no
host root is read; whole logs through the source and ``iter_events`` are ``test_kmsg*.py``'s.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.formats import (
    KmsgHeader,
    decode_text,
    is_kmsg_dictionary_line,
    kmsg_header,
    prefix_time,
    syslog_time,
    text_prefix,
    unescape_kmsg,
)
from healthagent.sources.kernel_log.parser import MAX_PARSED_CHARS, LogChunk, XidLineParser

BTIME = 1795150000.0  # 2026-11-20T04:46:40Z
NOW = 1795176000.0  # 2026-11-20T12:00:00Z
BOOT = "6d1c2f0e-9a8b-4c7d-8e9f-0a1b2c3d4e5f"
XID = "NVRM: Xid (PCI:0000:a8:00): 13, pid=4242, name=python, Graphics SM Warp Exception"
FALLEN = "NVRM: GPU 0000:53:00.0: GPU has fallen off the bus."
PROBE = ("NVRM: The NVIDIA GPU 0000:53:00.0", "NVRM: (PCI ID: 10de:2330) installed in this system has",
         "NVRM: fallen off the bus and is not responding to commands.")
SXID = "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 22013, "


def local(year: int, month: int, day: int, hour: int, minute: int, second: int) -> float:
    """A wall-clock stamp in this machine's zone, as dmesg -T and RFC 3164 lines are written."""
    return datetime(year, month, day, hour, minute, second).timestamp()


def parser(tally: ErrorTally | None = None, **kw) -> XidLineParser:
    return XidLineParser(tally or ErrorTally("kmsg"), boot_time=BTIME, now=NOW, boot_id=BOOT, **kw)


def exactly(value):
    """A stamp to the microsecond (pytest's default tolerance is relative: minutes at 1.8e9 s)."""
    return pytest.approx(value, rel=0, abs=1e-6) if isinstance(value, float) else value


def summary(event) -> tuple:
    return (event.kind, event.xid, event.pci_bus_id, event.pid, event.process_name, event.timestamp, event.seq)


# -- formats ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, header", [
    ("4,1234,5000000,-;NVRM: Xid", KmsgHeader(seq=1234, usec=5_000_000, end=17)),
    ("6,7,12,c,caller=T123;text", KmsgHeader(seq=7, usec=12, end=21)),
    ("[ 12.000000] NVRM: Xid", None),
    (" SUBSYSTEM=pci", None),
    ("4,12;no usec", None),
])
def test_kmsg_header(line, header):
    assert kmsg_header(line) == header


@pytest.mark.parametrize("line, dictionary", [
    (" SUBSYSTEM=pci", True), (" DEVICE=+pci:0000:53:00.0", True), ("SUBSYSTEM=pci", False),
    (" continued text", False), ("", False),
])
def test_kmsg_dictionary_lines(line, dictionary):
    assert is_kmsg_dictionary_line(line) is dictionary


@pytest.mark.parametrize("escaped, text", [
    ("a\\x0ab", "a\nb"), ("caf\\xc3\\xa9", "café"), ("no escapes", "no escapes"), ("bad \\xff", "bad \ufffd"),
])
def test_kmsg_unescaping(escaped, text):
    assert unescape_kmsg(escaped) == text


@pytest.mark.parametrize("line, stamp, message", [
    ("[ 1234.567890] msg", BTIME + 1234.56789, "msg"),                                  # dmesg
    ("<4>[   12.000000] msg", BTIME + 12.0, "msg"),                                    # dmesg -r, READ_ALL
    ("kern  :err   : [   12.000000] msg", BTIME + 12.0, "msg"),                        # dmesg -x
    ("[   12.000000] [ T1234] msg", BTIME + 12.0, "msg"),                              # printk caller
    ("[Fri Nov 20 10:11:12 2026] msg", local(2026, 11, 20, 10, 11, 12), "msg"),       # dmesg -T
    ("2026-11-20T10:11:12,500000+00:00 msg", 1795169472.5, "msg"),                     # dmesg --time-format iso
    ("Nov 20 10:11:12 node-7 kernel: msg", local(2026, 11, 20, 10, 11, 12), "msg"),   # RFC 3164, journalctl
    ("Nov 20 10:11:12.250000 node-7 kernel: msg", local(2026, 11, 20, 10, 11, 12) + 0.25, "msg"),
    ("Fri 2026-11-20 10:11:12 UTC node-7 kernel: msg", 1795169472.0, "msg"),          # short-full
    ("Fri 2026-11-20 10:11:12 +0100 node-7 kernel: msg", 1795165872.0, "msg"),
    ("1795169472.123456 node-7 kernel: msg", 1795169472.123456, "msg"),              # short-unix
    ("[ 7215.118003] node-7 kernel: msg", BTIME + 7215.118003, "msg"),               # short-monotonic
    ("2026-11-20T10:11:12.000001+00:00 node-7 kernel: [ 7.5] msg", 1795169472.000001, "msg"),  # RFC 5424
    ("msg", None, "msg"),
])
def test_text_prefixes_and_their_stamps(line, stamp, message):
    prefix = text_prefix(line)
    assert line[prefix.end():] == message
    assert prefix_time(prefix, BTIME, NOW) == exactly(stamp)


def test_a_syslog_stamp_without_a_year_never_lands_in_the_future():
    new_year = datetime(2027, 1, 1, 0, 5, tzinfo=timezone.utc).timestamp()
    assert datetime.fromtimestamp(syslog_time("Dec 31 23:59:00", new_year)).year == 2026
    with pytest.raises(ValueError):
        syslog_time("Feb 30 10:11:12", NOW)


def test_undecodable_bytes_are_replaced_and_counted_per_line():
    tally = ErrorTally("kmsg")
    assert decode_text(b"ok\n\xff bad\nfine \xc3\x28\n", tally, "here") == "ok\n\ufffd bad\nfine \ufffd(\n"
    assert tally.snapshot() == {"decode": 2}
    assert decode_text("café\n".encode(), tally, "here") == "café\n" and tally.snapshot() == {"decode": 2}


# -- the parser, line by line ------------------------------------------------------------------------

EVENT_TABLE = [
    # (id, lines, events as (kind, xid, pci, pid, process, timestamp, seq), counted errors)
    ("kmsg record", [f"4,1234,5000000,-;{XID}"],
     [("xid", 13, "0000:a8:00.0", 4242, "python", BTIME + 5.0, 1234)], {}),
    ("kmsg record, caller field", [f"4,12,1000,-,caller=T7;{XID}"],
     [("xid", 13, "0000:a8:00.0", 4242, "python", BTIME + 0.001, 12)], {}),
    ("kmsg probe-time report, one escaped record", ["3,7,2000000,-;" + "\\x0a".join(PROBE)],
     [("fallen_off_bus", 79, "0000:53:00.0", None, "", BTIME + 2.0, 7)], {}),
    ("kmsg dictionary line quoting an XID", [" NOTE=Xid (PCI:0000:a8:00): 13"], [], {}),
    ("dmesg", [f"[ 1234.567890] {XID}"],
     [("xid", 13, "0000:a8:00.0", 4242, "python", BTIME + 1234.56789, None)], {}),
    ("dmesg -r", [f"<4>[   12.000000] {XID}"], [("xid", 13, "0000:a8:00.0", 4242, "python", BTIME + 12, None)], {}),
    ("dmesg -T", [f"[Fri Nov 20 10:11:12 2026] {XID}"],
     [("xid", 13, "0000:a8:00.0", 4242, "python", local(2026, 11, 20, 10, 11, 12), None)], {}),
    ("journalctl -k", [f"Nov 20 10:11:12 node-7 kernel: {XID}"],
     [("xid", 13, "0000:a8:00.0", 4242, "python", local(2026, 11, 20, 10, 11, 12), None)], {}),
    ("syslog RFC 5424", [f"2026-11-20T10:11:12+00:00 node-7 kernel: [ 7.5] {XID}"],
     [("xid", 13, "0000:a8:00.0", 4242, "python", 1795169472.0, None)], {}),
    ("no stamp: now", [XID], [("xid", 13, "0000:a8:00.0", 4242, "python", NOW, None)], {}),
    ("user-space program quoting an XID", [f"Nov 20 10:11:12 node-7 myapp[123]: {XID}"], [],
     {"not_kernel_facility": 1}),
    ("unknown process", ["NVRM: Xid (PCI:0000:a8:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."],
     [("xid", 79, "0000:a8:00.0", None, "", NOW, None)], {}),
    ("older driver, no pid", ["NVRM: Xid (0000:a8:00): 31, Ch 00000010"],
     [("xid", 31, "0000:a8:00.0", None, "", NOW, None)], {}),
    ("no PCI id: kept, counted", ["NVRM: Xid (): 13, pid=1, name=p, x"], [("xid", 13, "", 1, "p", NOW, None)],
     {"parse": 1}),
    ("malformed: kept, counted", ["NVRM: Xid (PCI:0000:a8:00) 94, pid=1, name=p"],
     [("xid", 94, "0000:a8:00.0", 1, "p", NOW, None)], {"parse": 1}),
    ("no number: dropped, counted", ["NVRM: Xid (PCI:0000:a8:00): pid=1"], [], {"parse": 1}),
    ("Xid in another word", ["usb 1-1: Xidian keyboard attached", "Xid"], [], {}),
    ("unreadable stamp: now, counted", [f"Feb 30 10:11:12 node-7 kernel: {XID}"],
     [("xid", 13, "0000:a8:00.0", 4242, "python", NOW, None)], {"parse": 1}),
    ("rsyslog #012", ["Nov 20 10:11:12 node-7 kernel: " + "#012".join(PROBE)],
     [("fallen_off_bus", 79, "0000:53:00.0", None, "", local(2026, 11, 20, 10, 11, 12), None)], {}),
    ("driver's fallen off the bus", [FALLEN], [("fallen_off_bus", 79, "0000:53:00.0", None, "", NOW, None)], {}),
    ("dmesg probe-time report: the address two lines back", [f"[    5.000000] {line}" for line in PROBE],
     [("fallen_off_bus", 79, "0000:53:00.0", None, "", BTIME + 5.0, None)], {}),
    ("probe report's last line alone: kept, counted", [PROBE[2]],
     [("fallen_off_bus", 79, "", None, "", NOW, None)], {"parse": 1}),
    ("SXid headline, then its detail lines", [SXID + "Non-fatal, Link 02", SXID + "Severity 0 Engine 02",
                                              SXID + "Data {0x00000002}"],
     [("sxid", 22013, "0000:05:00.0", None, "", NOW, None)], {}),
    ("a lone SXid detail line", [SXID + "Data {0x00000002}"], [("sxid", 22013, "0000:05:00.0", None, "", NOW, None)],
     {}),
    ("fallen off, the driver's form without the domain", ["NVRM: GPU 18:00.0: GPU has fallen off the bus."],
     [("fallen_off_bus", 79, "0000:18:00.0", None, "", NOW, None)], {}),
    ("fallen off right after another GPU's: its own address", [FALLEN, "NVRM: GPU 18:00.0: GPU has fallen off the bus."],
     [("fallen_off_bus", 79, "0000:53:00.0", None, "", NOW, None),
      ("fallen_off_bus", 79, "0000:18:00.0", None, "", NOW, None)], {}),
    ("fallen off with an unreadable address after another GPU's: none, never the other's",
     [FALLEN, "NVRM: GPU zz:00.0: GPU has fallen off the bus."],
     [("fallen_off_bus", 79, "0000:53:00.0", None, "", NOW, None), ("fallen_off_bus", 79, "", None, "", NOW, None)],
     {"parse": 1}),
    ("a GPU's own fallen-off line right after a probe report's head: its own (unreadable) address",
     [PROBE[0], "NVRM: GPU zz:00.0: GPU has fallen off the bus."],
     [("fallen_off_bus", 79, "", None, "", NOW, None)], {"parse": 1}),
    ("RmInitAdapter failed, then the driver's second line of it",
     ["NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x62:0xffff:1863)",
      "NVRM: GPU 0000:18:00.0: rm_init_adapter failed, device minor number 0"],
     [("init_failed", 0, "0000:18:00.0", None, "", NOW, None)], {}),
    ("RmInitAdapter failed, older driver without the address: kept, counted",
     ["NVRM: RmInitAdapter failed! (0x26:0xffff:1307)", "NVRM: rm_init_adapter(0) failed"],
     [("init_failed", 0, "", None, "", NOW, None)], {"parse": 1}),
    ("RmInitAdapter's other lines are no failure", ["NVRM: RmInitAdapter: Cannot initialize GSP firmware RM"], [], {}),
    ("XID number of ten digits: malformed, counted, never cut", ["NVRM: Xid (PCI:0000:a8:00): 1234567890, pid=1"],
     [], {"parse": 1}),
    ("XID number of nine digits: read", ["NVRM: Xid (PCI:0000:a8:00): 123456789, pid=1, name=p, x"],
     [("xid", 123456789, "0000:a8:00.0", 1, "p", NOW, None)], {}),
]


@pytest.mark.parametrize("lines, events, errors", [row[1:] for row in EVENT_TABLE],
                         ids=[row[0] for row in EVENT_TABLE])
def test_event_table(lines, events, errors):
    tally = ErrorTally("kmsg")
    found = list(parser(tally).scan(lines))
    assert [summary(e) for e in found] == [tuple(exactly(v) for v in want) for want in events]
    assert tally.snapshot() == errors
    assert all(e.source == "kmsg" and e.boot_id == (BOOT if e.seq is not None else "") for e in found)


def test_mig_instances_and_the_gpu_uuid_are_read():
    found = list(parser().scan(["NVRM: Xid (PCI:0000:c5:00 GPU-I:03 GPU-CI:01): 94, pid=7, name=t, x",
                                "NVRM: GPU 0000:53:00.0: GPU-2f1d4a7e-8c3b-4f5a-9e6d-1a2b3c4d5e6f has fallen off"]))
    assert (found[0].gpu_instance, found[0].compute_instance) == (3, 1)
    assert found[1].uuid == "GPU-2f1d4a7e-8c3b-4f5a-9e6d-1a2b3c4d5e6f"


def test_an_oversized_line_is_cut_counted_and_still_parsed():
    tally = ErrorTally("kmsg")
    found = list(parser(tally).scan([XID + " " + "x" * MAX_PARSED_CHARS]))
    assert [e.xid for e in found] == [13] and len(found[0].line) == MAX_PARSED_CHARS
    assert tally.snapshot() == {"oversized": 1}


def test_text_lines_before_the_boot_are_earlier_boots_and_kmsg_records_never_are():
    boot_parser = parser(earlier_boot_before=BTIME - 60)
    found = list(boot_parser.scan([f"2024-01-15T09:30:00+00:00 node-7 kernel: {XID}",
                                   f"2026-11-20T10:11:12+00:00 node-7 kernel: {XID}", f"4,1,0,-;{XID}"]))
    assert [e.previous_boot for e in found] == [True, False, False]


# -- chunks from readers ---------------------------------------------------------------------------

def test_whole_records_are_parsed_alone_and_text_lines_look_back():
    lines = ["NVRM: The NVIDIA GPU 0000:53:00.0", "NVRM: fallen off the bus and is not responding to commands."]
    as_text = list(parser().feed(LogChunk(lines)))
    tally = ErrorTally("kmsg")
    as_records = list(parser(tally).feed(LogChunk(lines, whole_records=True)))
    assert [e.pci_bus_id for e in as_text] == ["0000:53:00.0"]
    assert [e.pci_bus_id for e in as_records] == [""] and tally.snapshot() == {"parse": 1}


@pytest.mark.parametrize("whole_records", [False, True])
def test_context_is_read_for_what_it_says_and_never_reported_or_counted_again(whole_records):
    tally = ErrorTally("kmsg")
    chunk = LogChunk([SXID + "Severity 0 Engine 02", XID], context=["NVRM: Xid (): 13", SXID + "Non-fatal, Link 02"],
                     whole_records=whole_records)
    assert [e.xid for e in parser(tally).feed(chunk)] == [13]  # the detail line belongs to the headline
    assert tally.snapshot() == {}


def test_the_parser_keeps_its_state_across_chunks():
    one = parser()
    assert list(one.feed(LogChunk([f"[ 5.0] {PROBE[0]}", f"[ 5.0] {PROBE[1]}"]))) == []
    assert [e.pci_bus_id for e in one.feed(LogChunk([f"[ 5.0] {PROBE[2]}"]))] == ["0000:53:00.0"]
