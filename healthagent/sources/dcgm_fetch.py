"""One scrape of dcgm-exporter's ``/metrics``: the body as text within a deadline, or ScrapeError.

The HTTP half of the dcgm source (``sources/dcgm.py`` maps the text onto GPU samples). One GET
per scrape with ``requests``, no proxy from the environment (dcgm-exporter is on the node or in
the cluster), identity encoding, a bounded body, and a deadline for the whole read, so a server
trickling bytes cannot hold the loop. Every failure is one ``ScrapeError`` whose ``kind`` is the
error counter it goes to: ``http_5xx``, ``http_4xx``, ``timeout``, ``connect``, ``parse``.
"""

from __future__ import annotations

import socket
import time
from typing import Iterator

import requests
from urllib3.exceptions import ProtocolError, ReadTimeoutError

MAX_BODY_BYTES = 16 * 1024 * 1024
CHUNK_BYTES = 64 * 1024


class ScrapeError(Exception):
    """One failed scrape; ``kind`` is the error counter it goes to."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def body_chunks(reply: requests.Response) -> Iterator[bytes]:
    """The body in the pieces single socket receives return (urllib3 2's ``read1``), so the caller's
    deadline is checked after every receive; whole ``CHUNK_BYTES`` blocks (each of which may take
    many receives) only with an urllib3 that has no ``read1``."""
    read1 = getattr(reply.raw, "read1", None)
    if read1 is None:
        yield from reply.iter_content(CHUNK_BYTES)
        return
    while True:
        chunk = read1(CHUNK_BYTES, decode_content=True)
        if not chunk:
            return
        yield chunk


class DcgmFetcher:
    """GETs ``url`` with ``timeout_seconds`` per socket operation and for the whole body."""

    def __init__(self, url: str, timeout_seconds: float) -> None:
        self.url = url
        self.timeout = timeout_seconds
        self._session = requests.Session()
        # dcgm-exporter is on the node or in-cluster: a proxy from the environment would only hurt.
        self._session.trust_env = False

    def close(self) -> None:
        self._session.close()

    def fetch(self) -> str:
        """The body as text, or ScrapeError. The whole read is bounded by the timeout, not only
        each socket operation, so a server trickling bytes cannot hold the loop: the body is read
        one socket receive at a time (``read1``; each receive waits at most ``timeout``) and the
        deadline is checked between them, so a scrape ends within twice the timeout at worst."""
        deadline = time.monotonic() + self.timeout
        try:
            with self._session.get(self.url, timeout=self.timeout, stream=True,
                                   headers={"Accept": "text/plain", "Accept-Encoding": "identity"}) as reply:
                if reply.status_code >= 500:
                    raise ScrapeError("http_5xx", f"HTTP {reply.status_code} from {self.url}")
                if reply.status_code != 200:
                    raise ScrapeError("http_4xx" if reply.status_code >= 400 else "parse",
                                      f"HTTP {reply.status_code} from {self.url}")
                content_type = reply.headers.get("Content-Type", "text/plain")
                if not content_type.startswith("text/plain"):
                    raise ScrapeError("parse", f"Content-Type {content_type!r} is not Prometheus text")
                body = bytearray()
                for chunk in body_chunks(reply):
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        raise ScrapeError("parse", f"body larger than {MAX_BODY_BYTES} bytes")
                    if time.monotonic() > deadline:
                        raise ScrapeError("timeout", f"body not complete within {self.timeout}s")
        except ScrapeError:
            raise
        except (ReadTimeoutError, socket.timeout):  # read1 goes around requests' exception mapping
            raise ScrapeError("timeout", f"body not complete within {self.timeout}s") from None
        except ProtocolError as exc:
            raise ScrapeError("parse", f"truncated or undecodable body: {type(exc).__name__}") from None
        except requests.exceptions.Timeout as exc:
            raise ScrapeError("timeout", f"no answer within {self.timeout}s: {type(exc).__name__}") from None
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError) as exc:
            raise ScrapeError("parse", f"truncated or undecodable body: {type(exc).__name__}") from None
        except requests.exceptions.ConnectionError as exc:
            if "timed out" in str(exc).lower():  # a body read timeout surfaces as ConnectionError
                raise ScrapeError("timeout", f"body not complete within {self.timeout}s") from None
            raise ScrapeError("connect", f"cannot connect to {self.url}: {type(exc).__name__}") from None
        except requests.exceptions.RequestException as exc:
            raise ScrapeError("connect", f"request to {self.url!r} failed: {type(exc).__name__}") from None
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise ScrapeError("parse", "body is not UTF-8 text") from None
        if text and not text.endswith("\n"):
            # The exposition format ends every line with \n; without it the body was cut short.
            raise ScrapeError("parse", f"body truncated ({len(body)} bytes, no final newline)")
        return text
