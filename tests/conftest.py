"""Suite-wide fixtures: the real Kubernetes control plane (etcd + kube-apiserver), one per session.

Tests that need it take ``control_plane``; where the binaries are absent (see
``tests/support/envtest.py``) they skip with the reason, so a clone without them still passes.
"""

from __future__ import annotations

import itertools
import os

import pytest

from tests.support.envtest import ControlPlane, find_assets, missing_reason

_names = itertools.count()
MAX_WORKERS = 4  # each worker starts its own kube-apiserver and etcd


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: half again as many workers as cores, at most ``MAX_WORKERS``. Most of the
    suite waits on servers, child processes and timers rather than computing, so a third worker
    on two cores takes the suite from about 5 min 30 s to 4 min 40 s."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cores + cores // 2))


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

