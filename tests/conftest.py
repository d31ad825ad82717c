"""Suite-wide fixtures: the real Kubernetes control plane (etcd + kube-apiserver), one per session.

Tests that need it take ``control_plane``; where the binaries are absent (see
``tests/support/envtest.py``) they skip with the reason, so a clone without them still passes.
"""

from __future__ import annotations

import itertools

import pytest

from tests.support.envtest import ControlPlane, find_assets, missing_reason

_names = itertools.count()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """The session's etcd + kube-apiserver; tests keep apart by the names they create."""
    assets = find_assets()
    if assets is None:
        pytest.skip(missing_reason())
    with ControlPlane(assets, tmp_path_factory.mktemp("envtest")) as plane:
        yield plane


@pytest.fixture
def unique_name():
    """A name no other test of this session uses (Nodes are cluster-wide on the one server)."""
    return lambda base: f"{base}-t{next(_names)}"
