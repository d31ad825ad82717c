"""Follows a regular file of kernel-log text by byte offset: ``--kernel-log``, the demo's ``dev/kmsg``.

Why by offset: a file can be re-read from any point, so the cursor is the next unread byte. A
partial last line waits for its newline, undecodable bytes are replaced and counted, and reading
is in chunks of ``FILE_CHUNK_BYTES``, so a flood costs bounded memory. A file may hold /dev/kmsg
records (the demo node) whose sequence numbers keep a re-read copy from being handed over twice,
or text (dmesg, syslog) that keeps earlier boots' lines (``keeps_earlier_boots``).

**Which log is it?** Not the path, not the size: a log is identified by its inode plus a
fingerprint of what was read of it (its first ``FINGERPRINT_BYTES`` and the ``FINGERPRINT_BYTES``
before the offset). Before every chunk the fingerprint is checked where the bytes were:

- the same inode, the bytes still there: read on;
- the bytes changed (truncated, or truncated and at once rewritten longer than the offset): the
  file is another log now, read from its start (records already handed over, by sequence
  number, are skipped; a text file's lines are all new);
- another inode at the path (rotation): a file whose first bytes and the bytes before the offset
  are the old file's is a copy of it plus new lines (``cp`` + append + ``mv`` over the path): read
  on at the same offset, so nothing is handed over twice; any other file is a new log, read from
  its start;
- the file left at the old inode (renamed away) is kept open and *drained* before the new one on
  every read, for as long as something still appends to it and ``RETIRED_IDLE_SECONDS`` after
  that: a writer that has not reopened the log yet (syslog before its HUP) loses no line.

The cursor saves the fingerprint as a digest, so a restart tells the same way whether the file at
the path is the log it stopped in (resume at the offset), whatever its inode.

**Rotated while the agent was down.** The cursor also keeps the inode it stopped in. When the
file at the path is another log after a restart, the log the cursor stopped in was most likely
renamed away (logrotate's ``kern.log`` -> ``kern.log.1``) with lines the agent never read, the
last ones before the rotation. So the directory's entries whose names start with the log's name
are looked at (``lstat``, at most ``MAX_ROTATED_CANDIDATES``): a regular file on the same
filesystem with the saved inode, at least as long as the saved offset, and holding the saved
fingerprint there, is that log: it is opened and its unread end read before the new file, as a
file renamed away under a running agent is. Only an uncompressed rotation can be found (a ``.gz``
is another inode); a log that cannot be found, or a directory that cannot be listed (its errno
logged), leaves those lines unread, and the new file is read from its start as before. While such
a file's end is being read and nothing of the new file is, the cursor stays in it, so a second
restart finds it again.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from dataclasses import dataclass, field

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.formats import decode_text, kmsg_header
from healthagent.sources.kernel_log.parser import SOURCE_NAME, LogChunk
from healthagent.sources.kernel_log.reader import Sink, is_char_device, log
from healthagent.sources.kernel_log.wake import InotifyWaiter, file_waiter
from healthagent.sources.kernel_log.wording import describe_unreadable, file_mode
from healthagent.sources.sysfs_paths import errno_text

# Regular files are read in chunks of this size: a flood costs bounded memory, never a slurp.
FILE_CHUNK_BYTES = 1 << 20
# Bytes of a log's start, and before the read offset, that identify it (with its inode).
FINGERPRINT_BYTES = 1024
# A file renamed away is drained until nothing was appended to it for this long.
RETIRED_IDLE_SECONDS = 30.0
# Renamed-away files drained at once; an older one is closed when a newer rotation comes.
MAX_RETIRED = 2
# Directory entries looked at for the log the cursor stopped in (kern.log.1, kern.log-20260101...).
MAX_ROTATED_CANDIDATES = 64


def fingerprint(head: bytes, tail: bytes) -> str:
    """The digest the cursor keeps of a log's first bytes and the bytes before the offset."""
    if not head and not tail:
        return ""
    digest = hashlib.sha256()
    for part in (head, tail):
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return digest.hexdigest()[:32]


