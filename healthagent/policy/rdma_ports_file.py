"""The policy file's ``rdma_ports:`` section: which InfiniBand/RoCE ports must be up, and at what rate.

Without it the port rules judge a port only against itself and its siblings: a port is down when
it *was* up, degraded when it runs below the best rate it or a sibling of the same card model ran
at. That leaves two holes an operator can close by saying what the node is built as:

- a port that has never been up since the agent first saw it (a node that came back from repair
  with a cable not plugged in, the agent's state file lost) is not judged at all;
- a node whose ports all came up at the same lower rate (a switch firmware roll-out, the wrong
  cables fitted to a whole rack) has no sibling to compare with.

Each key is a pattern (``fnmatch``: ``*``, ``?``, ``[0-7]``) matched against the port's name
(``mlx5_3/1``) or its network interface (``ibp75s0``); the first pattern in file order that
matches a port decides for it, so a specific line above a general one overrides it. A key with no
pattern characters names one port: if the RDMA source lists its devices and that port is not among
them, it is judged down too (unless the port could not be read, which is *unobserved*)::

    rdma_ports:
      "mlx5_[0-7]/1": {up: true, rate_gbps: 400}   # the eight compute rails of a DGX H100
      "mlx5_8/1": {up: true}                        # the storage port, rate left to its siblings
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Callable

from healthagent.config import shown

MAX_PATTERNS = 256  # far above a real node's ports; a bound for a file generated wrong
MAX_RATE_GBPS = 3200.0  # 8 lanes of XDR (800 Gb/s 4X) and then some: a typo past it is an error
KEYS = ("up", "rate_gbps")
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class PortExpectation:
    """What the operator says a matching port must be: up, and at least ``rate_gbps``."""

    pattern: str
    up: bool = False
    rate_gbps: float | None = None

    @property
    def names_one_port(self) -> bool:
        """A pattern without wildcards: that port must exist, not only be up when it does."""
        return not (_GLOB_CHARS & set(self.pattern))

    def matches(self, name: str, netdev: str = "") -> bool:
        return fnmatch.fnmatchcase(name, self.pattern) or bool(netdev) and fnmatch.fnmatchcase(netdev, self.pattern)


def expectation_for(expectations: tuple[PortExpectation, ...], name: str, netdev: str = "") -> PortExpectation | None:
    """The first expectation whose pattern matches the port, or None."""
    return next((e for e in expectations if e.matches(name, netdev)), None)


def parse_rdma_ports(raw: Any, error: Callable[[str], Exception]) -> tuple[PortExpectation, ...]:
    """Validate the section; ``error`` builds the exception (one line naming the key and the fix)."""
    if raw is None:
        return ()
    example = '{"mlx5_[0-7]/1": {up: true, rate_gbps: 400}}'
    if not isinstance(raw, dict):
        raise error(f"rdma_ports: must be a mapping of port pattern: {{up, rate_gbps}}, e.g. {example}")
    if len(raw) > MAX_PATTERNS:
        raise error(f"rdma_ports: {len(raw)} patterns; use at most {MAX_PATTERNS} (a pattern such as "
                    "mlx5_*/1 covers many ports)")
    out = []
    for key, value in raw.items():
        if not isinstance(key, str) or not key.strip() or len(key) > 64 or not key.isprintable():
            raise error(f"rdma_ports: {shown(key)} is not a port pattern; use a port name or pattern "
                        "of at most 64 characters such as mlx5_0/1, mlx5_*/1 or ibp*")
        pattern = key.strip()
        problem = never_matches(pattern)
        if problem:
            raise error(f"rdma_ports.{pattern}: {problem}")
        out.append(_expectation(pattern, value, error))
    return tuple(out)


# What a port's name holds: sysfs names its devices in printable ASCII (mlx5_0, ibp75s0), and a
# bracket set that takes none of these characters can match no port.
_NAME_CHARS = tuple(chr(c) for c in range(0x21, 0x7F))
_DIGITS = frozenset("0123456789")
_FIX_RANGE = "write a range from low to high, e.g. [0-7]"


def _tokens(pattern: str) -> list[tuple[str, frozenset[str]]]:
    """The pattern as ``fnmatch`` reads it, one token per character it matches: ``("*", ...)``,
    or ``(text, chars)``, ``chars`` the characters of a port name that token can be (a literal,
    ``?`` or a bracket set, whose meaning is asked of ``fnmatch`` itself, so the two never
    disagree). A ``[`` without its ``]`` is a literal, as in ``fnmatch``."""
    out: list[tuple[str, frozenset[str]]] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            out.append(("*", frozenset(_NAME_CHARS)))
        elif c == "?":
            out.append(("?", frozenset(_NAME_CHARS)))
        elif c == "[":
            j = i + (i < n and pattern[i] == "!")
            j += j < n and pattern[j] == "]"
            end = pattern.find("]", j)
            if end < 0:
                out.append((c, frozenset(c)))
                continue
            span = pattern[i - 1:end + 1]
            out.append((span, frozenset(ch for ch in _NAME_CHARS if fnmatch.fnmatchcase(ch, span))))
            i = end + 1
        else:
            out.append((c, frozenset(c)))
    return out


def never_matches(pattern: str) -> str | None:
    """Why no port can match ``pattern`` (the rule would be silently off), or None.

    A port is matched by its name, ``DEVICE/PORT`` with a number after the one ``/`` (``mlx5_3/1``),
    or by its interface, which has no ``/``. So a pattern can match nothing when a bracket set
    takes no character (``[7-0]``: ``fnmatch`` drops a reversed range), when it has two literal
    ``/``, or when what follows its ``/`` cannot be a port number or nothing precedes it."""
    tokens = _tokens(pattern)
    for text, chars in tokens:
        if not chars:
            return (f"{text} matches no character, so the pattern matches no port and its rule would be "
                    f"off; {_FIX_RANGE}")
    slashes = [k for k, (text, _) in enumerate(tokens) if text == "/"]
    if len(slashes) > 1:
        return ("a port is DEVICE/PORT (mlx5_0/1) and an interface has no '/', so a pattern with two '/' "
                "matches nothing; use e.g. mlx5_*/1")
    if not slashes:
        return None
    before, after = tokens[:slashes[0]], tokens[slashes[0] + 1:]
    if not before:
        return "a port is DEVICE/PORT: put the device name before '/', e.g. mlx5_0/1 or mlx5_*/1"
    if not after:
        return "a port is DEVICE/PORT: put the port number after '/', e.g. mlx5_0/1 or mlx5_0/*"
    if any(text != "*" and not chars & _DIGITS for text, chars in after):
        written = "".join(text for text, _ in after)
        return f"after '/' comes the port number (1, 2, ...), which {written!r} cannot match; use e.g. mlx5_0/1"
    return None


def _expectation(pattern: str, value: Any, error: Callable[[str], Exception]) -> PortExpectation:
    where = f"rdma_ports.{pattern}"
    if not isinstance(value, dict) or not value:
        raise error(f"{where}: must be a mapping with up and/or rate_gbps, e.g. {{up: true, rate_gbps: 400}}")
    for name in value:
        if name not in KEYS:
            raise error(f"{where}: unknown key {shown(name, 40)}; valid keys: " + ", ".join(KEYS))
    up = value.get("up", False)
    if not isinstance(up, bool):
        raise error(f"{where}.up: {shown(up, 40)} is not true or false; use up: true")
    rate = value.get("rate_gbps")
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate):
            raise error(f"{where}.rate_gbps: {shown(rate, 40)} is not a number; use the port's rate in "
                        "Gb/s as its rate file says it, e.g. 400 for 4X NDR")
        if not 0 < rate <= MAX_RATE_GBPS:
            raise error(f"{where}.rate_gbps: {rate:g} is out of range; use more than 0 and at most "
                        f"{MAX_RATE_GBPS:g} Gb/s, e.g. 400")
        rate = float(rate)
    return PortExpectation(pattern=pattern, up=up, rate_gbps=rate)
