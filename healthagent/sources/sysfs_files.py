"""sysfs attribute files held open between collections and read with ``pread`` at offset 0.

Why: the EFA source reads every counter file of every device each collection (on a p5, 32
devices x 38 files: 1,216 reads every 10 s). ``open`` + ``read`` + ``close`` is three system
calls, a path walk and, on sysfs, a kernfs open file allocated and freed per file; a held
descriptor is one ``pread`` (``bench/bench_node_exporter`` measures both on real sysfs
attributes). A sysfs (kernfs) attribute is generated afresh by every read at offset 0, so a held
descriptor shows the current value.

Only sysfs attributes are held. Any other file (a fake or copied host root, the demo node, a
FIFO, a directory where a file belongs) is opened, read and closed on every call, as before: on a
regular file holding saves nothing measurable, and a file replaced at its path (renamed over)
would leave the agent reading the old one, and holding its inode allocated until it let go.
Whether a path is a sysfs attribute is asked once, at its first read (``fstatfs``), and again
only after the path was let go.

When a held descriptor stops reaching the file at its path it is opened again: kernfs answers
ENODEV once an attribute is removed (its device unregistered); ESTALE and EBADF are taken the same
way. The read is retried once on a fresh ``open``, whose error (ENOENT when the file is gone) is
what the caller sees. A path not read since the previous ``sweep`` is let go (its descriptor
closed) by the next one: the caller sweeps once per collection, so the files of a device that
went, or of a listing that changed, are not held. Every other error surfaces exactly as an
``open``/``read``/``close`` raises it: EACCES from the ``open``, EIO from a driver's read (the
descriptor is kept: the next read asks the driver again).

The number held is bounded (``descriptor_budget``): the open-file limit (RLIMIT_NOFILE's soft
value) less ``RESERVED_DESCRIPTORS`` for the rest of the process, at most ``MAX_HELD``. Past it,
files are read with ``open``/``read``/``close`` (the same values, more CPU), and the log says so
once.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import resource
import stat
from typing import Callable

log = logging.getLogger(__name__)

# More than a p5 needs (32 devices x 38 files) with room for larger hosts.
MAX_COUNTER_VALUE = 2**64 - 1  # sysfs counters are u64
MAX_HELD = 4096
# Descriptors left for everything else in the agent: the HTTP listeners and their connections,
# the kernel log, NVML's device files, the Kubernetes client's connections, the state file.
RESERVED_DESCRIPTORS = 512
# Errors of a read through a held descriptor that mean it no longer reaches the file at its path.
_REOPEN_ERRNOS = frozenset({errno.ENODEV, errno.ESTALE, errno.EBADF})
SYSFS_MAGIC = 0x62656572  # statfs(2) f_type of sysfs
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not block the caller
_NOT_HELD = -1  # a path read with open/read/close every time

Fstatfs = Callable[[int, ctypes.Array], int]


def read_once(path: str, size: int) -> bytes:
    """Open, read up to ``size`` bytes, close: for a file that is not held."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def descriptor_budget(reserved: int = RESERVED_DESCRIPTORS, most: int = MAX_HELD) -> int:
    """How many files may be held: the soft open-file limit less ``reserved``, within 0..``most``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return most
    return max(0, min(most, soft - reserved))


@functools.cache  # loaded on first use (no import side effect), once
def _libc_fstatfs() -> Fstatfs | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p)
    function.restype = ctypes.c_int
    return function


def on_sysfs(fd: int) -> bool:
    """Whether ``fd`` is a file on sysfs; False when that cannot be told (then it is not held)."""
    function = _libc_fstatfs()
    if function is None:
        return False
    buffer = ctypes.create_string_buffer(256)  # larger than struct statfs on every Linux ABI
    if function(fd, buffer) != 0:
        return False
    # f_type is the structure's first member, a C long (``__fsword_t``) on 64-bit ABIs.
    return ctypes.c_long.from_buffer(buffer).value == SYSFS_MAGIC


class HeldFiles:
    """Small files read whole (``size`` bytes at most), sysfs attributes through held descriptors.

    ``limit``: how many to hold (default ``descriptor_budget()``). ``what`` names the user in the
    one log line that says the limit was reached. ``holdable``: which open regular files to hold
    (default: those on sysfs; the tests of this module's bookkeeping on a tree of regular files
    pass another). Not thread-safe: one caller at a time.
    """

    def __init__(self, what: str, limit: int | None = None,
                 holdable: Callable[[int], bool] = on_sysfs) -> None:
        self.what = what
        self.limit = descriptor_budget() if limit is None else max(0, limit)
        self._holdable = holdable
        # path -> descriptor, or _NOT_HELD. ``_read`` has the paths read since the last sweep,
        # ``_unread`` the others; a sweep lets ``_unread`` go and starts a new round.
        self._read: dict[str, int] = {}
        self._unread: dict[str, int] = {}
        self.held = 0  # descriptors open now
        self.opened = 0  # descriptors opened to hold (a reopen counts again)
        self.reopened = 0  # of those, reopened because the held one no longer reached the file
        self.unheld_reads = 0  # reads made with open/read/close: not sysfs, or past the limit
        self._limit_logged = False

    def read(self, path: str, size: int) -> bytes:
        """Up to ``size`` bytes from the start of ``path``; raises OSError as ``open``/``read`` do."""
        fd = self._read.get(path)
        if fd is None:
            fd = self._unread.pop(path, None)
            if fd is None:
                return self._first_read(path, size)
            self._read[path] = fd
        if fd == _NOT_HELD:
            self.unheld_reads += 1
            return read_once(path, size)
        try:
            return os.pread(fd, size, 0)
        except OSError as exc:
            if exc.errno not in _REOPEN_ERRNOS:
                raise
        self.invalidate(path)  # unregistered under the descriptor
        self.reopened += 1
        return self._first_read(path, size)

    def _first_read(self, path: str, size: int) -> bytes:
        """Open ``path``; hold it when it is a sysfs attribute and the limit allows, else note that
        it is read with open/read/close from now on."""
        fd = os.open(path, _OPEN_FLAGS)
        keep = False
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode) and self._holdable(fd):
                if self.held < self.limit:
                    self._read[path] = fd
                    self.held += 1
                    self.opened += 1
                    keep = True  # also when this read fails: the next read asks the driver again
                    return os.pread(fd, size, 0)
                self._note_limit()
            self._read[path] = _NOT_HELD
            self.unheld_reads += 1
            return os.read(fd, size)
        finally:
            if not keep:
                os.close(fd)

    def _note_limit(self) -> None:
        if not self._limit_logged:
            self._limit_logged = True
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warning("source=%s held_files=%d open_file_limit=%s: the open-file limit leaves room to "
                        "hold %d files open; the others are opened and closed on every read (the same "
                        "values, more CPU). To hold them all, raise RLIMIT_NOFILE (the container "
                        "runtime's nofile limit) to %d more than the files to hold", self.what, self.held,
                        soft, self.limit, RESERVED_DESCRIPTORS)

    def invalidate(self, path: str) -> None:
        """Let ``path`` go (closing its descriptor, if held): the next read opens it again."""
        fd = self._read.pop(path, None)
        if fd is None:
            fd = self._unread.pop(path, None)
        self._close(fd)

    def sweep(self) -> None:
        """Let go of the paths not read since the previous sweep; start a new round."""
        unread, self._unread, self._read = self._unread, self._read, {}
        for fd in unread.values():
            self._close(fd)

    def close(self) -> None:
        """Close every held descriptor."""
        self.sweep()
        self.sweep()

    def held_paths(self) -> list[str]:
        """The paths held open now."""
        return [path for path, fd in (*self._read.items(), *self._unread.items()) if fd != _NOT_HELD]

    def _close(self, fd: int | None) -> None:
        if fd is not None and fd != _NOT_HELD:
            os.close(fd)
            self.held -= 1


def parse_counter(raw: bytes) -> int | None:
    """A sysfs counter's text as a non-negative u64, or None for anything else (empty, '-1', 'x')."""
    text = raw.strip()
    if not text or not text.isdigit() or len(text) > 20:
        return None
    value = int(text)
    return value if value <= MAX_COUNTER_VALUE else None
