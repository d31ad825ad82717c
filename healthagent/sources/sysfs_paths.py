"""Paths under a host root, resolved as the host would, and what identifies a sysfs device.

``resolve_in_root`` follows symlinks inside a host root (``--host-root``, as node_exporter's
``--path.rootfs``) as if it were ``/``: an absolute link target restarts at the root and ``..``
never climbs above it, so a hostile or broken link cannot make the agent read outside it.
``device_identity`` tells one registered device from the next at the same name (a driver reload
or hot plug gives a new inode generation), which is what lets a reader cache what a device is.
``errno_text`` words an error with its errno name, so a log line or health detail says exactly
which error made a part unobserved (ELOOP and EACCES call for different fixes).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Callable

MAX_SYMLINKS = 40  # as the kernel's own limit on links followed in one lookup

# Called with every path a reader is about to look at: raises the OSError a test wants sysfs to
# answer. For faults a real part cannot be made to show: EIO on demand, and EACCES when the tests
# run as root (root reads a mode-000 directory). None in production.
FaultHook = Callable[[str], None]


def resolve_in_root(root: str, path: str, touch: FaultHook | None = None) -> str:
    """Resolve ``path`` (relative to ``root``) following symlinks as if ``root`` were ``/``.

    Absolute link targets restart at ``root`` and ``..`` never climbs above it, so whatever the
    links say, the answer is a path under ``root``. Raises OSError (ELOOP on a link cycle,
    ENOENT/EACCES as the filesystem says) like ``open`` would.
    """
    root = os.path.abspath(root)
    pending = [p for p in path.split("/") if p not in ("", ".")]
    pending.reverse()
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root, *resolved, part)
        if touch is not None:
            touch(candidate)
        st = os.lstat(candidate)
        if not stat.S_ISLNK(st.st_mode):
            resolved.append(part)
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), candidate)
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = []
        parts = [p for p in target.split("/") if p not in ("", ".")]
        pending.extend(reversed(parts))
    return os.path.join(root, *resolved)


def errno_text(exc: OSError) -> str:
    """``exc`` as its errno name and the system's words: ``ELOOP: Too many levels of symbolic
    links``; only the words (or the message) when it carries no errno."""
    reason = exc.strerror or str(exc)
    name = errno.errorcode.get(exc.errno) if isinstance(exc.errno, int) else None
    return f"{name}: {reason}" if name else reason


def device_identity(class_entry: str, device_dir: str) -> tuple:
    """What tells one registered device from the next at the same name: the class link's target,
    the device directory's (device, inode, ctime) and its ``device`` link's target. Raises OSError
    when any of them is gone."""
    st = os.lstat(device_dir)
    return (_link_target(class_entry), device_dir, st.st_dev, st.st_ino, st.st_ctime_ns,
            _link_target(os.path.join(device_dir, "device")))


def _link_target(path: str) -> str:
    """A symlink's target text; "" for an entry that is not a link (EINVAL)."""
    try:
        return os.readlink(path)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return ""
        raise
