"""The host's boot time, read from the host root: what turns kernel stamps into wall time.

Why: /dev/kmsg, dmesg and the ring through ``syslog(2)`` stamp records with time since boot, and a
text file (``/var/log/kern.log``) keeps earlier boots' lines, whose XIDs are history: a line whose
wall-clock stamp is before the boot (less ``BOOT_TIME_SLACK_SECONDS``) is an earlier boot's.
"""

from __future__ import annotations

from healthagent.sources.base import host_path

# A file line stamped more than this before the host's boot time is an earlier boot's. The margin
# covers btime's whole seconds and an early-boot clock step; the last line of the boot before is
# further back than that, since a GPU node's reboot (firmware POST included) takes minutes.
BOOT_TIME_SLACK_SECONDS = 60.0


def read_boot_time(host_root: str, now: float) -> float:
    """Wall-clock time of the host's boot: ``/proc/stat`` btime, else ``now - uptime``, else ``now``.

    /dev/kmsg and dmesg stamp records with time since boot; this turns them into wall time.
    """
    known = read_known_boot_time(host_root, now)
    return now if known is None else known


def read_known_boot_time(host_root: str, now: float) -> float | None:
    """``read_boot_time`` without the last resort: None when neither /proc/stat nor /proc/uptime
    can be read, so nothing is judged "before this boot" against a guess."""
    try:
        with open(host_path(host_root, "/proc/stat"), "rb") as fh:
            for _, line in zip(range(4096), fh):  # bounded: btime is near the end of a few KB
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(host_path(host_root, "/proc/uptime"), "rb") as fh:
            return now - float(fh.read(256).split()[0])
    except (OSError, ValueError, IndexError):
        return None