@dataclass
class _Followed:
    """One open file and where reading stands in it: the next byte, and the bytes that identify
    what was read: ``head`` is always the file's bytes ``[0, min(offset, FINGERPRINT_BYTES))`` and
    ``tail`` the ``FINGERPRINT_BYTES`` (or fewer, near the start) before ``offset``."""

    fd: int
    inode: int
    offset: int = 0
    head: bytes = b""
    tail: bytes = b""
    discarding: bool = False  # inside an over-long line, skipping to its end
    idle_since: float = field(default_factory=time.monotonic)

    def consumed(self, data: bytes) -> None:
        if len(self.head) < FINGERPRINT_BYTES:  # then offset == len(head): data goes on from there
            self.head += data[:FINGERPRINT_BYTES - len(self.head)]
        self.tail = data[-FINGERPRINT_BYTES:] if len(data) >= FINGERPRINT_BYTES else \
            (self.tail + data)[-FINGERPRINT_BYTES:]
        self.offset += len(data)

    def skipped(self, count: int) -> None:
        """Bytes passed over unread (an over-long line): head and tail read again where they are."""
        self.offset += count
        self.head, self.tail = _fingerprint_bytes(self.fd, self.offset)

    def holds(self) -> bool:
        """The bytes read so far are still where they were read: the same log."""
        return _same(self.fd, 0, self.head) and _same(self.fd, self.offset - len(self.tail), self.tail)

    def adopt(self, other: "_Followed") -> bool:
        """Take over ``other``'s place when this file starts with what was read of it (a copy plus
        new lines); False, untouched, when it does not."""
        if other.offset == 0 or not (_same(self.fd, 0, other.head)
                                     and _same(self.fd, other.offset - len(other.tail), other.tail)):
            return False
        self.offset, self.head, self.tail = other.offset, other.head, other.tail
        return True

    def restart(self) -> None:
        self.offset, self.head, self.tail, self.discarding = 0, b"", b"", False

    def fingerprint(self) -> str:
        return fingerprint(self.head, self.tail)


def _fingerprint_bytes(fd: int, offset: int) -> tuple[bytes, bytes]:
    """(head, tail) of a file read up to ``offset``, as ``_Followed`` keeps them."""
    size = min(offset, FINGERPRINT_BYTES)
    return os.pread(fd, size, 0), os.pread(fd, size, offset - size)


def _same(fd: int, offset: int, expected: bytes) -> bool:
    return not expected or os.pread(fd, len(expected), offset) == expected


def _renamed_away(path: str, saved: KmsgCursor, current: _Followed, tally: ErrorTally) -> _Followed | None:
    """The log the cursor stopped in, renamed away in the same directory while the agent was down
    (module docstring), opened at the saved offset; None when it is not there or cannot be told."""
    if saved.inode is None or saved.inode == current.inode:
        return None  # an old cursor without its inode, or the same file truncated in place
    directory, name = os.path.split(path)
    try:
        device = os.fstat(current.fd).st_dev
        with os.scandir(directory or ".") as entries:
            candidates = sorted(e.path for e in entries if e.name.startswith(name) and e.name != name)
    except OSError as exc:  # the lines are unobserved: said, never taken for read
        log.warning("source=%s event=rotated_while_down path=%s error=%s: the directory cannot be listed "
                    "to find the log the agent stopped in; its unread lines stay unread", SOURCE_NAME, path,
                    errno_text(exc))
        return None
    for candidate in candidates[:MAX_ROTATED_CANDIDATES]:
        try:
            info = os.lstat(candidate)
        except OSError:
            continue  # rotated again or removed while being looked at
        if (info.st_ino != saved.inode or info.st_dev != device or not stat.S_ISREG(info.st_mode)
                or info.st_size < saved.offset):
            continue
        found = _open_at(candidate, saved)
        if found is not None:
            tally.count("rotated", f"{path} was rotated while the agent was down; reading the "
                                   f"{info.st_size - saved.offset} unread bytes of {candidate} first")
            log.info("source=%s event=rotated_while_down path=%s renamed=%s inode=%d offset=%d", SOURCE_NAME,
                     path, candidate, saved.inode, saved.offset)
            return found
    return None


