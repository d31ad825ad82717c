"""The policy file's one error type and how its messages show keys and values.

Its own module so that every part of the policy file's reader (``settings``, ``debounce_file``)
raises the same error and writes keys the same way without importing one another."""

from __future__ import annotations

import re
from typing import Any

from healthagent.config import shown

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class PolicyError(Exception):
    """A bad policy file; ``str()`` is one line naming the key and the fix."""


def shown_key(key: Any) -> str:
    """A key as an error message names it: as written when it is a plain name, else quoted and
    bounded (``config.shown``), so a key holding a newline or other control characters cannot
    break the one-line message."""
    text = key if isinstance(key, str) else shown(key)
    return text if _PLAIN_KEY.fullmatch(text) else shown(text)


def written_value(value: Any) -> str:
    """A value as an error message shows it: quoted as written, at most 40 characters, never
    rendered whole (``config.shown``)."""
    return shown(value, 40)
