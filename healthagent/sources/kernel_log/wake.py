"""What the loop sleeps on between cycles: new data in the kernel log, or a ring of its doorbell.

Why: a kernel log read every 0.1 s whether or not anything was written costs a cycle ten times a
second on an idle node, and still makes a fault wait for the next look (50 ms on average). Each
kind of input can say when it has data instead, so the loop sleeps until then, or until a
periodic source is due, or until something else rings its ``Doorbell`` (NVML's event thread, a
stop request):

- ``/dev/kmsg`` (a character device): ``poll(2)`` for POLLIN on the reader's own descriptor. The
  kernel reports it readable while records after that descriptor's position exist, so a record
  logged after the last read wakes the loop at once (``ReadableWaiter``).
- a regular file (``--kernel-log``, the demo's ``dev/kmsg``): inotify on the file (appends,
  truncation; also after it is renamed away, so the rest of a rotated log is drained) and on its
  directory for its name (a new file put at the path: rotation) (``InotifyWaiter``). Where inotify
  cannot be had (no such call in the C library, the per-user limit of inotify instances reached),
  the reader offers no waiter and the loop polls every ``kmsg_poll_seconds``.
- the ring through ``syslog(2)``: nothing to wait on; it is read at most every ``poll_seconds``
  anyway, so the loop is woken on that tick (``TickWaiter``).

A waiter may wake the loop for data it has already read (a write it saw while the loop was
reading): that costs one cycle that finds nothing. It never sleeps through data: each is set up
before the reader's first read, and ``poll`` and inotify queue what happens while the loop works.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import select
import struct
import threading
import time
from typing import Protocol

log = logging.getLogger("healthagent.sources.kmsg")

# inotify(7)
IN_MODIFY = 0x00000002
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
_NAME_EVENTS = IN_CREATE | IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE
# Files watched for appends: the one at the path and the ones renamed away before it, as many as the
# file reader drains at once (it keeps two) plus the current one.
MAX_FILE_WATCHES = 3


class Doorbell:
    """A ``threading.Event`` that a ``poll(2)`` can wait on beside a file: ``set`` also makes an
    eventfd readable. Safe to ``set`` from any thread and from a signal handler."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def fileno(self) -> int:
        return self._fd

    def set(self) -> None:
        self._flag.set()
        try:
            os.eventfd_write(self._fd, 1)
        except BlockingIOError:
            pass  # the counter is full: it is readable already

    def is_set(self) -> bool:
        return self._flag.is_set()

    def clear(self) -> None:
        self._flag.clear()  # first: a set() from now on is seen, by the flag or the descriptor
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass

    def wait(self, timeout: float | None = None) -> bool:
        return self._flag.wait(timeout)

    def __del__(self) -> None:
        # Closed only when nothing refers to it any more, so no set() can write to a reused number.
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)


class DataWaiter(Protocol):
    """Sleeps until the kernel log may have new data to read."""

    def wait(self, timeout: float, bell: Doorbell | None = None) -> bool:
        """Block for at most ``timeout`` seconds; True when the input may have new data or ``bell``
        rang (then return at once), False when the time ran out first."""
        ...

    def close(self) -> None:
        """Release what the waiter holds (never the reader's own descriptor)."""
        ...


def _poll(fds: list[int], timeout: float, bell: Doorbell | None) -> set[int]:
    """The descriptors among ``fds`` (and the bell's) that became readable within ``timeout``."""
    if bell is not None and bell.is_set():
        return {bell.fileno()}
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLPRI)
    if bell is not None:
        poller.register(bell.fileno(), select.POLLIN)
    millis = max(0, math.ceil(timeout * 1000))  # never rounded down to a busy loop
    return {fd for fd, _ in poller.poll(millis)}


class ReadableWaiter:
    """``/dev/kmsg``: woken when the reader's descriptor has records past its position (or reports
    an error such as records overwritten, which the next read counts)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def wait(self, timeout: float, bell: Doorbell | None = None) -> bool:
        return bool(_poll([self.fd], timeout, bell))

    def close(self) -> None:
        """The descriptor is the reader's; it closes it."""


