"""Every kernel-log reader behind the one interface: the same contract, input by input.

Each input is real where it can be: a file under tmp_path, the /dev/kmsg reader over a
SOCK_SEQPACKET socket (one record per read(), EAGAIN when empty, as ``test_kmsg_device.py`` reads
it), and the klogctl reader over ``FakeKernel`` (``tests/support/klog_kernel.py``), which answers
in READ_ALL's format. Opening again from a cursor stands for an agent restart: the device and the
ring hand the whole buffer over again, the file is the same file.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.device_reader import KmsgDeviceReader
from healthagent.sources.kernel_log.file_reader import KernelLogFileReader
from healthagent.sources.kernel_log.klogctl import KernelLog
from healthagent.sources.kernel_log.parser import LogChunk, XidLineParser
from healthagent.sources.kernel_log.reader import InputError, KernelLogReader
from healthagent.sources.kernel_log.ring import RingPosition
from healthagent.sources.kernel_log.ring_reader import KlogctlReader
from tests.support.klog_kernel import FakeKernel, line
from tests.support.kmsg_host import BOOT_A, BTIME, NOW, append, record, xid_text

ENOENT = FileNotFoundError(errno.ENOENT, "No such file or directory")


def text(n: int) -> str:
    """What record ``n`` says: an XID every third record, device noise otherwise."""
    return xid_text(94) if n % 3 == 0 else f"pci 0000:{n:02x}:00.0: enabling device (0000 -> 0002)"


class DeviceInput:
    """/dev/kmsg: every open reads the ring from its start; records logged later reach the reader
    that is open. Record ``n`` is stamped ``n`` ms after boot, as on every input here."""

    def __init__(self, tmp_path: Path) -> None:
        self.tally = ErrorTally("kmsg")
        self.records: list[int] = []
        self.sockets: list[socket.socket] = []

    def log(self, *numbers: int) -> None:
        self.records.extend(numbers)
        if self.sockets:
            self._send(self.sockets[-1], numbers)

    def open(self, saved: KmsgCursor = KmsgCursor(), same_boot: bool = True) -> KernelLogReader:
        ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        self.sockets += [ours, kernel]
        self._send(kernel, self.records)
        # What KmsgDeviceReader.open does with the cursor, on a descriptor that reads like /dev/kmsg.
        return KmsgDeviceReader("/dev/kmsg", os.dup(ours.fileno()), self.tally,
                                saved.seq if same_boot else None,
                                saved.ring_position() if same_boot else RingPosition())

    @staticmethod
    def _send(kernel: socket.socket, numbers) -> None:
        for n in numbers:
            kernel.send(record(n, text(n), "SUBSYSTEM=pci", usec=n * 1000, priority=4).encode())

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


class FileInput:
    """A dmesg-format file under tmp_path, appended to."""

    def __init__(self, tmp_path: Path) -> None:
        self.tally = ErrorTally("kmsg")
        self.path = tmp_path / "kern.log"
        self.path.write_text("")

    def log(self, *numbers: int) -> None:
        append(self.path, "".join(f"[{n / 1000:12.6f}] {text(n)}\n" for n in numbers))

    def open(self, saved: KmsgCursor = KmsgCursor(), same_boot: bool = True) -> KernelLogReader:
        return KernelLogFileReader.open(str(self.path), saved, same_boot, self.tally, BOOT_A)

    def close(self) -> None:
        pass


class RingInput:
    """The ring through klogctl: ``FakeKernel`` holds the lines READ_ALL returns."""

    def __init__(self, tmp_path: Path) -> None:
        self.tally = ErrorTally("kmsg")
        self.kernel = FakeKernel()

    def log(self, *numbers: int) -> None:
        self.kernel.log("".join(line(n * 1000, text(n)) for n in numbers))

    def open(self, saved: KmsgCursor = KmsgCursor(), same_boot: bool = True) -> KernelLogReader:
        return open_ring(self.kernel, saved, same_boot, self.tally)

    def close(self) -> None:
        pass


def open_ring(kernel: FakeKernel, saved: KmsgCursor = KmsgCursor(), same_boot: bool = False,
              tally: ErrorTally | None = None, poll_seconds: float = 0) -> KlogctlReader:
    return KlogctlReader.open(KernelLog(klogctl=kernel, boot_id=BOOT_A), saved, same_boot, tally or ErrorTally("kmsg"),
                              BOOT_A, device_path="/host/dev/kmsg", refusal=ENOENT, poll_seconds=poll_seconds)


INPUTS: dict[str, type[DeviceInput | FileInput | RingInput]] = {
    "device": DeviceInput, "file": FileInput, "klogctl": RingInput}


def read(reader: KernelLogReader, budget: int = 50) -> tuple[list[LogChunk], bool]:
    chunks: list[LogChunk] = []
    more = reader.read(budget, NOW, chunks.append)
    return chunks, more


def handed(chunks: list[LogChunk]) -> list[str]:
    """The message of each line handed over (whatever prefix its input gives it)."""
    return [text_of(line) for chunk in chunks for line in chunk.lines]


def text_of(raw: str) -> str:
    return raw.split(";", 1)[1] if raw[:1].isdigit() else raw.split("] ", 1)[1]


@pytest.fixture(params=sorted(INPUTS))
def source_input(request, tmp_path: Path):
    made = INPUTS[request.param](tmp_path)
    yield made
    made.close()


def test_a_reader_hands_over_every_record_once_in_order(source_input):
    source_input.log(1, 2, 3)
    reader = source_input.open()
    try:
        chunks, more = read(reader)
        assert (handed(chunks), more) == ([text(1), text(2), text(3)], False)
        parser = XidLineParser(ErrorTally("kmsg"), boot_time=BTIME, now=NOW)
        assert [e.xid for chunk in chunks for e in parser.feed(chunk)] == [94]
        assert read(reader) == ([], False)  # caught up: nothing is handed over twice
        source_input.log(4, 5)
        assert handed(read(reader)[0]) == [text(4), text(5)]
    finally:
        reader.close()
    assert source_input.tally.snapshot() == {}


def test_a_reader_stops_at_its_budget_and_carries_the_rest(source_input):
    source_input.log(*range(1, 8))
    reader = source_input.open()
    try:
        first, more = read(reader, budget=3)
        assert (handed(first), more) == ([text(1), text(2), text(3)], True)
        rest, more = read(reader)
        assert (handed(rest), more) == ([text(n) for n in range(4, 8)], False)
    finally:
        reader.close()


def test_a_reader_opened_on_its_cursor_resumes_after_it(source_input):
    source_input.log(1, 2, 3)
    reader = source_input.open()
    read(reader)
    saved = reader.cursor(BOOT_A)
    reader.close()
    assert saved.boot_id == BOOT_A
    source_input.log(4, 5)
    reader = source_input.open(KmsgCursor.from_dict(saved.to_dict()))
    try:
        chunks, _ = read(reader)
        assert handed(chunks) == [text(4), text(5)]
        # The kernel inputs hand the parser the lines before the resume point, for their context
        # only (an SXid headline); a file resumes by byte offset and reads none back.
        context = [text_of(raw) for chunk in chunks for raw in chunk.context]
        assert context == ([] if isinstance(reader, KernelLogFileReader) else [text(1), text(2), text(3)])
    finally:
        reader.close()


def test_a_reader_says_what_it_reads_and_why_it_cannot(source_input):
    reader = source_input.open()
    try:
        refused = PermissionError(errno.EPERM, "Operation not permitted")
        assert reader.description.split()[0] in ("/dev/kmsg", "file", "klogctl")
        assert "Operation not permitted" in reader.describe_failure(refused)
        assert reader.keeps_earlier_boots is isinstance(reader, KernelLogFileReader)
    finally:
        reader.close()


# -- what only one input does ----------------------------------------------------------------------

def test_the_file_reader_drains_a_rotated_file_then_reads_its_replacement(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text("[    1.000000] one\n")
    tally = ErrorTally("kmsg")
    reader = KernelLogFileReader.open(str(path), KmsgCursor(), False, tally, BOOT_A)
    try:
        assert handed(read(reader)[0]) == ["one"]
        append(path, "[    2.000000] two\n")
        path.rename(tmp_path / "kern.log.1")
        path.write_text("[    3.000000] three\n")
        assert handed(read(reader)[0]) == ["two", "three"]
        assert tally.snapshot() == {"rotated": 1}
        assert reader.cursor(BOOT_A).inode == path.stat().st_ino
    finally:
        reader.close()


def test_the_klogctl_reader_refused_too_names_the_missing_privilege():
    kernel = FakeKernel()
    kernel.refuse = errno.EPERM
    with pytest.raises(InputError) as refused:
        open_ring(kernel)
    assert refused.value.strerror.startswith("/host/dev/kmsg not found, and klogctl (syslog(2) READ_ALL) was "
                                             "refused too (Operation not permitted)")


def test_the_klogctl_reader_reads_the_ring_at_most_once_per_poll_interval():
    kernel = FakeKernel(line(1000, text(1)))
    reader = open_ring(kernel, poll_seconds=1)
    calls = len(kernel.actions)
    chunks: list[LogChunk] = []
    for now in (NOW, NOW + 0.5, NOW + 0.99):
        reader.read(50, now, chunks.append)
    assert handed(chunks) == [text(1)] and len(kernel.actions) == calls + 1
    kernel.log(line(2000, text(2)))
    reader.read(50, NOW + 1, chunks.append)
    assert handed(chunks) == [text(1), text(2)]
