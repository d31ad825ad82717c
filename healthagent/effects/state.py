"""What must survive a restart or a SIGKILL: one small JSON file, written atomically.

The loop keeps the kernel-log cursor and the classifier's open findings here; the effects keep
what they applied to the node and when (the NoExecute grace start), the Event keys they emitted and
the Events not yet delivered. Each owner writes under its own top-level key (``kmsg_cursor``,
``classifier``, ``effects`` ...), and one ``flush`` writes them all together, so a crash leaves
either the old file or the new one, never a mix.

Why a file and not the API server: the agent must keep its decisions while the API server is down,
and there is no database (the node object and this file are the record). Why never raise: a health
agent that dies because its state disk is full or read-only is worse than one that keeps detecting
and tainting with what it has in memory; the failure is counted (``errors``) and logged instead.

The file is input like any other: what is loaded is only what this agent could have written. A
file that is not a regular file (a FIFO would block the start, a device would never end), larger
than ``max_bytes`` (the writer refuses those, so it was never ours, and keeping it would make every
later save fail), nested deeper than the state ever is, or not a JSON object is moved aside
(``<name>.corrupt``), counted and replaced by a clean start. A disk that fails (EIO on read, EIO or
ENOSPC on write, a failing fsync, an fsync that hangs) is counted and logged at most once a
minute per kind; the agent goes on detecting and acting with its state in memory, and the next
save tries again.

**The cap never costs a node action.** The state stays far under ``max_bytes`` by design: every
finding's subject taken from text or sysfs is bounded (``healthagent/bounded_names.py``) and so are
the histories. Should a state still outgrow the cap, what is written is trimmed, never skipped:
the classifier's findings are dropped mildest first (then the oldest), and its histories after
them, but a ``reboot_node`` or ``replace_node`` finding is never dropped; the drop is counted
``trimmed``. Only a state whose severe findings alone pass the cap is not written (``too_large``).
The trim touches only what is written: the state in memory stays whole.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

from healthagent.common import ErrorTally, atomic_write
from healthagent.model import Action

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64  # the state nests about ten deep; far deeper is garbage (and would exhaust the parser)
# The classifier's parts a trim may empty once its mild findings are gone (histories, pairing
# memory): losing them costs a restart some context, never a finding.
CLASSIFIER_HISTORIES = ("incidents", "gpus", "efa", "rdma", "known_gpus", "known_efa")
# How long a caller waits for one write. A healthy disk takes milliseconds; a dying one can hang
# an fsync for minutes, and the loop must go on detecting and the effects acting meanwhile.
WRITE_WAIT_SECONDS = 2.0


class Corrupt(ValueError):
    """The state file is not something this agent wrote; ``kind`` is the error kind it counts as."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


