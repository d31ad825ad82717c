"""The kernel's ring buffer through the ``syslog(2)`` system call, for containers that may not open /dev/kmsg.

Why this exists: in a Kubernetes pod that is not privileged, ``open("/host/dev/kmsg")`` fails with
EPERM even with CAP_SYSLOG, because the container's device cgroup (the eBPF device filter runc
installs on cgroup v2) admits only the runtime's default device nodes and Kubernetes adds none for
a hostPath volume (node-problem-detector runs privileged for this reason, its issue #698). The
system call reads the same ring buffer without opening any device node, so no device cgroup is
involved. What it needs, from the sources:

- **syslog(2)** (man-pages, "syslog, klogctl - read and/or clear kernel message ring buffer"; the
  numbers are ``include/linux/syslog.h``): ``SYSLOG_ACTION_SIZE_BUFFER`` (10) returns the size of
  the kernel's log buffer; ``SYSLOG_ACTION_READ_ALL`` (3) "will read the last len bytes from the
  log buffer (nondestructively), but will not read more than was written into the buffer since
  the last 'clear ring buffer' command". Since Linux 2.6.37 these two need CAP_SYSLOG when
  ``/proc/sys/kernel/dmesg_restrict`` is 1 (Ubuntu's default) and nothing when it is 0. The
  kernel checks it with ``capable()`` (``check_syslog_permissions`` in ``kernel/printk/printk.c``),
  that is in the initial user namespace: a pod with ``hostUsers: false`` is refused; an LSM can
  still refuse through ``security_syslog`` (SELinux's ``syslog_read``).
  ``SYSLOG_ACTION_READ`` (2) consumes what it returns (it is what /proc/kmsg readers such as
  rsyslog's imklog use) and 4/5 clear the buffer: this module has no way to issue them.
- **Seccomp**: moby's ``profiles/seccomp/default.json`` allows ``syslog`` only when CAP_SYSLOG (or
  CAP_SYS_ADMIN) is in the bounding set (``"includes": {"caps": ["CAP_SYSLOG"]}``); containerd's
  ``contrib/seccomp/seccomp_default.go`` (the CRI's RuntimeDefault) adds it under
  ``case "CAP_SYSLOG"`` (releases before that allowed it unconditionally). Kubernetes'
  ``capabilities: {add: [SYSLOG]}`` puts CAP_SYSLOG in the bounding set, so RuntimeDefault lets
  the call through and the kernel's own capability check decides. Without the capability the
  profile answers EPERM before the kernel does; the fix is the same.

The output is text, one ``<pri>[secs.usecs] message`` line per line of a record (a multi-line
record repeats its prefix on every line, ``kernel/printk/printk.c``: "Each line will be preceded
with a prefix"; ``[...]`` is absent when ``printk.time`` is off), without /dev/kmsg's sequence
numbers, dictionary lines or ``\\xNN`` escaping. Each call costs the kernel a walk over every
record in the ring, however small ``len`` is (``syslog_print_all`` -> ``find_first_fitting_seq``
sums every record's length to find where the returned text starts), so the caller reads it at
most about once a second rather than at /dev/kmsg's polling rate. Which lines of successive
snapshots are new is ``ring``'s job; following them is ``ring_reader``'s.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any, Callable

from healthagent.sources.base import read_boot_id

SYSLOG_ACTION_READ_ALL = 3
SYSLOG_ACTION_SIZE_BUFFER = 10
# READ_ALL returns formatted text (a ``<4>[ 1234.567890] `` prefix per line), which can be longer
# than the stored records SIZE_BUFFER measures; twice the size always holds the whole ring.
READ_BUFFER_FACTOR = 2

Klogctl = Callable[[int, Any, int], int]
"""glibc's ``int klogctl(int type, char *bufp, int len)``: -1 with errno set on failure."""


def _libc_klogctl() -> Klogctl:
    """The C library's ``klogctl``; loading it is deferred to first use (no import side effect)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).klogctl
    except (OSError, AttributeError):
        raise OSError(errno.ENOSYS, "klogctl is not available in this C library") from None
    function.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char), ctypes.c_int)
    function.restype = ctypes.c_int
    return function


class KernelLog:
    """Non-destructive snapshots of the running kernel's ring buffer (READ_ALL), nothing else.

    ``klogctl`` is the function called (glibc's by default; tests pass a fake kernel with the same
    calling convention). ``boot_id`` is the boot of the kernel it reads (default: this machine's),
    so the caller can tell whether that kernel is the host root's.
    """

    def __init__(self, klogctl: Klogctl | None = None, boot_id: str | None = None) -> None:
        self._klogctl = klogctl
        self._boot_id = boot_id
        self._buffer: ctypes.Array | None = None

    def boot_id(self) -> str:
        return read_boot_id("/") if self._boot_id is None else self._boot_id

    def open(self) -> int:
        """Size the read buffer from SIZE_BUFFER (fixed for the boot); raises OSError when refused."""
        size = self._call(SYSLOG_ACTION_SIZE_BUFFER, None, 0)
        if size <= 0:
            raise OSError(errno.EIO, f"klogctl SIZE_BUFFER returned {size}")
        self._buffer = ctypes.create_string_buffer(size * READ_BUFFER_FACTOR)
        return size

    def read_all(self) -> bytes:
        """The whole ring as READ_ALL formats it, oldest line first; raises OSError when refused."""
        if self._buffer is None:
            self.open()
        assert self._buffer is not None
        count = self._call(SYSLOG_ACTION_READ_ALL, self._buffer, len(self._buffer))
        return ctypes.string_at(self._buffer, min(count, len(self._buffer)))

    def close(self) -> None:
        self._buffer = None

    def _call(self, action: int, buffer: ctypes.Array | None, length: int) -> int:
        if self._klogctl is None:
            self._klogctl = _libc_klogctl()
        result = self._klogctl(action, buffer, length)
        if result < 0:
            code = ctypes.get_errno() or errno.EIO
            raise OSError(code, os.strerror(code))
        return result

