"""Fuzz the folding of repeated reports (``kernel_log.repeats``) against the parser without it.

Each example is a read: kernel-log lines mixing /dev/kmsg records and text lines of a few XIDs on a
few GPUs, SXids, escaped records, malformed headers, user-space lines quoting an XID and noise,
in any order and any number. Folded, the read must say exactly what the parser says line by line:
the same reports with the same counts (``repeats`` summed per kind, XID, GPU), the same first
reports of each in the same order, at most ``kept + 1`` events per report, and the same errors
counted.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.parser import LogChunk, XidLineParser
from healthagent.sources.kernel_log.repeats import RepeatFolder, event_key

pytestmark = pytest.mark.reliability

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

report = st.tuples(st.sampled_from([13, 31, 94, 1234567890]), st.sampled_from(["0000:53:00", "0000:64:00", "zz"]))
line = st.one_of(
    st.builds(lambda r, seq, pid: f"4,{seq},{seq * 10},-;NVRM: Xid (PCI:{r[1]}): {r[0]}, pid={pid}, name=p, m",
              report, st.integers(0, 10**6), st.integers(0, 99)),
    st.builds(lambda r, seq: f"4,{seq},{seq},-;NVRM: Xid (PCI:{r[1]}): {r[0]}, x\\x0ay", report, st.integers(0, 99)),
    st.builds(lambda r: f"[ 12.5] NVRM: Xid (PCI:{r[1]}): {r[0]}, pid=1, name=p, m", report),
    st.builds(lambda r: f"Nov 20 10:11:12 node app[7]: NVRM: Xid (PCI:{r[1]}): {r[0]}, quoted", report),
    st.builds(lambda r: f"4,x,y,z;NVRM: Xid (PCI:{r[1]}): {r[0]}, bad header", report),
    st.builds(lambda n: f"4,{n},{n},-;nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 22013, Non-fatal, Link {n % 3}",
              st.integers(0, 99)),
    st.builds(lambda n: f"6,{n},{n},-;eth0: link flap {n}", st.integers(0, 99)),
    st.sampled_from(["4,1,1,-;NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x62:0xffff:1863)",
                     "3,2,2,-;NVRM: GPU 18:00.0: GPU has fallen off the bus."]),
)


def read(lines: list[str], folder: RepeatFolder | None, whole_records: bool):
    tally = ErrorTally("kmsg")
    parser = XidLineParser(tally, boot_time=1_795_150_000.0, now=1_795_176_000.0, boot_id="b", repeats=folder)
    events = list(parser.feed(LogChunk(lines, whole_records=whole_records)))
    return events + parser.take_repeats(), tally.snapshot()


@FUZZ
@given(st.lists(st.one_of(line, st.builds(lambda ln, n: [ln] * n, line, st.integers(1, 40))), max_size=60),
       st.integers(1, 4), st.booleans())
def test_folding_says_what_the_parser_says_line_by_line(parts, kept, whole_records):
    lines = [x for part in parts for x in (part if isinstance(part, list) else [part])]
    plain, plain_errors = read(lines, None, whole_records)
    folded, folded_errors = read(lines, RepeatFolder(kept), whole_records)
    counts = Counter()
    for event in folded:
        counts[event_key(event)] += event.repeats
    assert counts == Counter(event_key(e) for e in plain)
    per_report = Counter(event_key(e) for e in folded)
    assert all(n <= kept + 1 for n in per_report.values())
    seen: Counter = Counter()
    kept_whole = []
    for event in plain:  # the first ``kept`` reports of each, as the parser gives them
        seen[event_key(event)] += 1
        if seen[event_key(event)] <= kept:
            kept_whole.append((event_key(event), event.line))
    assert [(event_key(e), e.line) for e in folded if e.repeats == 1][:len(kept_whole)] == kept_whole
    assert folded_errors == plain_errors
