"""Who may post training reports: job tokens derived from the training key, the key, the modes."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from healthagent.training.access import Grant, IntakeAccess, Refusal, job_token, token_job

KEY = "0123456789abcdef0123456789abcdef"
jobs = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=128)


@given(job=jobs)
def test_a_job_token_grants_its_job_and_names_it(job):
    token = job_token(KEY, job)
    assert token.isascii() and " " not in token  # fits an HTTP header as it is
    assert token_job(token) == job
    assert IntakeAccess("token", KEY).check(f"Bearer {token}") == Grant(job=job)


@given(job=jobs, other=jobs)
def test_a_token_cannot_be_moved_to_another_job(job, other):
    """Swapping the job inside a token keeps its MAC, which is then wrong for the new job."""
    assume(job != other)
    prefix, _, mac = job_token(KEY, job).split(".")
    forged = f"{prefix}.{job_token(KEY, other).split('.')[1]}.{mac}"
    assert isinstance(IntakeAccess("token", KEY).check(f"Bearer {forged}"), Refusal)


@pytest.mark.parametrize("authorization", [
    "", "Bearer", "Bearer ", "bearer x", f"Basic {KEY}", "Bearer hj1", "Bearer hj1..", "Bearer hj1.@@@.x",
    f"Bearer {job_token(KEY + 'x', 'llama')}", f"Bearer {job_token(KEY, 'llama')}x",
    f"Bearer {KEY[:-1]}", f"Token {job_token(KEY, 'llama')}",
])
def test_anything_else_is_refused(authorization):
    assert isinstance(IntakeAccess("token", KEY).check(authorization), Refusal)


def test_the_key_itself_grants_every_job_and_the_scheme_is_case_insensitive():
    access = IntakeAccess("token", KEY)
    assert access.check(f"Bearer {KEY}") == Grant(job=None)
    assert access.check(f"bearer {KEY}") == Grant(job=None)
    assert access.check(f"  BEARER {job_token(KEY, 'llama')}  ") == Grant(job="llama")


def test_modes():
    assert IntakeAccess("open").check("") == Grant(job=None)
    closed = IntakeAccess("token", "")
    assert closed.closed and not IntakeAccess("token", KEY).closed and not IntakeAccess("open").closed
    refusal = closed.check(f"Bearer {job_token('any-key', 'llama')}")
    assert isinstance(refusal, Refusal) and "training key is not set" in refusal.message
    assert closed.startup_note()[0] == "warning" and IntakeAccess("open").startup_note()[0] == "warning"
    assert IntakeAccess("token", KEY).startup_note()[0] == "info"
    with pytest.raises(ValueError, match="use one of"):
        IntakeAccess("sometimes")
    with pytest.raises(ValueError):
        job_token("", "llama")
