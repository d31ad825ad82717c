"""Every overlay and every component renders with the oldest supported kubectl and the newest, alike.

kubectl carries its own Kustomize: 1.30 carries v5.0.4, the test extra's kubectl a current one.
What one accepts the other may refuse or crash on (a file of several ``$patch: delete`` documents
is refused by 1.30's and crashes 1.31 to 1.33's), so each overlay, and each component over the
base, is rendered by both and must give the same objects.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.deploy import (
    COMPONENTS,
    DEPLOY,
    OVERLAYS,
    NO_OLDEST_KUBECTL,
    oldest_kubectl_binary,
    render,
    with_components,
)

pytestmark = pytest.mark.integration

TARGETS = [f"overlays/{name}" for name in OVERLAYS] + [f"components/{name}" for name in COMPONENTS]


def _kustomization(target: str, tmp_path: Path) -> Path:
    kind, name = target.split("/")
    if kind == "overlays":
        return DEPLOY / "overlays" / name
    return with_components(tmp_path / name, DEPLOY / "base", [name])


def _by_identity(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], str]:
    """(apiVersion, kind, namespace, name) -> the object as canonical JSON; no two alike."""
    keyed = {}
    for obj in objects:
        meta = obj["metadata"]
        key = (obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])
        assert key not in keyed, f"{key} rendered twice"
        keyed[key] = json.dumps(obj, sort_keys=True)
    return keyed


@pytest.fixture(scope="module")
def oldest_kubectl() -> str:
    binary = oldest_kubectl_binary()
    if binary is None:
        pytest.skip(NO_OLDEST_KUBECTL)
    version = json.loads(subprocess.run([binary, "version", "--client", "--output=json"],
                                        capture_output=True, text=True, check=True,
                                        timeout=60).stdout)["clientVersion"]
    assert (version["major"], version["minor"]) == ("1", "30"), version
    return binary


@pytest.mark.parametrize("target", TARGETS)
def test_newest_kubectl_renders(kubectl, tmp_path, target):
    assert render(_kustomization(target, tmp_path), kubectl)


@pytest.mark.parametrize("target", TARGETS)
def test_oldest_kubectl_renders_the_same_objects(kubectl, oldest_kubectl, tmp_path, target):
    directory = _kustomization(target, tmp_path)
    newest = _by_identity(render(directory, kubectl))
    oldest = _by_identity(render(directory, oldest_kubectl))  # RenderError: stderr of a failure
    assert sorted(oldest) == sorted(newest)
    for key in newest:
        assert json.loads(oldest[key]) == json.loads(newest[key]), key
