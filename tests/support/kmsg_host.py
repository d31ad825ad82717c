"""Kernel-log test material: a tmp host root shaped like a node (``dev/kmsg``, ``proc/stat``,
``proc/sys/kernel/random/boot_id``), /dev/kmsg records and XID lines to write into it, the
/dev/kmsg reader driven as ``KmsgSource`` drives it, and checks run in a forked (unprivileged) child.
"""

from __future__ import annotations

import codecs
import json
import os
from pathlib import Path
from typing import Callable

from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.device_reader import KmsgDeviceReader
from healthagent.sources.kernel_log.file_reader import FINGERPRINT_BYTES, fingerprint
from healthagent.sources.kernel_log.parser import XidLineParser
from healthagent.sources.kernel_log.ring import RingPosition
from healthagent.sources.kernel_log.source import KmsgSource


BTIME = 1795150000
NOW = 1795176000.0
BOOT_A = "6d1c2f0e-9a8b-4c7d-8e9f-0a1b2c3d4e5f"
BOOT_B = "0b7e51a2-33c4-4d15-9e26-7f3801a2b4c6"


# -- a host root -----------------------------------------------------------------------------------

def make_host(root: Path, boot_id: str = BOOT_A, kmsg_text: str | None = "") -> Path:
    (root / "proc" / "sys" / "kernel" / "random").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "sys" / "kernel" / "random" / "boot_id").write_text(boot_id + "\n")
    (root / "proc" / "stat").write_text(f"cpu  1 2 3 4 5 6 7 0 0 0\nbtime {BTIME}\nprocesses 9\n")
    (root / "dev").mkdir(exist_ok=True)
    if kmsg_text is not None:
        (root / "dev" / "kmsg").write_text(kmsg_text)
    return root


def record(seq: int, text: str, *fields: str, usec: int | None = None, priority: int = 6) -> str:
    """One /dev/kmsg record with its dictionary lines."""
    usec = seq * 1000 if usec is None else usec
    return f"{priority},{seq},{usec},-;{text}\n" + "".join(f" {f}\n" for f in fields)


def file_fingerprint(path: Path) -> str:
    """The fingerprint of a whole file read to its end: its first and last bytes."""
    data = path.read_bytes()
    return fingerprint(data[:FINGERPRINT_BYTES], data[-FINGERPRINT_BYTES:])


def xid_text(xid: int, bus: str = "a8") -> str:
    return f"NVRM: Xid (PCI:0000:{bus}:00): {xid}, pid=4242, name=python, seq-test"


def boot_log(first: int, last: int, xids: dict[int, int]) -> str:
    """Records ``first..last``; the seqs in ``xids`` are XID records, the rest is device noise."""
    return "".join(
        record(seq, xid_text(xids[seq]), priority=4) if seq in xids
        else record(seq, f"pci 0000:{seq % 256:02x}:00.0: enabling device (0000 -> 0002)",
                    "SUBSYSTEM=pci", f"DEVICE=+pci:0000:{seq % 256:02x}:00.0")
        for seq in range(first, last + 1))


def append(path: Path, text: str | bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(text.encode() if isinstance(text, str) else text)


def seqs(result) -> list[int]:
    return [e.seq for e in result.xids]


def backlogged(result) -> bool:
    """The detail names the input, plus "backlog: ..." while the per-cycle cap left records unread."""
    return "; backlog: " in result.health.detail


def restart(source: KmsgSource, host: Path, **kw) -> KmsgSource:
    """What the agent does across a restart: save the cursor as JSON, build a new source from it."""
    saved = json.loads(json.dumps(source.cursor.to_dict()))
    source.close()
    return KmsgSource(str(host), cursor=KmsgCursor.from_dict(saved), **kw)


class DeviceFollower:
    """The /dev/kmsg reader feeding a parser, as ``KmsgSource`` drives the two: ``read`` appends
    the events of up to ``budget`` records and says whether the budget ran out first."""

    def __init__(self, path: str, fd: int, parser: XidLineParser, tally: ErrorTally, resume_after: int | None,
                 saved: RingPosition = RingPosition()) -> None:
        self.reader = KmsgDeviceReader(path, fd, tally, resume_after, saved)
        self.parser = parser

    def read(self, budget: int, events: list) -> bool:
        return self.reader.read(budget, self.parser.now, lambda chunk: events.extend(self.parser.feed(chunk)))

    def cursor(self, boot_id: str) -> KmsgCursor:
        return self.reader.cursor(boot_id)

    def close(self) -> None:
        self.reader.close()


def run_forked(prepare: Callable[[], None], check: Callable[[], object]) -> object:
    """``check()``'s JSON-able result, computed in a forked child after ``prepare()`` (which gives up
    privileges for good; the child never returns into pytest)."""
    codecs.lookup("ascii")  # the child may not be able to load codecs from root's Python install
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            prepare()
            os.write(writer, json.dumps(check()).encode())
        except BaseException as exc:  # noqa: BLE001 - handed to the parent, which fails the test
            os.write(writer, json.dumps({"child_error": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(writer)
    os.waitpid(pid, 0)
    with os.fdopen(reader, "rb") as fh:
        reply = json.loads(fh.read())
    assert not (isinstance(reply, dict) and "child_error" in reply), reply
    return reply


def run_unprivileged(check: Callable[[], object]) -> object:
    """``check()``'s result as uid/gid 65534: in a forked child when this is root, else right here."""
    if os.geteuid() != 0:
        return json.loads(json.dumps(check()))

    def drop_root() -> None:
        os.setgid(65534)
        os.setuid(65534)

    return run_forked(drop_root, check)
