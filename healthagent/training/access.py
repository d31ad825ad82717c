"""Who may post training reports: the intake's modes, the cluster's training key and job tokens.

The intake listens on the node's IP (a hostPort), so every pod that reaches the node can connect.
A report can freeze a job's counters, fake a shrink or push goodput above wall time; it can never
touch health or taints. The intake is therefore closed unless the operator says otherwise:

- ``token`` (the default): a request must carry ``Authorization: Bearer <token>``. The token is a
  *job token*, derived from the cluster's training key (``training_token``, the Secret
  ``healthagent-training``), which lets it write only the job it names; or the key itself, which
  writes every job (for trusted launchers, and agents set up before job tokens existed). Without
  a key nothing is accepted: every write is answered 401 with how to set one up.
- ``open``: anyone who reaches the port may write any job. The agent logs a warning at start.
- ``off``: no intake listener at all.

A job token is ``hj1.<job>.<mac>``: the job name and ``HMAC-SHA256(key, "healthagent training
job" NUL job)``, both base64url without padding. It is derived, never stored: every agent of the
cluster holds the key and checks any job's token without a list, and the job name travels in the
token so the check happens before the body is read. ``healthagent training-token JOB`` prints one.
Only the key's holders (the agents, the operator) can mint a token; a job's pods get its token in
their own namespace's Secret (docs/training.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass

INTAKE_MODES = ("token", "open", "off")
TOKEN_PREFIX = "hj1"
_MAC_CONTEXT = b"healthagent training job\x00"
_HOW = "docs/training.md, 'Who can report'"


@dataclass(frozen=True)
class Grant:
    """What one request may write: ``job`` names the only job, None means every job."""

    job: str | None


@dataclass(frozen=True)
class Refusal:
    """Why a request may write nothing (answered 401 before its body is read)."""

    message: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """base64url without padding; anything outside its alphabet is an error, not skipped."""
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def _mac(key: str, job: str) -> bytes:
    return hmac.new(key.encode("utf-8"), _MAC_CONTEXT + job.encode("utf-8"), hashlib.sha256).digest()


def job_token(key: str, job: str) -> str:
    """The token that lets a job's ranks write that job, and nothing else, on every agent."""
    if not key:
        raise ValueError("a job token needs the training key")
    if not job:
        raise ValueError("a job token needs a job name")
    return f"{TOKEN_PREFIX}.{_b64(job.encode('utf-8'))}.{_b64(_mac(key, job))}"


def token_job(token: str) -> str | None:
    """The job a token's text names (unverified), or None when it is not a job token."""
    prefix, _, rest = token.partition(".")
    encoded, _, mac = rest.partition(".")
    if prefix != TOKEN_PREFIX or not encoded or not mac:
        return None
    try:
        return _unb64(encoded).decode("utf-8") or None
    except (binascii.Error, ValueError):
        return None


class IntakeAccess:
    """Checks a request's ``Authorization`` header against the mode and the key."""

    def __init__(self, mode: str = "token", key: str = "") -> None:
        if mode not in INTAKE_MODES:
            raise ValueError(f"training intake mode {mode!r}: use one of " + ", ".join(INTAKE_MODES))
        self.mode = mode
        self._key = key
        self._key_bytes = key.encode("utf-8")

    @property
    def closed(self) -> bool:
        """True when nothing can be accepted: token mode without a key."""
        return self.mode == "token" and not self._key

    def startup_note(self) -> tuple[str, str]:
        """(level, text) for the start-up log: what this mode means for someone reading it."""
        if self.mode == "open":
            return ("warning", "training intake is open (training_intake=open): any pod that reaches "
                               "this node's intake port can post training reports for any job")
        if self.mode == "off":
            return ("info", "training intake is off (training_intake=off)")
        if self.closed:
            return ("warning", "training intake is closed: no training key is set (training_token, "
                               "from the Secret healthagent-training); every report is refused "
                               f"with 401 until one is ({_HOW})")
        return ("info", "training intake accepts job tokens and the training key")

    def check(self, authorization: str) -> Grant | Refusal:
        """The grant for a request with this ``Authorization`` header value, or why not."""
        if self.mode == "open":
            return Grant(job=None)
        if not self._key:
            return Refusal("this agent accepts no training reports: its training key is not set "
                           f"(the operator creates the Secret healthagent-training; {_HOW})")
        scheme, _, token = authorization.strip().partition(" ")
        presented = token.strip().encode("utf-8", "replace")
        if scheme.lower() == "bearer" and presented:
            if hmac.compare_digest(presented, self._key_bytes):
                return Grant(job=None)
            job = token_job(token.strip())
            if job is not None and hmac.compare_digest(presented, job_token(self._key, job).encode("utf-8")):
                return Grant(job=job)
        return Refusal("this agent requires 'Authorization: Bearer <token>' with the job's token "
                       f"(HEALTHAGENT_TRAINING_TOKEN in the training pod; {_HOW})")
