"""Fixtures for the effects tests."""

import pytest

from tests.support.kubefake import KubeFake


@pytest.fixture
def fake():
    """The fake API server (see its docstring for what it leaves out of Kubernetes)."""
    with KubeFake() as server:
        yield server