class TickWaiter:
    """An input nothing can wait on: woken every ``interval`` seconds (monotonic), or by the bell."""

    def __init__(self, interval: float) -> None:
        self.interval = max(0.0, interval)
        self._next = time.monotonic() + self.interval

    def wait(self, timeout: float, bell: Doorbell | None = None) -> bool:
        pause = min(timeout, self._next - time.monotonic())
        rang = False
        if pause > 0:
            if bell is not None:
                rang = bell.wait(pause)
            else:
                time.sleep(pause)
        if rang or time.monotonic() >= self._next:
            self._next = time.monotonic() + self.interval
            return True
        return False

    def close(self) -> None:
        pass


class _Inotify:
    """The three inotify(7) calls of the C library, loaded when first needed."""

    def __init__(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self.init1, self.add_watch, self.rm_watch = libc.inotify_init1, libc.inotify_add_watch, libc.inotify_rm_watch
        except (OSError, AttributeError):
            raise OSError(errno.ENOSYS, "inotify is not available in this C library") from None
        self.init1.argtypes, self.init1.restype = (ctypes.c_int,), ctypes.c_int
        self.add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        self.add_watch.restype = ctypes.c_int
        self.rm_watch.argtypes, self.rm_watch.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno() or errno.EIO
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


class InotifyWaiter:
    """A regular file: woken when it is written or truncated (also after it was renamed away), or
    when a file is created, moved or deleted at its name in its directory."""

    def __init__(self, path: str, calls: _Inotify | None = None) -> None:
        self.path = os.path.abspath(path)
        self._dir, name = os.path.split(self.path)
        self._name = os.fsencode(name)
        self._calls = calls or _Inotify()
        self.fd = _check(self._calls.init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
        self._file_watches: list[int] = []  # newest last
        try:
            _check(self._calls.add_watch(self.fd, os.fsencode(self._dir), _NAME_EVENTS | IN_ONLYDIR),
                   f"inotify_add_watch {self._dir}")
            self._watch_file()
        except OSError:
            os.close(self.fd)
            raise

    def _watch_file(self) -> None:
        """Watch the file now at the path for appends (a missing one is watched once created)."""
        wd = self._calls.add_watch(self.fd, os.fsencode(self.path), IN_MODIFY)
        if wd < 0:
            return  # gone between the reader's open and now: its name's IN_CREATE comes next
        if wd in self._file_watches:
            self._file_watches.remove(wd)
        self._file_watches.append(wd)
        while len(self._file_watches) > MAX_FILE_WATCHES:
            self._calls.rm_watch(self.fd, self._file_watches.pop(0))

    def wait(self, timeout: float, bell: Doorbell | None = None) -> bool:
        ready = _poll([self.fd], timeout, bell)
        if self.fd not in ready:
            return bool(ready)
        return self._take_events() or bool(ready - {self.fd})

    def _take_events(self) -> bool:
        """Read every queued event; True when one says the followed log may have data."""
        relevant = renamed = False
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                break
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size:offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    relevant = renamed = True  # events were lost: look at everything again
                elif mask & IN_IGNORED:
                    if wd in self._file_watches:
                        self._file_watches.remove(wd)  # the file was deleted: its watch is gone
                elif wd in self._file_watches:
                    relevant = True
                elif name == self._name:
                    relevant = renamed = True
        if renamed:
            self._watch_file()  # another file at the path now
        return relevant

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def file_waiter(path: str) -> InotifyWaiter | None:
    """An inotify waiter for the file at ``path``; None (and a log line saying why) where inotify
    cannot be had: the caller then polls."""
    try:
        return InotifyWaiter(path)
    except OSError as exc:
        log.info("source=kmsg event=no_inotify path=%s error=%r: reading the file every kmsg_poll_seconds "
                 "instead of when it is written", path, exc.strerror or str(exc))
        return None
