"""Kernel-log XID parsing: every line form a node produces, fixtures of whole logs, bad input.

The parser is exercised through ``iter_events`` (what ``healthagent classify`` runs) over real
text, with a real host root (``proc/stat`` btime) in a tmp dir for kernel-relative stamps.
"""

from __future__ import annotations

import io
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthagent.model import FALLEN_OFF_BUS_XID, canonical_pci_bus_id
from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.boot import read_boot_time
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.offline import iter_events

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kmsg"
BTIME = 1795150000  # the tmp host's boot, 2026-11-20T04:46:40Z
NOW = 1795176000.0  # 2026-11-20T12:00:00Z
DEFAULTS = {"pid": None, "process_name": "", "gpu_instance": None, "compute_instance": None,
            "seq": None, "uuid": ""}


@pytest.fixture
def utc():
    """dmesg -T and syslog stamps are local time; pin the zone so expectations are exact."""
    saved = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if saved is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = saved
    time.tzset()


@pytest.fixture
def host(tmp_path: Path) -> Path:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "stat").write_text(f"cpu  1 2 3 4 5 6 7 0 0 0\nintr 0\nctxt 99\nbtime {BTIME}\n")
    return tmp_path


def events_of(text: str, host: Path, tally: ErrorTally | None = None):
    return list(iter_events(io.StringIO(text), NOW, host_root=str(host), tally=tally))


def expected_time(expected: dict) -> float:
    if "since_boot" in expected:
        return BTIME + expected["since_boot"]
    if "utc" in expected:
        return datetime.fromisoformat(expected["utc"]).replace(tzinfo=timezone.utc).timestamp()
    assert expected.get("now"), expected
    return NOW


def assert_event(event, expected: dict) -> None:
    assert (event.kind, event.xid, event.pci_bus_id) == (expected["kind"], expected["xid"],
                                                         expected["pci_bus_id"]), event.line
    for name, default in DEFAULTS.items():
        assert getattr(event, name) == expected.get(name, default), (name, event.line)
    assert event.timestamp == pytest.approx(expected_time(expected), abs=1e-6), event.line
    if "message" in expected:
        assert event.message == expected["message"]
    assert event.source == "kmsg"


# -- one line of every form ------------------------------------------------------------------------

def x(xid, pci, **kw):
    return {"kind": "xid", "xid": xid, "pci_bus_id": pci, **kw}


