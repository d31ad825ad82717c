"""Small sysfs files held open between collections and read with ``pread`` at offset 0.

Why: the EFA source reads every counter file of every device each collection (on a p5, 32
devices x ~38 files: ~1,200 reads every 10 s). ``open`` + ``read`` + ``close`` is three system
calls and a path walk per file; a held descriptor is one ``pread``, about 5x less time on real
sysfs. A sysfs (kernfs) attribute is generated afresh by every read at offset 0, so a held
descriptor shows the current value; a regular file (a fake or copied host root) shows its
current bytes to ``pread`` as well.

When a held descriptor stops being the file at its path, the file is opened again:

- kernfs answers ENODEV once an attribute is removed (its device unregistered); ESTALE and EBADF
  are taken the same way. The read is retried once on a fresh ``open``, whose error (ENOENT when
  the file is gone) is what the caller sees.
- A regular file replaced at its path (renamed over, unlinked) keeps its old bytes behind the
  held descriptor. Its link count drops to 0, which is checked before each read of a file that
  is not on sysfs (sysfs never replaces a file in place, and the check would double the cost).
- A file not read since the previous ``sweep`` is closed by the next one: the caller sweeps once
  per collection, so the files of a device that went, or of a listing that changed, are let go.

Every other error surfaces exactly as an ``open``/``read``/``close`` raises it: EACCES from the
``open``, EIO from a driver's read (the descriptor is kept: the next read asks the driver again).
Only regular files are held; anything else (a FIFO, a directory where a file belongs) is opened,
read and closed on every call, as before.

The number held is bounded (``descriptor_budget``): the open-file limit (RLIMIT_NOFILE's soft
value) less ``RESERVED_DESCRIPTORS`` for the rest of the process, at most ``MAX_HELD``. Past it,
files are read with ``open``/``read``/``close`` (the same values, slower), and the log says so
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

# More than a p5 needs (32 devices x ~38 files) with room for larger hosts.
MAX_HELD = 4096
# Descriptors left for everything else in the agent: the HTTP listeners and their connections,
# the kernel log, NVML's device files, the Kubernetes client's connections, the state file.
RESERVED_DESCRIPTORS = 512
# Errors of a read through a held descriptor that mean it no longer reaches the file at its path.
_REOPEN_ERRNOS = frozenset({errno.ENODEV, errno.ESTALE, errno.EBADF})
SYSFS_MAGIC = 0x62656572  # statfs(2) f_type of sysfs
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not block the caller

Fstatfs = Callable[[int, ctypes.Array], int]


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
    """Whether ``fd`` is a file on sysfs; False when that cannot be told (then it is checked like a
    regular file, which is always correct, only slower)."""
    function = _libc_fstatfs()
    if function is None:
        return False
    buffer = ctypes.create_string_buffer(256)  # larger than struct statfs on every Linux ABI
    if function(fd, buffer) != 0:
        return False
    # f_type is the structure's first member, a C long (``__fsword_t``) on 64-bit ABIs.
    return ctypes.c_long.from_buffer(buffer).value == SYSFS_MAGIC


class HeldFiles:
    """Files read whole (``size`` bytes at most) through descriptors held between reads.

    ``limit``: how many to hold (default ``descriptor_budget()``). ``what`` names the user in the
    one log line that says the limit was reached. Not thread-safe: one caller at a time.
    """

    def __init__(self, what: str, limit: int | None = None) -> None:
        self.what = what
        self.limit = descriptor_budget() if limit is None else max(0, limit)
        # path -> (descriptor, on sysfs). ``_read`` holds the files read since the last sweep,
        # ``_unread`` the others; a sweep closes ``_unread`` and starts a new round.
        self._read: dict[str, tuple[int, bool]] = {}
        self._unread: dict[str, tuple[int, bool]] = {}
        self.opened = 0  # descriptors opened to hold (a reopen counts again)
        self.reopened = 0  # of those, reopened because the held one no longer reached the file
        self.unheld_reads = 0  # reads made with open/read/close: not a regular file, or past the limit
        self._limit_logged = False

    @property
    def held(self) -> int:
        return len(self._read) + len(self._unread)

    def read(self, path: str, size: int) -> bytes:
        """Up to ``size`` bytes from the start of ``path``; raises OSError as ``open``/``read`` do."""
        entry = self._read.get(path)
        if entry is None:
            entry = self._unread.pop(path, None)
            if entry is None:
                return self._open_and_read(path, size)
            self._read[path] = entry
        fd, sysfs = entry
        try:
            if sysfs or os.fstat(fd).st_nlink:
                return os.pread(fd, size, 0)
        except OSError as exc:
            if exc.errno not in _REOPEN_ERRNOS:
                raise
        self.invalidate(path)  # gone from under the descriptor, or replaced at its path
        self.reopened += 1
        return self._open_and_read(path, size)

    def _open_and_read(self, path: str, size: int) -> bytes:
        fd = os.open(path, _OPEN_FLAGS)
        held = False
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            if regular and self.held < self.limit:
                self._read[path] = (fd, on_sysfs(fd))
                self.opened += 1
                held = True  # kept also when this read fails: the next read asks again
                return os.pread(fd, size, 0)
            if regular:
                self._note_limit()
            self.unheld_reads += 1
            return os.read(fd, size)
        finally:
            if not held:
                os.close(fd)

    def _note_limit(self) -> None:
        if not self._limit_logged:
            self._limit_logged = True
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warning("source=%s held_files=%d open_file_limit=%s: the open-file limit leaves room to "
                        "hold %d files open; the others are opened and closed on every read (the same "
                        "values, more CPU). Raise RLIMIT_NOFILE (the container runtime's nofile limit) to "
                        "at least %d to hold them all", self.what, self.held, soft, self.limit,
                        MAX_HELD + RESERVED_DESCRIPTORS)

    def invalidate(self, path: str) -> None:
        """Close ``path``'s held descriptor (if any): the next read opens the file again."""
        entry = self._read.pop(path, None) or self._unread.pop(path, None)
        if entry is not None:
            os.close(entry[0])

    def sweep(self) -> None:
        """Close the files not read since the previous sweep; start a new round."""
        unread, self._unread, self._read = self._unread, self._read, {}
        for fd, _ in unread.values():
            os.close(fd)

    def close(self) -> None:
        """Close every held descriptor."""
        self.sweep()
        self.sweep()
