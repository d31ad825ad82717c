"""The exposition's encode cache: each snapshot part and each family encoded again only when its
input changed, with prometheus_client's own encoders (``telemetry/metrics.py`` says why).

``PartEncoder.encode`` reuses a part's bytes whole while its input is the same (or equal), and
within a part that changed, each family whose key is equal to last time; the bytes are exactly
what the encoder writes for those families. For families whose names are all plain, the
negotiated OpenMetrics ``escaping=underscores`` encoder is swapped for its ``allow-utf-8`` twin,
which writes the same bytes without a Python loop over every character (``plain_names_encoder``).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics_exposition

if TYPE_CHECKING:
    from healthagent.model import AgentSnapshot

OPENMETRICS_EOF = b"# EOF\n"

_PLAIN_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@lru_cache(maxsize=4096)
def plain_name(name: str) -> bool:
    """In the character set that ``escaping=underscores`` leaves as it is (no colon either: the
    OpenMetrics encoder replaces a colon in a sample's name)."""
    return _PLAIN_NAME.fullmatch(name) is not None


def plain_names_encoder(encoder: Callable) -> Callable | None:
    """The negotiated OpenMetrics ``escaping=underscores`` encoder with ``allow-utf-8`` escaping
    instead, which writes the same bytes for families with plain names (module docstring); None
    for any other encoder (or another prometheus_client whose encoder has another shape)."""
    if (isinstance(encoder, partial) and encoder.func is openmetrics_exposition.generate_latest
            and not encoder.args and encoder.keywords.get("escaping") == openmetrics_exposition.UNDERSCORES):
        return partial(encoder.func, **{**encoder.keywords, "escaping": openmetrics_exposition.ALLOWUTF8})
    return None


def names_are_plain(families: Iterable[Metric]) -> bool:
    for family in families:
        if not plain_name(family.name):
            return False
        for sample in family.samples:
            if (sample.exemplar is not None or getattr(sample, "native_histogram", None) is not None
                    or not plain_name(sample.name) or not all(map(plain_name, sample.labels))):
                return False
    return True


def encode_families(encoder: Callable, plain: Callable | None, families: tuple[Metric, ...]) -> bytes:
    """``families`` encoded as ``encoder`` encodes them, through ``plain`` when it writes the same
    bytes faster."""
    chosen = plain if plain is not None and names_are_plain(families) else encoder
    return chosen(_Families(families))


def strip_eof(encoded: bytes) -> bytes:
    return encoded[: -len(OPENMETRICS_EOF)] if encoded.endswith(OPENMETRICS_EOF) else encoded


@dataclass(frozen=True)
class FamilyInput:
    """One family of a snapshot part: its name, everything its samples are made from (``key``,
    compared with ``==``), and how to build it. Equal keys give byte-identical encodings."""

    name: str
    key: object
    build: Callable[[], Metric]


def keyed_by_samples(families: Iterable[Metric]) -> Iterator[FamilyInput]:
    """Families already built, keyed by what an encoder writes: help, type, unit and samples."""
    for family in families:
        key = (family.documentation, family.type, family.unit, tuple(family.samples))
        yield FamilyInput(family.name, key, lambda family=family: family)


class _Families:
    """Registry-shaped wrapper around already built families."""

    def __init__(self, families: tuple[Metric, ...]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


@dataclass(frozen=True)
class SnapshotPart:
    """A slice of the snapshot that is encoded on its own: ``input`` is everything ``render``
    reads, so equal inputs give equal bytes and the encoded part can be reused. ``inputs`` gives
    the same families one by one with their keys (default: built by ``render``, keyed by their
    samples), so a part that changed re-encodes only the families that did."""

    name: str
    input: Callable[[AgentSnapshot], object]
    render: Callable[[AgentSnapshot], Iterator[Metric]]
    compare_equal: bool = True  # False: reuse only for the very same input object
    inputs: Callable[[AgentSnapshot], Iterable[FamilyInput]] | None = None

    def family_inputs(self, snapshot: AgentSnapshot) -> Iterable[FamilyInput]:
        if self.inputs is not None:
            return self.inputs(snapshot)
        return keyed_by_samples(self.render(snapshot))


class PartEncoder:
    """The encoded bytes of each snapshot part and of each family in it, per content type."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (part name, content type) -> (the part's input, its encoded bytes without # EOF)
        self._encoded: dict[tuple[str, str], tuple[object, bytes]] = {}
        # (part name, content type) -> family name -> (the family's key, its encoded bytes)
        self._family_bytes: dict[tuple[str, str], dict[str, tuple[object, bytes]]] = {}

    def encode(self, part: SnapshotPart, snapshot: "AgentSnapshot", encoder: Callable, plain: Callable | None,
               content_type: str) -> bytes:
        """``part`` of ``snapshot`` encoded, from the cache where its input (or a family's key)
        is unchanged."""
        key = (part.name, content_type)
        source = part.input(snapshot)
        with self._lock:
            cached = self._encoded.get(key)
            families_before = self._family_bytes.get(key, {})
        if cached is not None and (cached[0] is source or (part.compare_equal and cached[0] == source)):
            return cached[1]
        families_now: dict[str, tuple[object, bytes]] = {}
        pieces = []
        for family in part.family_inputs(snapshot):
            before = families_before.get(family.name)
            if before is not None and before[0] == family.key:
                encoded = before[1]
            else:
                encoded = strip_eof(encode_families(encoder, plain, (family.build(),)))
            families_now[family.name] = (family.key, encoded)
            pieces.append(encoded)
        encoded_part = b"".join(pieces)
        with self._lock:
            self._encoded[key] = (source, encoded_part)
            self._family_bytes[key] = families_now  # families that went away are forgotten
        return encoded_part