LINES = [
    ("kmsg record", "4,1187,5123456789,-;NVRM: Xid (PCI:0000:a8:00): 94, pid=1234, name=python, "
     "Contained: SM (0x1). RST: No, D-RST: No",
     x(94, "0000:a8:00.0", pid=1234, process_name="python", seq=1187, since_boot=5123.456789)),
    ("kmsg record with caller id", "4,77,1000000,-,caller=T1234;NVRM: Xid (PCI:0000:53:00): 48, "
     "An uncorrectable double bit error", x(48, "0000:53:00.0", seq=77, since_boot=1.0)),
    ("pid and name unknown", "[  100.000000] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', "
     "name=<unknown>, Graphics SM Warp Exception", x(13, "0000:cb:00.0", since_boot=100.0)),
    ("pid without name", "[  100.000000] NVRM: Xid (PCI:0000:01:00): 94, pid=7062, Contained: CE "
     "User Channel (0x9). RST: No, D-RST: No", x(94, "0000:01:00.0", pid=7062, since_boot=100.0)),
    ("no pid or name (old driver)", "[  100.000000] NVRM: Xid (PCI:0000:01:00): 48, An uncorrectable "
     "double bit error", x(48, "0000:01:00.0", since_boot=100.0)),
    ("no PCI: prefix (old driver)", "NVRM: Xid (0000:03:00): 14, Channel 00000001",
     x(14, "0000:03:00.0", now=True)),
    ("upper-case hex", "NVRM: Xid (PCI:0000:CB:0A): 31, pid=9, name=a, MMU Fault",
     x(31, "0000:cb:0a.0", pid=9, process_name="a", now=True)),
    ("PCI id with function", "NVRM: Xid (PCI:0000:b3:00.1): 79, pid=12345, GPU has fallen off the bus.",
     x(79, "0000:b3:00.1", pid=12345, now=True)),
    ("MIG GPU and compute instance", "NVRM: Xid (PCI:0000:c5:00 GPU-I:03 GPU-CI:01): 43, pid=31, "
     "name=pt_main_thread, channel 0x0b00000a",
     x(43, "0000:c5:00.0", pid=31, process_name="pt_main_thread", gpu_instance=3, compute_instance=1,
       now=True)),
    ("MIG GPU instance only", "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE",
     x(94, "0000:01:00.0", pid=7194, gpu_instance=5, now=True)),
    ("name with a space", "NVRM: Xid (PCI:0000:01:00): 31, pid=5, name=Web Content, MMU Fault",
     x(31, "0000:01:00.0", pid=5, process_name="Web Content", now=True)),
    ("a later XID quoted in the text", "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, "
     "Ch 00000001 caused by previous Xid 149",
     x(45, "0000:dc:00.0", pid=1818990, process_name="python3", now=True)),
    ("dmesg caller id", "[ 7000.000000] [  T4821] NVRM: Xid (PCI:0000:a8:00): 63, pid=4821, "
     "name=python3, Row Remapper", x(63, "0000:a8:00.0", pid=4821, process_name="python3", since_boot=7000.0)),
    ("dmesg -r", "<4>[   12.500000] NVRM: Xid (PCI:0000:a8:00): 119, pid=1, name=x, GSP RPC timeout",
     x(119, "0000:a8:00.0", pid=1, process_name="x", since_boot=12.5)),
    ("dmesg -T", "[Fri Nov 20 11:32:56 2026] NVRM: Xid (PCI:0000:00:1d): 95, pid='<unknown>', "
     "name=<unknown>, Uncontained: FBHUB. RST: Yes, D-RST: No", x(95, "0000:00:1d.0", utc="2026-11-20T11:32:56")),
    ("dmesg -T single-digit day", "[Fri Nov  6 03:54:13 2026] NVRM: Xid (PCI:0000:00:1f): 31, pid=2, "
     "name=p, MMU Fault", x(31, "0000:00:1f.0", pid=2, process_name="p", utc="2026-11-06T03:54:13")),
    ("dmesg -x --time-format iso", "kern  :err   : 2026-11-20T10:11:14,500000+00:00 NVRM: Xid "
     "(PCI:0000:53:00): 92, pid=1, name=p, High single-bit ECC error rate",
     x(92, "0000:53:00.0", pid=1, process_name="p", utc="2026-11-20T10:11:14.500000")),
    ("journalctl short", "Nov 20 10:11:12 gpu-node-17 kernel: NVRM: Xid (PCI:0000:97:00): 74, pid=3, "
     "name=p, NVLink: fatal error", x(74, "0000:97:00.0", pid=3, process_name="p", utc="2026-11-20T10:11:12")),
    ("journalctl short-precise", "Nov 20 10:15:01.250000 gpu-node-17 kernel: NVRM: Xid (PCI:0000:53:00): 48, "
     "DBE", x(48, "0000:53:00.0", utc="2026-11-20T10:15:01.250000")),
    ("journalctl short-iso", "2026-11-20T11:11:13+0100 gpu-node-17 kernel: NVRM: Xid (PCI:0000:53:00): 95, "
     "Uncontained", x(95, "0000:53:00.0", utc="2026-11-20T10:11:13")),
    ("journalctl short-iso-precise", "2026-11-20T10:11:12.123456+00:00 gpu-node-17 kernel: NVRM: Xid "
     "(PCI:0000:53:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
     x(154, "0000:53:00.0", utc="2026-11-20T10:11:12.123456",
       message="NVRM: Xid (PCI:0000:53:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
               "(Node Reboot Required)")),
    ("journalctl short-full", "Fri 2026-11-20 10:11:16 UTC gpu-node-17 kernel: NVRM: Xid (PCI:0000:75:00): "
     "74, pid=3301, name=python3, NVLink", x(74, "0000:75:00.0", pid=3301, process_name="python3",
                                              utc="2026-11-20T10:11:16")),
    ("journalctl short-unix", "1795169475.250000 gpu-node-17 kernel: NVRM: Xid (PCI:0000:41:00): 79, "
     "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     x(79, "0000:41:00.0", utc="2026-11-20T10:11:15.250000")),
    ("journalctl short-monotonic", "[ 5123.456789] gpu-node-17 kernel: NVRM: Xid (PCI:0000:ca:00): 92, "
     "ECC", x(92, "0000:ca:00.0", since_boot=5123.456789)),
    ("syslog with kernel stamp", "Nov 20 10:11:12 gpu-node-17 kernel: [ 5123.456789] NVRM: Xid "
     "(PCI:0000:ca:00): 92, pid=1888, name=python3, ECC",
     x(92, "0000:ca:00.0", pid=1888, process_name="python3", utc="2026-11-20T10:11:12")),
    ("NVSwitch SXid", "[   25.948274] nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 12028, Non-fatal, "
     "Link 32 egress non-posted PRIV error", {"kind": "sxid", "xid": 12028, "pci_bus_id": "0000:86:00.0",
                                             "since_boot": 25.948274}),
    ("NVSwitch SXid zero-padded", "nvidia-nvswitch0: SXid (PCI:0000:C3:00.0): 01004, Fatal, Link 4",
     {"kind": "sxid", "xid": 1004, "pci_bus_id": "0000:c3:00.0", "now": True}),
    ("fallen off the bus, driver line", "[ 6000.100010] NVRM: GPU 0000:1b:00.0: GPU has fallen off the bus.",
     {"kind": "fallen_off_bus", "xid": FALLEN_OFF_BUS_XID, "pci_bus_id": "0000:1b:00.0",
      "since_boot": 6000.10001}),
    ("fallen off the bus, GPU at PCI form", "NVRM: GPU at PCI:0000:1b:00: GPU-c24840ec-8de1-83d5-b126-"
     "08000173ae32 has fallen off the bus",
     {"kind": "fallen_off_bus", "xid": 79, "pci_bus_id": "0000:1b:00.0", "now": True,
      "uuid": "GPU-c24840ec-8de1-83d5-b126-08000173ae32"}),
    ("fallen off the bus, probe report in one kmsg record", "3,1200,5400000000,-;NVRM: The NVIDIA GPU "
     "0000:b9:00.0\\x0aNVRM: (PCI ID: 10de:2330) installed in this system has\\x0aNVRM: fallen off the "
     "bus and is not responding to commands.",
     {"kind": "fallen_off_bus", "xid": 79, "pci_bus_id": "0000:b9:00.0", "seq": 1200, "since_boot": 5400.0}),
]


@pytest.mark.parametrize("line, expected", [pytest.param(line, exp, id=name) for name, line, exp in LINES])
def test_every_line_form_yields_its_event(line, expected, host, utc):
    tally = ErrorTally("kmsg")
    events = events_of(line + "\n", host, tally)
    assert len(events) == 1
    assert_event(events[0], expected)
    assert events[0].line == line
    assert tally.snapshot() == {}


@pytest.mark.parametrize("line", [
    pytest.param("NVRM: GPU at PCI:0000:a8:00: GPU-3b6ec030-5adc-1847-e155-79f635584b4e", id="uuid line"),
    pytest.param("NVRM: GPU Board Serial Number: 1652923017935", id="serial line"),
    pytest.param(" SUBSYSTEM=pci", id="kmsg dictionary"),
    pytest.param(" DEVICE=+pci:0000:a8:00.0", id="kmsg dictionary device"),
    pytest.param("[   12.000000] usb 1-1: device has fallen off the hub", id="fallen off, not a GPU"),
    pytest.param("[    1.000000] random: crng init done, Xidian mirror", id="Xid inside a word"),
    pytest.param("4,1180,21034567,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.183.01", id="load"),
    pytest.param("-- Boot 6d1c2f0e9a8b4c7d8e9f0a1b2c3d4e5f --", id="journal boot separator"),
    pytest.param("", id="empty"),
])
def test_lines_that_report_nothing_yield_nothing_and_count_nothing(line, host):
    tally = ErrorTally("kmsg")
    assert events_of(line + "\n", host, tally) == []
    assert tally.snapshot() == {}


# -- whole logs ------------------------------------------------------------------------------------

EXPECTED = json.loads((FIXTURES / "expected-events.json").read_text())


@pytest.mark.parametrize("name", sorted(k for k in EXPECTED if not k.startswith("_")))
def test_fixture_logs_yield_exactly_their_events(name, host, utc):
    tally = ErrorTally("kmsg")
    with open(FIXTURES / name, encoding="utf-8", errors="replace") as stream:
        events = list(iter_events(stream, NOW, host_root=str(host), tally=tally))
    expected = EXPECTED[name]
    assert [(e.kind, e.xid) for e in events] == [(x["kind"], x["xid"]) for x in expected["events"]]
    for event, want in zip(events, expected["events"]):
        assert_event(event, want)
    assert tally.snapshot().get("parse", 0) == expected["parse_errors"]


def test_fixtures_cover_every_input_form():
    names = {p.name for p in FIXTURES.glob("*.txt")}
    assert names == {k for k in EXPECTED if not k.startswith("_")}


# -- bad input -------------------------------------------------------------------------------------

def test_malformed_xid_without_a_number_is_counted_and_dropped(host):
    tally = ErrorTally("kmsg")
    assert events_of("NVRM: Xid (PCI:zzzz): abc\n", host, tally) == []
    assert tally.snapshot() == {"parse": 1}


def test_malformed_pci_keeps_the_xid_with_an_empty_pci(host):
    tally = ErrorTally("kmsg")
    [event] = events_of("NVRM: Xid (PCI:zzzz): 79, GPU has fallen off the bus.\n", host, tally)
    assert (event.xid, event.pci_bus_id, event.kind) == (79, "", "xid")
    assert tally.snapshot() == {"parse": 1}


def test_pci_ids_are_canonical_through_the_model(host):
    """The parser never hand-rolls PCI forms: what it yields is canonical_pci_bus_id's output."""
    text = "".join(f"NVRM: Xid (PCI:{raw}): 13, x\n" for raw in ("0000:0A:1F", "0001:b3:00.3", "00:1e"))
    assert [e.pci_bus_id for e in events_of(text, host)] == [
        canonical_pci_bus_id("PCI:0000:0A:1F"), canonical_pci_bus_id("0001:b3:00.3"), canonical_pci_bus_id("00:1e")]
    assert [e.pci_bus_id for e in events_of(text, host)] == ["0000:0a:1f.0", "0001:b3:00.3", "0000:00:1e.0"]


def test_sxid_detail_lines_belong_to_their_headline_but_a_lone_detail_line_counts(host):
    text = ("nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 22013, Non-fatal, Link 02\n"
            "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 22013, Severity 0 Engine instance 02\n"
            "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 22013, Data {0x00000002}\n"
            "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 22013, Non-fatal, Link 03\n"
            "nvidia-nvswitch2: SXid (PCI:0000:06:00.0): 12028, Data {0x000001c0}\n")
    events = events_of(text, host)
    assert [(e.xid, e.pci_bus_id, e.message.split(", ", 1)[1][:8]) for e in events] == [
        (22013, "0000:05:00.0", "Non-fata"), (22013, "0000:05:00.0", "Non-fata"), (12028, "0000:06:00.0", "Data {0x")]


def test_dmesg_split_fallen_off_report_takes_address_and_stamp_from_the_lines_before(host):
    text = ("[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
            "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
            "               NVRM: fallen off the bus and is not responding to commands.\n")
    [event] = events_of(text, host)
    assert (event.kind, event.xid, event.pci_bus_id) == ("fallen_off_bus", 79, "0000:b3:00.0")
    assert event.timestamp == pytest.approx(BTIME + 1843.308145)


def test_fallen_off_without_any_address_is_kept_and_counted(host):
    tally = ErrorTally("kmsg")
    [event] = events_of("[   12.300000] NVRM: fallen off the bus\n", host, tally)
    assert (event.kind, event.pci_bus_id, event.timestamp) == ("fallen_off_bus", "", BTIME + 12.3)
    assert tally.snapshot() == {"parse": 1}



def test_a_huge_garbage_candidate_line_is_cut_counted_and_parsed_without_rescanning(host):
    """20k repeated "NVRM: Xid (" once cost minutes (a regex rescanned to the line end from
    every opening); now only the first 16 KiB are parsed and the regexes have bounded repeats."""
    tally = ErrorTally("kmsg")
    assert events_of("NVRM: Xid (" * 100_000 + "\n", host, tally) == []
    assert tally.snapshot() == {"oversized": 1, "parse": 1}
    [event] = events_of("NVRM: Xid (PCI:0000:a8:00): 94, pid=1, name=p, " + "x" * 100_000 + "\n", host)
    assert (event.xid, event.pci_bus_id, event.pid) == (94, "0000:a8:00.0", 1)

# -- time ------------------------------------------------------------------------------------------

def test_syslog_year_is_the_one_that_does_not_put_the_line_in_the_future(host, utc):
    new_year = datetime(2027, 1, 1, 0, 10, tzinfo=timezone.utc).timestamp()
    text = ("Dec 31 23:59:00 node kernel: NVRM: Xid (PCI:0000:53:00): 48, DBE\n"
            "Jan  1 00:09:00 node kernel: NVRM: Xid (PCI:0000:53:00): 48, DBE\n")
    first, second = iter_events(io.StringIO(text), new_year, host_root=str(host))
    assert datetime.fromtimestamp(first.timestamp, timezone.utc) == datetime(2026, 12, 31, 23, 59, tzinfo=timezone.utc)
    assert datetime.fromtimestamp(second.timestamp, timezone.utc) == datetime(2027, 1, 1, 0, 9, tzinfo=timezone.utc)


def test_boot_time_falls_back_from_btime_to_uptime_to_now(tmp_path):
    assert read_boot_time(str(tmp_path), NOW) == NOW
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "uptime").write_text("7245.31 1304155.80\n")
    assert read_boot_time(str(tmp_path), NOW) == pytest.approx(NOW - 7245.31)
    (tmp_path / "proc" / "stat").write_text("cpu  1 2 3\nbtime 1795150000\nprocesses 7\n")
    assert read_boot_time(str(tmp_path), NOW) == 1795150000
    (tmp_path / "proc" / "stat").write_text("cpu  1 2 3\nbtime garbage\n")
    assert read_boot_time(str(tmp_path), NOW) == pytest.approx(NOW - 7245.31)


