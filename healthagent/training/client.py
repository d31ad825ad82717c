"""The client training ranks import to report steps to the healthagent on their node.

Stdlib only and self-contained (no healthagent, prometheus_client or requests import), so it can be
installed with ``pip install --no-deps healthagent`` or copied as one file into a training image.

The promise to the training loop: a report call never blocks and never raises. A call builds one
small dict and hands it to a bounded queue with ``put_nowait``; when the queue is full the report is
dropped and counted. A daemon thread sends batches with ``urllib.request`` (short timeout, proxies
ignored: the agent is on this node) and backs off while the agent is down or slow; it never holds
more than one batch in flight, so memory is bounded by ``queue_size`` + ``batch_size`` reports.

Where the agent's training intake is: ``HEALTHAGENT_URL`` (e.g. ``http://10.0.0.5:9412``), else
``http://$HEALTHAGENT_HOST_IP:9412`` (set ``HEALTHAGENT_HOST_IP`` from the downward API
``status.hostIP``), else ``http://127.0.0.1:9412`` (a pod on the host network). The intake accepts
no report without a credential unless its operator opened it: ``HEALTHAGENT_TRAINING_TOKEN`` (or
``token=``), the job's token from its Secret, is sent as ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Mapping

log = logging.getLogger(__name__)

DEFAULT_PORT = 9412  # the agent's training intake (its metrics are on another port)
INTAKE_PATH = "/v1/training"
ENV_URL = "HEALTHAGENT_URL"
ENV_HOST_IP = "HEALTHAGENT_HOST_IP"
ENV_JOB = "HEALTHAGENT_JOB"
ENV_TOKEN = "HEALTHAGENT_TRAINING_TOKEN"
MAX_REPLY_BYTES = 64 * 1024
MAX_BATCH_BYTES = 60_000  # under the agent's 64 KiB body limit
TRANSIENT_HTTP_ATTEMPTS = 3  # a batch the agent answers 5xx to is dropped after this many tries
LOG_EVERY_SECONDS = 60.0


def agent_base_url(env: Mapping[str, str] | None = None) -> str:
    """The agent's base URL from the environment (see module docstring)."""
    env = os.environ if env is None else env
    url = (env.get(ENV_URL) or "").strip()
    if url:
        return url.rstrip("/")
    host = (env.get(ENV_HOST_IP) or "").strip()
    if host:
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 node address
        return f"http://{host}:{DEFAULT_PORT}"
    return f"http://127.0.0.1:{DEFAULT_PORT}"


def default_job(env: Mapping[str, str] | None = None) -> str:
    """``HEALTHAGENT_JOB``, else torchrun's ``TORCHELASTIC_RUN_ID`` (the rendezvous id), else "default"."""
    env = os.environ if env is None else env
    for key in (ENV_JOB, "TORCHELASTIC_RUN_ID"):
        value = (env.get(key) or "").strip()
        if value and value != "none":
            return value
    return "default"


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    return _number(env.get(key), default, int)


def _number(value: Any, default: Any, kind: type) -> Any:
    """``kind(value)``, or ``default`` when value is None or not a number (never raises)."""
    if value is None:
        return default
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        log.warning("healthagent reporter: %r is not a valid %s; using %r", value, kind.__name__, default)
        return default


@dataclass(frozen=True)
class ReporterStats:
    """Where every report went. delivered + dropped + rejected + failed + pending = reports made."""

    delivered: int  # accepted by the agent
    dropped: int  # queue full, invalid arguments, or still unsent at close
    rejected: int  # the agent answered 4xx (a bug in the report; retrying cannot help)
    failed: int  # the agent answered 5xx repeatedly
    pending: int  # queued or in flight now
    send_errors: int  # attempts that failed (agent down, slow, 5xx): each one backed off


