"""Small helpers every layer uses: the error tally and the atomic file write.

They live here, apart from sources, policy, effects and telemetry, so none of those imports
another only for a helper.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class ErrorTally:
    """Cumulative error counts of one part (a source, the effects, the state file...), by kind,
    with rate-limited logging: a flood of bad input cannot flood the log.

    Thread-safe because the NVML event thread and the loop both count into the NVML tally.
    """

    source: str
    log_every_seconds: float = 60.0
    counts: Counter = field(default_factory=Counter)
    _last_logged: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, kind: str, message: str, n: int = 1) -> None:
        """Count ``n`` errors of ``kind`` and log the message at most once a minute per kind."""
        now = time.monotonic()
        with self._lock:
            self.counts[kind] += n
            last = self._last_logged.get(kind)
            should_log = last is None or now - last >= self.log_every_seconds
            if should_log:
                self._last_logged[kind] = now
            total = self.counts[kind]
        if should_log:
            log.warning("source=%s error=%s total=%d %s", self.source, kind, total, message)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def atomic_write(path: Path, payload: bytes, *, mtime_ns: int | None = None, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``payload`` all at once: a temp file in the same folder, fsync, rename
    (and the folder fsynced, so the rename itself is durable). A reader sees the old file or the
    new one, never a part; a crash leaves no temp file behind. ``mtime_ns`` sets the new file's
    modification time before the rename (a watcher that compares times sees every write).

    A write or fsync that fails (EIO, ENOSPC) raises and leaves the old file as it was: a file
    whose fsync failed is never renamed into place, and never fsynced again either (Linux reports
    a lost write-back once, then marks the pages clean: a second fsync would claim success for
    data that is gone). The temp file is dropped; the next write starts a new one."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync_dir:
        _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable; some filesystems cannot open a directory (ignored)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