def test_kmsg_stamps_use_boot_time_from_the_host_root(host):
    [event] = events_of("4,5,2500000,-;NVRM: Xid (PCI:0000:53:00): 48, DBE\n", host)
    assert event.timestamp == BTIME + 2.5


# -- the cursor ------------------------------------------------------------------------------------

def test_cursor_round_trips_and_empty_or_bad_dicts_are_fresh():
    cursor = KmsgCursor(boot_id="b", seq=1187, path="/host/dev/kmsg", inode=42, offset=9000)
    assert KmsgCursor.from_dict(json.loads(json.dumps(cursor.to_dict()))) == cursor
    assert KmsgCursor.from_dict({}) == KmsgCursor()
    assert KmsgCursor.from_dict(None) == KmsgCursor()
    assert KmsgCursor.from_dict({"seq": "12", "offset": -5, "inode": True, "boot_id": 7}) == KmsgCursor()


# -- never raises ----------------------------------------------------------------------------------

FRAGMENTS = st.sampled_from([
    "NVRM: Xid (", "PCI:", "0000:a8:00", ".0", "): ", "94", ", pid=", "'<unknown>'", ", name=", "<unknown>",
    "SXid (", "GPU-I:", "GPU-CI:", "fallen off the bus", "NVRM: The NVIDIA GPU ", "4,", "1187,", ";", "\\x0a",
    "[  12.5] ", "[Mon Nov 20 10:11:12 2026] ", "Nov 20 10:11:12 h kernel: ", "2026-11-20T10:11:12,5+0000 ",
    " SUBSYSTEM=pci", "#012", "\n", " ", ")", "(", ":", "Data {", "Severity 9",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(FRAGMENTS, st.text(max_size=12)), max_size=40))
def test_random_text_never_raises_from_iter_events(pieces):
    tally = ErrorTally("kmsg")
    events = list(iter_events(io.StringIO("".join(pieces)), NOW, host_root="/nonexistent", tally=tally))
    for event in events:
        assert isinstance(event.xid, int) and event.xid >= 0
        assert event.kind in ("xid", "sxid", "fallen_off_bus")
        assert event.pci_bus_id == "" or canonical_pci_bus_id(event.pci_bus_id) == event.pci_bus_id
        assert isinstance(event.timestamp, float)
