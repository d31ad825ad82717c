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
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from healthagent.common import ErrorTally, atomic_write

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 * 1024 * 1024


class StateStore:
    """A JSON object on disk, shared by the loop thread and the effects thread.

    ``put`` serialises the value at once and keeps the text (so a caller mutating its dict later
    cannot change what is saved, and a value JSON cannot hold is refused at ``put``), ``get``
    parses that text (a fresh copy), ``flush`` joins the kept texts into the file's one object
    and writes it with temp file + fsync + rename + directory fsync, and skips the disk when
    nothing changed since the last write (a steady state costs no I/O). Each value is serialised
    once per ``put``: no defensive copy by a JSON round trip, no second serialisation at ``flush``.
    ``errors`` counts problems by kind: ``corrupt``, ``unreadable``, ``unwritable``,
    ``too_large``, ``not_json``.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._data: dict[str, str] = {}  # key -> its value as JSON text (_encode)
        self._lock = threading.Lock()  # guards _data
        self._flush_lock = threading.Lock()  # orders snapshot + rename between threads
        self._last_written: bytes | None = None
        self._tally = ErrorTally("state")

    @property
    def errors(self) -> dict[str, int]:
        return self._tally.snapshot()

    def load(self) -> dict[str, Any]:
        """Read the file; a missing file is an empty state, a corrupt one is moved aside.

        Returns a copy of what was loaded. Never raises.
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            data: dict[str, Any] = {}
            raw = None
        except OSError as exc:
            self._tally.count("unreadable", f"path={self.path} cannot read ({exc.strerror}); starting empty")
            data, raw = {}, None
        else:
            data = self._parse(raw)
        encoded = {str(key): _encode(value) for key, value in data.items()}
        with self._lock:
            self._data = encoded
            self._last_written = raw if data else None
        return data

    def _parse(self, raw: bytes) -> dict[str, Any]:
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict):
                raise ValueError("top level is not an object")
            return data
        except (ValueError, UnicodeDecodeError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            try:
                os.replace(self.path, aside)
                where = f"moved to {aside}"
            except OSError as move_exc:
                where = f"could not move aside ({move_exc.strerror})"
            self._tally.count("corrupt", f"path={self.path} is not a JSON object ({exc}); {where}; "
                                         "starting empty")
            return {}

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
        except (TypeError, ValueError) as exc:
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
            if len(payload) > self.max_bytes:
                self._tally.count("too_large", f"path={self.path} state is {len(payload)} bytes, over "
                                               f"{self.max_bytes}; not written")
                return False
            try:
                self._write(payload)
            except OSError as exc:
                self._tally.count("unwritable", f"path={self.path} cannot write ({exc.strerror or exc}); "
                                                "keeping state in memory")
                return False
            self._last_written = payload
            return True

    def _write(self, payload: bytes) -> None:
        atomic_write(self.path, payload)


def _encode(value: Any) -> str:
    """``value`` as compact JSON with sorted keys; raises TypeError/ValueError if JSON cannot hold it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
