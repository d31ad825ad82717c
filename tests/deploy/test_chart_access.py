"""Least privilege of a HELM install, on a real kube-apiserver: the node-token matrix again.

test_access_real.py proves RBAC and the three admission policies with the rendered ``generic``
overlay applied. Here the same tests run against ``helm install`` of the chart's default preset
on a server of this module's own: the ``access`` fixture below installs the release (and
uninstalls it afterwards) instead of applying the overlay, and every other fixture and case is
test_access_real.py's: the agent's pod-bound tokens for nodes A and B, writes to its own node
allowed, to the other node refused by the policy that should refuse them, and a whole XID 95
reaction with nothing but the chart's grants.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.deploy.test_access_real import (  # noqa: F401 (the cases, collected here with this module's fixtures)
    test_a_stale_json_patch_fails_before_admission_with_422,
    test_access_matrix,
    test_core_events_are_confined_too_should_someone_grant_them,
    test_the_agent_reacts_to_xid95_with_only_its_privileges,
)
from tests.support.access_cluster import ACCESS_KINDS, world  # noqa: F401 (world: a fixture)
from tests.support.helm_cluster import (  # noqa: F401 (own_control_plane, helm_fixture, helm_on_server: fixtures)
    RELEASE,
    RELEASE_NAMESPACE,
    helm_fixture,
    helm_ok,
    helm_on_server,
    install,
    live,
    manifest,
    own_control_plane,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def access(control_plane, helm_on_server) -> Iterator[list[dict[str, Any]]]:
    """The chart's default preset installed with helm; its access objects (all live)."""
    install(helm_on_server, {})
    objects = [o for o in manifest(helm_on_server) if o["kind"] in ACCESS_KINDS]
    assert {o["kind"] for o in objects} == set(ACCESS_KINDS)
    api = control_plane.api_client()
    assert all(live(api, o) is not None for o in objects)
    yield objects
    helm_ok(helm_on_server, "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE)