class TrainingReporter:
    """Reports a job's steps and rendezvous to the node's healthagent (see module docstring).

    Every public method catches everything, the constructor included (an unusable argument falls
    back to its default with a warning): reporting must never be why training stops.
    """

    def __init__(self, job: str | None = None, *, url: str | None = None, rank: int | None = None,
                 world_size: int | None = None, queue_size: int = 10_000, batch_size: int = 500,
                 timeout_seconds: float = 1.0, min_backoff_seconds: float = 0.5,
                 max_backoff_seconds: float = 30.0, env: Mapping[str, str] | None = None,
                 token: str | None = None) -> None:
        env = os.environ if env is None else env
        token = (str(token) if token else env.get(ENV_TOKEN, "")).strip()
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.job = str(job) if job else default_job(env)
        self.endpoint = (str(url).rstrip("/") if url else agent_base_url(env)) + INTAKE_PATH
        self.rank = _number(rank, _env_int(env, "RANK", 0), int)
        self.world_size = _number(world_size, _env_int(env, "WORLD_SIZE", 1), int)
        self.queue_size = max(1, _number(queue_size, 10_000, int))
        self.batch_size = max(1, _number(batch_size, 500, int))
        self.timeout_seconds = _number(timeout_seconds, 1.0, float)
        self.min_backoff_seconds = _number(min_backoff_seconds, 0.5, float)
        self.max_backoff_seconds = _number(max_backoff_seconds, 30.0, float)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._last_logged: dict[str, float] = {}
        self._counts = {"delivered": 0, "dropped": 0, "rejected": 0, "failed": 0, "send_errors": 0}
        self._in_flight = 0
        self._last_step_at: float | None = None
        self._carry: bytes | None = None  # an encoded report that did not fit the last batch
        self._closed = False
        self._start_sender()
        atexit.register(self._at_exit)

    def _start_sender(self) -> None:
        """A fresh queue and sender thread (also in a forked child, where the thread is gone)."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=self.queue_size)
        self._closing = threading.Event()
        self._sender = threading.Thread(target=self._run, name="healthagent-reporter", daemon=True)
        try:
            self._sender.start()
        except RuntimeError:  # no thread to be had: reports fill the queue and are dropped
            log.warning("healthagent reporter could not start its sender thread; reports are dropped")

    # -- what the training loop calls ---------------------------------------------------------------

    def report_step(self, step: int, *, tokens: int = 0, samples: int = 0,
                    step_seconds: float | None = None, rank: int | None = None,
                    world_size: int | None = None, job: str | None = None,
                    timestamp: float | None = None) -> bool:
        """One step done. ``tokens``/``samples`` are the step's global totals (the whole job's).

        Without ``step_seconds`` the time since the previous ``report_step`` is used (the first
        call reports 0: setup before the loop is not productive time). Returns True if queued.
        """
        try:
            now = time.monotonic()
            if step_seconds is None:
                step_seconds = 0.0 if self._last_step_at is None else now - self._last_step_at
            self._last_step_at = now
            report = {
                "type": "step", "job": job or self.job,
                "rank": self.rank if rank is None else int(rank),
                "world_size": self.world_size if world_size is None else int(world_size),
                "step": int(step), "tokens": int(tokens), "samples": int(samples),
                "step_seconds": float(step_seconds),
                "timestamp": time.time() if timestamp is None else float(timestamp),
            }
        except Exception:
            self._count("dropped")
            return False
        return self._enqueue(report)

    def report_rendezvous(self, world_size: int | None = None, *, reason: str = "",
                          job: str | None = None, timestamp: float | None = None) -> bool:
        """The job (re-)rendezvoused with ``world_size`` ranks; ``reason`` e.g. "scale_up", "fault".

        Report once per node (the launcher hook does; in a script, from local rank 0 only).
        """
        try:
            report: dict[str, Any] = {"type": "rendezvous", "job": job or self.job,
                                      "timestamp": time.time() if timestamp is None else float(timestamp)}
            if world_size is not None:
                report["world_size"] = int(world_size)
            if reason:
                report["reason"] = str(reason)
        except Exception:
            self._count("dropped")
            return False
        return self._enqueue(report)

    def report_end(self, *, job: str | None = None, timestamp: float | None = None) -> bool:
        """The job finished on this node: its wall clock stops (goodput is not charged for after)."""
        try:
            report = {"type": "end", "job": job or self.job,
                      "timestamp": time.time() if timestamp is None else float(timestamp)}
        except Exception:
            self._count("dropped")
            return False
        return self._enqueue(report)

    def stats(self) -> ReporterStats:
        try:
            with self._lock:
                counts = dict(self._counts)
                pending = self._queue.qsize() + self._in_flight
            return ReporterStats(pending=pending, **counts)
        except Exception:
            return ReporterStats(0, 0, 0, 0, 0, 0)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued for up to ``timeout`` seconds, then stop. Never raises."""
        try:
            self._closed = True
            self._closing.set()
            self._sender.join(max(0.0, float(timeout)))
            atexit.unregister(self._at_exit)
        except Exception:
            pass

    def __enter__(self) -> "TrainingReporter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------

    def _at_exit(self) -> None:
        self.close(timeout=1.0)

    def _log_limited(self, kind: str, message: str, *args: object) -> None:
        """At most one warning per kind per minute: a down agent must not flood the job's log."""
        now = time.monotonic()
        if now - self._last_logged.get(kind, -LOG_EVERY_SECONDS) >= LOG_EVERY_SECONDS:
            self._last_logged[kind] = now
            log.warning(message, *args)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _enqueue(self, report: dict) -> bool:
        try:
            if self._closed:
                self._count("dropped")
                return False
            if self._pid != os.getpid():
                self._start_sender()  # forked: the parent's thread does not exist here
            self._queue.put_nowait(report)
            return True
        except Exception:  # queue.Full, or anything else: drop, never block, never raise
            self._count("dropped")
            return False

    def _run(self) -> None:
        try:
            self._send_until_closed()
        except Exception:  # a bug here must not surface in the training process
            log.exception("healthagent reporter stopped; reports are dropped from now on")

    def _send_until_closed(self) -> None:
        backoff = self.min_backoff_seconds
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            http_attempts = 0
            while True:
                outcome = self._send(batch)
                if outcome in ("sent", "rejected"):
                    backoff = self.min_backoff_seconds
                    break
                self._count("send_errors")
                if outcome == "http_error":
                    http_attempts += 1
                    if http_attempts >= TRANSIENT_HTTP_ATTEMPTS:
                        self._settle(batch, "failed")
                        break
                if self._closing.is_set():
                    self._settle(batch, "dropped")
                    self._drain_as_dropped()
                    return
                self._closing.wait(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, self.max_backoff_seconds)

    def _next_batch(self) -> list[bytes] | None:
        """Up to batch_size encoded reports whose JSON array stays under MAX_BATCH_BYTES (the
        agent's body limit is 64 KiB); None once closing and nothing is left."""
        batch: list[bytes] = []
        size = 2  # the brackets
        if self._carry is not None:
            batch.append(self._carry)
            size += len(self._carry) + 1
            self._carry = None
        while not batch:
            try:
                batch.append(_encode(self._queue.get(timeout=0.2)))
                size += len(batch[0]) + 1
            except queue.Empty:
                if self._closing.is_set():
                    return None
        while len(batch) < self.batch_size:
            try:
                encoded = _encode(self._queue.get_nowait())
            except queue.Empty:
                break
            if size + len(encoded) + 1 > MAX_BATCH_BYTES:
                self._carry = encoded  # first in the next batch
                break
            batch.append(encoded)
            size += len(encoded) + 1
        with self._lock:
            self._in_flight = len(batch) + int(self._carry is not None)
        return batch

    def _settle(self, batch: list[bytes], outcome: str, n: int | None = None) -> None:
        with self._lock:
            self._counts[outcome] += len(batch) if n is None else n
            self._in_flight = int(self._carry is not None)

    def _drain_as_dropped(self) -> None:
        if self._carry is not None:
            self._carry = None
            self._count("dropped")
        with self._lock:
            self._in_flight = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._count("dropped")

    def _send(self, batch: list[bytes]) -> str:
        """POST one batch: "sent", "rejected" (4xx), "http_error" (5xx) or "unreachable"."""
        body = b"[" + b",".join(batch) + b"]"
        request = urllib.request.Request(self.endpoint, data=body, method="POST", headers=self._headers)
        try:
            with self._opener.open(request, timeout=self.timeout_seconds) as reply:
                reply.read(MAX_REPLY_BYTES)
            self._settle(batch, "delivered")
            return "sent"
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500:
                accepted = _accepted_count(exc, len(batch))
                self._count("delivered", accepted)
                self._settle(batch, "rejected", len(batch) - accepted)
                self._log_limited("rejected", "healthagent rejected %d training reports: HTTP %d%s",
                                  len(batch) - accepted, exc.code, _REJECTION_HINTS.get(exc.code, ""))
                return "rejected"
            self._log_limited("http", "healthagent answered HTTP %d; backing off", exc.code)
            return "http_error"
        except Exception as exc:  # refused, timeout, reset, DNS: the agent is down or slow
            self._log_limited("unreachable", "healthagent at %s unreachable (%s); backing off",
                              self.endpoint, type(exc).__name__)
            return "unreachable"


_REJECTION_HINTS = {
    401: f" (set {ENV_TOKEN} to the job's token, from the Secret its operator created)",
    403: f" (the token in {ENV_TOKEN} is for another job: report as the job it names)",
}


def _encode(report: dict) -> bytes:
    return json.dumps(report, separators=(",", ":")).encode("utf-8")


def _accepted_count(error: urllib.error.HTTPError, batch_length: int) -> int:
    """How many reports of a partly rejected batch the agent still applied (its JSON reply says)."""
    try:
        reply = json.loads(error.read(MAX_REPLY_BYTES).decode("utf-8"))
        return max(0, min(int(reply.get("accepted", 0)), batch_length))
    except Exception:
        return 0

