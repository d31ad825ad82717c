"""Follows a regular file of kernel-log text by byte offset: ``--kernel-log``, the demo's ``dev/kmsg``.

Why by offset: a file can be re-read from any point, so the cursor is the next unread byte (and the
file's inode, so a replaced file is not resumed at an offset into another). Rotation, truncation,
a partial last line (it waits for its newline) and undecodable bytes are handled; reading is in
chunks of ``FILE_CHUNK_BYTES``, so a flood costs bounded memory. A file may hold /dev/kmsg records
(the demo node) whose sequence numbers keep a re-read copy from being handed over twice, or text
(dmesg, syslog) that keeps earlier boots' lines (``keeps_earlier_boots``).
"""

from __future__ import annotations

import os

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.formats import decode_text, kmsg_header
from healthagent.sources.kernel_log.parser import SOURCE_NAME, LogChunk
from healthagent.sources.kernel_log.reader import Sink, is_char_device, log
from healthagent.sources.kernel_log.wording import describe_unreadable, file_mode

# Regular files are read in chunks of this size: a flood costs bounded memory, never a slurp.
FILE_CHUNK_BYTES = 1 << 20


class KernelLogFileReader:
    """A ``KernelLogReader`` over a regular file (kmsg records or dmesg/journal/syslog text)."""

    keeps_earlier_boots = True

    def __init__(self, path: str, fd: int, inode: int, offset: int, tally: ErrorTally,
                 last_seq: int | None, skip_upto: int | None) -> None:
        self.path = path
        self.fd = fd
        self.inode = inode
        self.offset = offset
        self.tally = tally
        self.description = file_mode(path)
        self.last_seq = last_seq
        # Records with seq <= skip_upto were handed over before: set while re-reading from 0.
        self.skip_upto = skip_upto
        self._discarding = False  # inside an over-long line, skipping to its end

    @classmethod
    def open(cls, path: str, saved: KmsgCursor, same_boot: bool, tally: ErrorTally,
             boot_id: str) -> "KernelLogFileReader":
        """Open the file, at the saved offset when it is the same file and still that long."""
        handed_over = saved.seq if same_boot else None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        inode = os.fstat(fd).st_ino
        size = os.fstat(fd).st_size
        # A byte offset is only trusted for the same file; for kmsg records (the cursor has a seq)
        # also only in the same boot, since a rebuilt file may reuse the inode number.
        same_file = saved.path == path and saved.inode == inode and (saved.seq is None or same_boot)
        resume = same_file and saved.offset <= size
        if same_file and not resume:
            tally.count("rotated", f"{path} is shorter than the saved offset {saved.offset} "
                                   f"(truncated while the agent was down); reading it from its start")
        offset = saved.offset if resume else 0
        log.info("source=%s event=open path=%s mode=file boot_id=%s offset=%d resume_after_seq=%s",
                 SOURCE_NAME, path, boot_id or "-", offset, None if resume else handed_over)
        return cls(path, fd, inode, offset, tally, last_seq=handed_over,
                   skip_upto=None if resume else handed_over)

    def read(self, budget: int, now: float, sink: Sink) -> bool:
        """Hand over up to ``budget`` complete lines; True when the budget ran out first."""
        done = 0
        while done < budget:
            chunk = os.pread(self.fd, FILE_CHUNK_BYTES, self.offset)
            if self._discarding:
                if self._skip_long_line(chunk):
                    continue
                return False
            end = chunk.rfind(b"\n")
            if end < 0:
                if len(chunk) >= FILE_CHUNK_BYTES:
                    self.tally.count("oversized", f"{self.path}: a line longer than {FILE_CHUNK_BYTES} "
                                                  f"bytes at offset {self.offset} was skipped")
                    self._discarding = True
                    continue
                if self._reopen_if_rotated():
                    continue
                return False  # caught up (a partial last line waits for its newline)
            data = chunk[:end + 1]
            count = data.count(b"\n")
            if count > budget - done:
                count = budget - done
                rest = data.split(b"\n", count)[-1]
                data = data[:len(data) - len(rest)]
            lines = decode_text(data, self.tally, f"{self.path} near offset {self.offset}").split("\n")
            lines.pop()  # after the final newline
            if self.skip_upto is not None:
                lines = self._drop_seen(lines)
            sink(LogChunk(lines))
            self._note_last_seq(lines)
            self.offset += len(data)
            done += count
        return True

    def _skip_long_line(self, chunk: bytes) -> bool:
        """Advance through an over-long line; True when there is more to read now."""
        newline = chunk.find(b"\n")
        if newline < 0:
            self.offset += len(chunk)
            return bool(chunk)
        self.offset += newline + 1
        self._discarding = False
        return True

    def _drop_seen(self, lines: list[str]) -> list[str]:
        """Drop kmsg records already handed over (seq <= skip_upto) from the front of ``lines``."""
        assert self.skip_upto is not None
        for index, line in enumerate(lines):
            head = kmsg_header(line)
            if head is None and line[:1] == " ":
                continue  # a dictionary line of a record being skipped
            if head is None or head.seq > self.skip_upto:
                self.skip_upto = None
                return lines[index:]
        return []

    def _note_last_seq(self, lines: list[str]) -> None:
        for line in reversed(lines[-16:]):  # a record has at most a few dictionary lines
            head = kmsg_header(line)
            if head is not None:
                self.last_seq = head.seq
                return

    def _reopen_if_rotated(self) -> bool:
        """At the end of the file: switch to a replacement file or restart a truncated one."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return False  # moved away and not yet replaced: keep the old one open
        if current.st_ino != self.inode:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            os.close(self.fd)
            self.fd, self.inode = fd, os.fstat(fd).st_ino
            self._restart(f"{self.path} was replaced (rotated); reading the new file from its start")
            return True
        if os.fstat(self.fd).st_size < self.offset:
            self._restart(f"{self.path} shrank below the read offset {self.offset} (truncated); "
                          f"reading it again from its start")
            return True
        return False

    def _restart(self, why: str) -> None:
        self.tally.count("rotated", why)
        log.info("source=%s event=rotated path=%s inode=%d", SOURCE_NAME, self.path, self.inode)
        self.offset = 0
        self._discarding = False
        self.skip_upto = self.last_seq  # a copy of records already read is not read twice

    def cursor(self, boot_id: str) -> KmsgCursor:
        return KmsgCursor(boot_id=boot_id, seq=self.last_seq, path=self.path, inode=self.inode,
                          offset=self.offset)

    def describe_failure(self, exc: OSError) -> str:
        # The path may have been replaced by a device since it was opened as a file.
        return describe_unreadable(self.path, exc, is_char_device(self.path))

    def close(self) -> None:
        os.close(self.fd)
