"""A kube-apiserver v1.36 with the DRA device-taint gates on, for this package's tests."""

from __future__ import annotations

import pytest

from tests.dra.slices import DRA_FLAGS
from tests.support.envtest import ControlPlane, find_assets, missing_reason


@pytest.fixture(scope="session")
def dra_plane(tmp_path_factory):
    assets = find_assets()
    if assets is None:
        pytest.skip(missing_reason())
    with ControlPlane(assets, tmp_path_factory.mktemp("envtest-dra"), extra_args=DRA_FLAGS) as plane:
        from kubernetes import client

        client.CoreV1Api(plane.api_client()).create_namespace({"metadata": {"name": "healthagent"}})
        yield plane
