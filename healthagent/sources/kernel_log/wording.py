"""Every sentence an operator reads about the kernel-log input: what is read, and why not.

Why in one place: the same refusal reaches the operator from several inputs (a missing /dev/kmsg,
a device cgroup's EPERM, klogctl without CAP_SYSLOG), and each sentence must name the fix (the
privilege, the mount, ``--kernel-log``) the same way wherever it comes from.
"""

from __future__ import annotations

import errno

from healthagent.sources.kernel_log.reader import DEFAULT_KMSG
from healthagent.sources.sysfs_paths import errno_text


# -- the input in use -----------------------------------------------------------------------------

def device_mode(path: str) -> str:
    """/dev/kmsg (or a character device given in its place) is read."""
    return f"/dev/kmsg ({path})"


def file_mode(path: str) -> str:
    """A regular file is followed (a ``--kernel-log`` file, the demo node's ``dev/kmsg``)."""
    return f"file {path}"


def klogctl_mode(why: str, refusal: OSError) -> str:
    """The ring read through klogctl, because the default input was refused (``why``)."""
    mode = f"klogctl (syslog(2) READ_ALL), because {why}"
    if refusal.errno in (errno.EPERM, errno.EACCES):
        mode += (": a container that is not privileged may not open the device; klogctl needs "
                 "CAP_SYSLOG only")
    return mode


def backlog(max_records: int) -> str:
    """Appended to the mode while a cycle stopped at its cap."""
    return f"; backlog: {max_records} records read this cycle (the cap); the rest follow next cycle"


# -- why it cannot be read ------------------------------------------------------------------------

def describe_unreadable(path: str, exc: OSError, device: bool) -> str:
    """One line an operator can act on, for a kernel log that cannot be opened or read."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, FileNotFoundError):
        hint = (" (mount the host's /dev/kmsg into the pod, or pass --kernel-log FILE)"
                if path.endswith(DEFAULT_KMSG) else "")
        return f"{path} not found{hint}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        if device or path.endswith(DEFAULT_KMSG):
            return (f"permission denied reading {path} ({reason}): reading the kernel log needs "
                    f"CAP_SYSLOG (kernel.dmesg_restrict) and device access; run the agent's container "
                    f"privileged or add CAP_SYSLOG, with the host's /dev/kmsg mounted")
        return f"permission denied reading {path} ({reason})"
    return f"cannot read {path}: {errno_text(exc)}"  # ELOOP, EIO, ENOTDIR: the errno names the fault


def describe_device_refusal(path: str, exc: OSError) -> str:
    """Why the default input was not opened, in a few words (the start of the fallback's detail)."""
    if isinstance(exc, FileNotFoundError):
        return f"{path} not found"
    return f"permission denied reading {path} ({exc.strerror or exc})"


def describe_both_unreadable(device_detail: str, exc: OSError) -> str:
    """Neither /dev/kmsg nor klogctl: name the privilege that is missing."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EPERM, errno.EACCES):
        return (f"{device_detail}, and klogctl (syslog(2) READ_ALL) was refused too ({reason}): reading "
                f"the kernel log needs CAP_SYSLOG (kernel.dmesg_restrict=1); add it to the container "
                f"(capabilities add SYSLOG, as uid 0, with a seccomp profile that allows syslog, as "
                f"RuntimeDefault does then), which is enough for klogctl, or run the container "
                f"privileged to open /dev/kmsg")
    return (f"{device_detail}, and klogctl (syslog(2) READ_ALL) failed too ({reason}); run the container "
            f"privileged to open /dev/kmsg, or pass --kernel-log FILE")


def describe_klogctl_not_tried(device_detail: str, kernel_boot_id: str, host_root: str,
                               host_boot_id: str) -> str:
    """klogctl reads this machine's kernel, and the host root is another boot (a copy, a demo)."""
    return (f"{device_detail} (klogctl not tried: it reads this machine's kernel, boot id "
            f"{kernel_boot_id}, and {host_root} is boot {host_boot_id})")


def describe_not_a_log(path: str) -> str:
    """A directory, socket or pipe where a kernel log was expected: only a path fixes that."""
    return f"{path} is neither a regular file nor a character device; pass a kernel-log file or /dev/kmsg"