class StateStore:
    """A JSON object on disk, shared by the loop thread and the effects thread.

    ``put`` serialises the value at once and keeps the text (so a caller mutating its dict later
    cannot change what is saved, and a value JSON cannot hold is refused at ``put``), ``get``
    parses that text (a fresh copy), ``flush`` joins the kept texts into the file's one object
    and writes it with temp file + fsync + rename + directory fsync, and skips the disk when
    nothing changed since the last write (a steady state costs no I/O). Each value is serialised
    once per ``put``: no defensive copy by a JSON round trip, no second serialisation at ``flush``.
    A write that takes longer than ``write_wait_seconds`` goes on on its own thread while
    ``flush`` returns False; later flushes return False at once until it ends (one write at a time,
    so an older state never lands over a newer one).

    ``errors`` counts problems by kind: ``corrupt`` (moved aside: not a JSON object, nested too
    deep, not a regular file), ``too_large`` (at load: moved aside; at flush: not written),
    ``unreadable``, ``unwritable``, ``slow`` (a write not done in time), ``not_json``.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES,
                 write_wait_seconds: float = WRITE_WAIT_SECONDS) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.write_wait_seconds = write_wait_seconds
        self._writing: threading.Thread | None = None  # a write that outlived write_wait_seconds
        self._data: dict[str, str] = {}  # key -> its value as JSON text (_encode)
        self._lock = threading.Lock()  # guards _data
        self._flush_lock = threading.Lock()  # orders snapshot + rename between threads
        self._last_written: bytes | None = None
        self._last_over_cap: bytes | None = None  # the whole state whose trimmed form was written last
        self._tally = ErrorTally("state")

    @property
    def errors(self) -> dict[str, int]:
        return self._tally.snapshot()

    def load(self) -> dict[str, Any]:
        """Read the file; a missing file is an empty state, an unreadable one is counted, one this
        agent cannot have written is moved aside (see the module docstring).

        Returns a copy of what was loaded. Never raises.
        """
        data: dict[str, Any] = {}
        raw = None
        try:
            raw = self._read()
            data = _parse(raw)
            encoded = {str(key): _encode(value) for key, value in data.items()}
        except FileNotFoundError:
            encoded, raw = {}, None
        except Corrupt as exc:
            self._set_aside(exc.kind, str(exc))
            data, encoded, raw = {}, {}, None
        except OSError as exc:
            self._tally.count("unreadable", f"path={self.path} cannot read ({exc.strerror or exc}); starting empty")
            data, encoded, raw = {}, {}, None
        with self._lock:
            self._data = encoded
            self._last_written = raw if data else None
        return data

    def _read(self) -> bytes:
        """The file's bytes: at most ``max_bytes`` + 1 of them, from a regular file only. Opened
        without blocking, so a FIFO at the path cannot hold the agent's start."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):  # left alone: a person made it, the config check names it
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            if not stat.S_ISREG(info.st_mode):
                raise Corrupt("corrupt", "is not a regular file")
            if info.st_size > self.max_bytes:
                raise Corrupt("too_large", f"is {info.st_size} bytes, over {self.max_bytes}")
            chunks, size = [], 0
            while size <= self.max_bytes:
                chunk = os.read(fd, self.max_bytes + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        if size > self.max_bytes:  # it grew while being read
            raise Corrupt("too_large", f"is over {self.max_bytes} bytes")
        return b"".join(chunks)

    def _set_aside(self, kind: str, why: str) -> None:
        """Move the file this agent did not write to ``<name>.corrupt`` (kept for a person to
        look at; the next save writes a new file) and count it."""
        aside = self.path.with_name(self.path.name + ".corrupt")
        try:
            os.replace(self.path, aside)
            where = f"moved to {aside}"
        except OSError as exc:
            where = f"could not move aside ({exc.strerror or exc})"
        self._tally.count(kind, f"path={self.path} {why}; {where}; starting empty")

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            text = self._data.get(key)
        return default if text is None else json.loads(text)

    def put(self, key: str, value: Any) -> None:
        """Keep ``value`` (anything JSON can hold) under ``key``; written by the next ``flush``.

        A value JSON cannot hold is counted and dropped (the old value stays): the caller's bug
        must not make the whole file unwritable.
        """
        try:
            stored = _encode(value)
        except (TypeError, ValueError, RecursionError) as exc:
            self._tally.count("not_json", f"key={key} value is not JSON ({exc}); kept the old value")
            return
        with self._lock:
            self._data[key] = stored

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            data = dict(self._data)
        return {key: json.loads(text) for key, text in data.items()}

    def flush(self) -> bool:
        """Write atomically; True when the file on disk now holds the current state."""
        with self._flush_lock:
            with self._lock:
                # The same bytes as json.dumps(<the whole object>, sort_keys=True, separators=
                # (",", ":")): each value was serialised that way at put.
                payload = ("{" + ",".join(f"{json.dumps(key)}:{self._data[key]}" for key in sorted(self._data))
                           + "}").encode("utf-8")
            if payload == self._last_written:
                return True
            whole = payload
            if len(payload) > self.max_bytes:
                if whole == self._last_over_cap:
                    return True  # its trimmed form is what the file holds
                trimmed = self._trimmed(len(payload))
                if trimmed is None:
                    self._tally.count("too_large", f"path={self.path} state is {len(payload)} bytes, over "
                                                   f"{self.max_bytes}, even without its mild findings; "
                                                   "not written")
                    return False
                payload = trimmed
            if self._writing is not None and self._writing.is_alive():
                self._tally.count("slow", f"path={self.path} the previous write has not finished; keeping "
                                          "state in memory")
                return False
            done: list[bool] = []
            writer = threading.Thread(target=self._write_in_background, args=(payload, done),
                                      name="healthagent-state-write", daemon=True)
            writer.start()
            writer.join(self.write_wait_seconds)
            if writer.is_alive():
                self._writing = writer
                self._tally.count("slow", f"path={self.path} write not done after {self.write_wait_seconds:g} s "
                                          "(a failing disk?); going on with state in memory")
                return False
            written = bool(done and done[0])
            self._last_over_cap = whole if written and payload is not whole else None
            return written

    def _write_in_background(self, payload: bytes, done: list[bool]) -> None:
        """One write, on its own thread: a disk that hangs (a dying NVMe can take minutes to fail
        an fsync) holds this thread, never the loop or the effects."""
        try:
            self._write(payload)
        except OSError as exc:
            self._tally.count("unwritable", f"path={self.path} cannot write ({exc.strerror or exc}); "
                                            "keeping state in memory")
            done.append(False)
            return
        self._last_written = payload  # one write at a time: never an older payload over a newer
        done.append(True)

    def _trimmed(self, size: int) -> bytes | None:
        """The state to write when it is ``size`` bytes, over the cap: the classifier's findings
        mildest and oldest first, then its histories, dropped until it fits; never a finding of
        ``reboot_node`` or worse. None when it cannot fit."""
        with self._lock:
            data = dict(self._data)
        text = data.get("classifier")
        if text is None:
            return None
        classifier = json.loads(text)
        entries = (classifier.get("book") or {}).get("entries") if isinstance(classifier, dict) else None
        if not isinstance(entries, dict):
            return None
        excess = size - self.max_bytes
        dropped = 0
        for key in sorted(entries, key=lambda k: _trim_order(entries[k])):
            if excess <= 0 or _severity(entries[key]) >= Action.REBOOT_NODE.severity:
                break
            excess -= len(_encode(key)) + len(_encode(entries.pop(key))) + 2
            dropped += 1
        for part in CLASSIFIER_HISTORIES:
            if excess <= 0:
                break
            if part in classifier:
                before = len(_encode(classifier[part]))
                classifier[part] = {}
                excess -= before - 2
        data["classifier"] = _encode(classifier)
        payload = ("{" + ",".join(f"{json.dumps(key)}:{data[key]}" for key in sorted(data)) + "}").encode("utf-8")
        if len(payload) > self.max_bytes:
            return None
        self._tally.count("trimmed", f"path={self.path} state of {size} bytes is over {self.max_bytes}: "
                                     f"{dropped} mild finding(s) left out of the file (kept in memory; "
                                     "reboot_node and replace_node findings are always written)")
        return payload

    def _write(self, payload: bytes) -> None:
        atomic_write(self.path, payload)


def _severity(entry: Any) -> int:
    """A saved finding's action's severity; one that cannot be read counts as the most severe
    (kept: a trim must not guess a finding away)."""
    try:
        return Action.parse(entry["action"]).severity
    except (KeyError, TypeError, ValueError, AttributeError):
        return Action.REPLACE_NODE.severity


def _trim_order(entry: Any) -> tuple[int, float]:
    """Mildest first, then the least recently seen."""
    last_seen = entry.get("last_seen", 0.0) if isinstance(entry, dict) else 0.0
    return _severity(entry), float(last_seen) if isinstance(last_seen, (int, float)) else 0.0


def _parse(raw: bytes) -> dict[str, Any]:
    """The file's one JSON object; ``Corrupt`` for anything else."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise Corrupt("corrupt", f"is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's limit
        raise Corrupt("corrupt", f"is not a JSON object ({str(exc)[:120]})") from None
    if not isinstance(data, dict):
        raise Corrupt("corrupt", "is not a JSON object (top level is not an object)")
    if _deeper_than(data, MAX_DEPTH):  # the parser's limit is not ours: every reader after it recurses
        raise Corrupt("corrupt", f"nests deeper than {MAX_DEPTH} levels")
    return data


def _deeper_than(value: Any, limit: int) -> bool:
    """Does ``value`` nest more than ``limit`` containers deep? Walked without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _encode(value: Any) -> str:
    """``value`` as compact JSON with sorted keys; raises TypeError/ValueError if JSON cannot hold it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
