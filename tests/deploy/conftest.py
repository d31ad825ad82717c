"""Fixtures for the deploy/ tests: the kubectl binary, every overlay rendered once, and the generic
overlay's three ValidatingAdmissionPolicies."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.admission_cel import EVENT_POLICY, LEASE_POLICY, NODE_POLICY
from tests.support.deploy import DEPLOY, NO_KUBECTL, OVERLAYS, find, kubectl_binary, render


@pytest.fixture(scope="session")
def kubectl() -> str:
    binary = kubectl_binary()
    if binary is None:
        pytest.skip(NO_KUBECTL)
    return binary


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[dict[str, Any]]]:
    """Overlay name -> the objects ``kubectl kustomize deploy/overlays/<name>`` prints."""
    return {name: render(DEPLOY / "overlays" / name, kubectl) for name in OVERLAYS}


@pytest.fixture(scope="module")
def policy(rendered) -> dict[str, Any]:
    return find(rendered["generic"], "ValidatingAdmissionPolicy", NODE_POLICY)


@pytest.fixture(scope="module")
def event_policy(rendered) -> dict[str, Any]:
    return find(rendered["generic"], "ValidatingAdmissionPolicy", EVENT_POLICY)


@pytest.fixture(scope="module")
def lease_policy(rendered) -> dict[str, Any]:
    return find(rendered["generic"], "ValidatingAdmissionPolicy", LEASE_POLICY)