def _open_at(candidate: str, saved: KmsgCursor) -> _Followed | None:
    """``candidate`` opened at the saved offset when it is the saved log (inode, and fingerprint
    when the cursor has one); None otherwise."""
    try:
        fd = os.open(candidate, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        followed = _Followed(fd, os.fstat(fd).st_ino, offset=saved.offset)
        followed.head, followed.tail = _fingerprint_bytes(fd, saved.offset)
        if followed.inode == saved.inode and (not saved.fingerprint
                                              or followed.fingerprint() == saved.fingerprint):
            return followed
    except OSError:
        pass  # unreadable now: its lines stay unread, as if it had not been found
    os.close(fd)
    return None


class KernelLogFileReader:
    """A ``KernelLogReader`` over a regular file (kmsg records or dmesg/journal/syslog text)."""

    keeps_earlier_boots = True

    def __init__(self, path: str, followed: _Followed, tally: ErrorTally, last_seq: int | None,
                 skip_upto: int | None) -> None:
        self.path = path
        self.file = followed
        self.retired: list[_Followed] = []  # renamed away, drained while something appends to them
        self.tally = tally
        self.description = file_mode(path)
        self.last_seq = last_seq
        # Records with seq <= skip_upto were handed over before: set while re-reading from 0.
        self.skip_upto = skip_upto

    @property
    def inode(self) -> int:
        return self.file.inode

    @property
    def offset(self) -> int:
        return self.file.offset

    @classmethod
    def open(cls, path: str, saved: KmsgCursor, same_boot: bool, tally: ErrorTally,
             boot_id: str) -> "KernelLogFileReader":
        """Open the file, at the saved offset when it is the log the cursor stopped in."""
        handed_over = saved.seq if same_boot else None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        followed = _Followed(fd, os.fstat(fd).st_ino)
        resume = cls._resumes(followed, path, saved, same_boot)
        renamed = None
        if resume:
            followed.offset = saved.offset
            followed.head, followed.tail = _fingerprint_bytes(fd, saved.offset)
        elif saved.path == path and (saved.seq is None or same_boot):
            renamed = _renamed_away(path, saved, followed, tally)
            if renamed is None and saved.offset:
                tally.count("rotated", f"{path} is not the log the saved offset {saved.offset} was in (truncated "
                                       f"or replaced while the agent was down); reading it from its start")
        log.info("source=%s event=open path=%s mode=file boot_id=%s offset=%d resume_after_seq=%s",
                 SOURCE_NAME, path, boot_id or "-", followed.offset, None if resume else handed_over)
        reader = cls(path, followed, tally, last_seq=handed_over, skip_upto=None if resume else handed_over)
        if renamed is not None:
            reader._retire(renamed)
        return reader

    @staticmethod
    def _resumes(followed: _Followed, path: str, saved: KmsgCursor, same_boot: bool) -> bool:
        """Is this file the log the cursor stopped in? By its fingerprint when the cursor has one
        (whatever the inode: a copy of the log carries on), else (a cursor saved before there was
        one) by path and inode. For kmsg records (the cursor has a seq) only in the same boot,
        since a rebuilt file may reuse the inode number and the bytes."""
        if saved.seq is not None and not same_boot:
            return False
        size = os.fstat(followed.fd).st_size
        if saved.offset > size or saved.path != path:
            return False
        if saved.fingerprint:
            return fingerprint(*_fingerprint_bytes(followed.fd, saved.offset)) == saved.fingerprint
        return saved.inode == followed.inode

    def read(self, budget: int, now: float, sink: Sink) -> bool:
        """Hand over up to ``budget`` complete lines, those of a renamed-away log first; True when
        the budget ran out first."""
        done = self._drain_retired(budget, sink)
        while done < budget:
            if not self.file.holds():
                self._restart(f"{self.path} was truncated or rewritten (the bytes already read changed); "
                              f"reading it again from its start")
            count, more = self._read_lines(self.file, budget - done, sink, current=True)
            done += count
            if not more and not self._reopen_if_rotated():
                return False  # caught up (a partial last line waits for its newline)
        return True

    def _read_lines(self, followed: _Followed, budget: int, sink: Sink, current: bool) -> tuple[int, bool]:
        """Complete lines of ``followed`` from its offset, one chunk at most: (lines handed over,
        whether there may be more to read now). Only the ``current`` file skips records already
        handed over: a renamed-away file holds only what was appended to it."""
        chunk = os.pread(followed.fd, FILE_CHUNK_BYTES, followed.offset)
        if followed.discarding:
            return 0, self._skip_long_line(followed, chunk)
        end = chunk.rfind(b"\n")
        if end < 0:
            if len(chunk) >= FILE_CHUNK_BYTES:
                self.tally.count("oversized", f"{self.path}: a line longer than {FILE_CHUNK_BYTES} "
                                              f"bytes at offset {followed.offset} was skipped")
                followed.discarding = True
                return 0, True
            return 0, False
        data = chunk[:end + 1]
        count = data.count(b"\n")
        if count > budget:
            count = budget
            rest = data.split(b"\n", count)[-1]
            data = data[:len(data) - len(rest)]
        lines = decode_text(data, self.tally, f"{self.path} near offset {followed.offset}").split("\n")
        lines.pop()  # after the final newline
        if current and self.skip_upto is not None:
            lines = self._drop_seen(lines)
        sink(LogChunk(lines))
        self._note_last_seq(lines)
        followed.consumed(data)
        followed.idle_since = time.monotonic()
        return count, True

    def _skip_long_line(self, followed: _Followed, chunk: bytes) -> bool:
        """Advance through an over-long line; True when there is more to read now."""
        newline = chunk.find(b"\n")
        if newline < 0:
            followed.skipped(len(chunk))
            return bool(chunk)
        followed.skipped(newline + 1)
        followed.discarding = False
        return True

    def _drain_retired(self, budget: int, sink: Sink) -> int:
        """What was appended to renamed-away logs since the last read; each is closed once nothing
        was appended to it for ``RETIRED_IDLE_SECONDS``."""
        done = 0
        for followed in list(self.retired):
            more = True
            while more and done < budget:
                count, more = self._read_lines(followed, budget - done, sink, current=False)
                done += count
            if not more and time.monotonic() - followed.idle_since >= RETIRED_IDLE_SECONDS:
                self.retired.remove(followed)
                os.close(followed.fd)
        return done

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
                if self.last_seq is None or head.seq > self.last_seq:
                    self.last_seq = head.seq
                return

    def _reopen_if_rotated(self) -> bool:
        """At the end of the file: switch to the file now at the path when it is another inode
        (keeping the old one to drain). True when there is something new to read."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return False  # moved away and not yet replaced: keep the old one open
        if current.st_ino == self.file.inode:
            return False
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        replacement = _Followed(fd, os.fstat(fd).st_ino)
        old = self.file
        self.file = replacement
        self._retire(old)
        if replacement.adopt(old):
            self.tally.count("rotated", f"{self.path} was replaced by a copy of itself; reading on after the "
                                        f"{old.offset} bytes already read")
            log.info("source=%s event=rotated path=%s inode=%d copy_of_previous=true offset=%d",
                     SOURCE_NAME, self.path, replacement.inode, replacement.offset)
        else:
            self._restart(f"{self.path} was replaced (rotated); reading the new file from its start")
        return True

    def _retire(self, followed: _Followed) -> None:
        followed.idle_since = time.monotonic()
        self.retired.append(followed)
        while len(self.retired) > MAX_RETIRED:
            os.close(self.retired.pop(0).fd)

    def _restart(self, why: str) -> None:
        self.tally.count("rotated", why)
        log.info("source=%s event=rotated path=%s inode=%d", SOURCE_NAME, self.path, self.file.inode)
        self.file.restart()
        self.skip_upto = self.last_seq  # a copy of records already read is not read twice

    def cursor(self, boot_id: str) -> KmsgCursor:
        at = self._resume_point()
        return KmsgCursor(boot_id=boot_id, seq=self.last_seq, path=self.path, inode=at.inode,
                          offset=at.offset, fingerprint=at.fingerprint())

    def _resume_point(self) -> _Followed:
        """Where a restart must go on: the current file, unless nothing of it was read yet while a
        renamed-away file still has bytes unread; then that file (a restart finds it by inode)."""
        if self.file.offset == 0:
            for followed in self.retired:
                if os.fstat(followed.fd).st_size > followed.offset:
                    return followed
        return self.file

    def describe_failure(self, exc: OSError) -> str:
        # The path may have been replaced by a device since it was opened as a file.
        return describe_unreadable(self.path, exc, is_char_device(self.path))

    def data_waiter(self) -> InotifyWaiter | None:
        """inotify on the file and its name (``wake``); None where inotify cannot be had."""
        return file_waiter(self.path)

    def close(self) -> None:
        for followed in self.retired:
            os.close(followed.fd)
        self.retired = []
        os.close(self.file.fd)
