"""Where reading the kernel log stopped, as the agent saves it across restarts.

Why one cursor for every input: the agent may restart on another input (privileged /dev/kmsg one
time, the ring through ``syslog(2)`` the next, a ``--kernel-log`` file), and the saved state must
let any reader resume without a repeat or a skip. It travels through the state file as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from healthagent.sources.kernel_log.ring import TAIL_LINES, RingPosition


@dataclass(frozen=True)
class KmsgCursor:
    """Where reading stopped: enough to resume after a restart without a repeat or a skip.

    ``seq``/``boot_id`` identify the last /dev/kmsg record handed over (sequence numbers restart
    at every boot, so they only mean something with the boot id). ``path``/``inode``/``offset``
    locate the next unread byte of a followed regular file; the inode also finds that file again
    after it was renamed away while the agent was down (``file_reader``). A cursor saved without
    an inode or a fingerprint (an older agent's) loads with them unset. ``usec``/``same`` are the last
    record's timestamp (microseconds since boot) and how many records in a row carried it: the
    klogctl reader has no sequence numbers, and the device reader keeps them too so a restart that
    switches between the two neither repeats nor skips. ``tail`` holds digests of the last lines
    the klogctl reader handed over: the last one, found again among the lines of its stamp after a
    restart, or the last eight, which stand in for a stamp when the kernel log has none
    (``printk.time`` off). ``fingerprint`` is a digest of a followed file's first bytes and the
    bytes before ``offset``: what tells, after a restart, whether the file at ``path`` is still the
    log the offset was in (a copy of it carries on; a truncated or rewritten one is read again).
    """

    boot_id: str = ""
    seq: int | None = None
    path: str = ""
    inode: int | None = None
    offset: int = 0
    usec: int | None = None
    same: int = 0
    tail: tuple[str, ...] = ()
    fingerprint: str = ""

    def to_dict(self) -> dict:
        """The JSON-ready form the state file keeps."""
        return {"boot_id": self.boot_id, "seq": self.seq, "path": self.path, "inode": self.inode,
                "offset": self.offset, "usec": self.usec, "same": self.same, "tail": list(self.tail),
                "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, data: Mapping | None) -> "KmsgCursor":
        """Rebuild a saved cursor; ``{}`` (or anything unusable) is a fresh cursor. Cursors saved
        before a field existed lack it and get its default."""
        if not isinstance(data, Mapping):
            return cls()

        def count(key: str) -> int | None:
            value = data.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

        def text(key: str) -> str:
            value = data.get(key)
            return value if isinstance(value, str) else ""

        tail = data.get("tail")
        digests = (tuple(tail[-TAIL_LINES:]) if isinstance(tail, list) and all(isinstance(d, str) for d in tail)
                   else ())
        usec = count("usec")
        return cls(boot_id=text("boot_id"), seq=count("seq"), path=text("path"), inode=count("inode"),
                   offset=count("offset") or 0, usec=usec,
                   same=(count("same") or 1) if usec is not None else 0, tail=digests,
                   fingerprint=text("fingerprint")[:64])

    def ring_position(self) -> RingPosition:
        """The part that holds without sequence numbers: what a resume by timestamp needs."""
        return RingPosition(usec=self.usec, same=self.same, tail=self.tail)
