"""Where the suite finds its control plane and CRDs: the environment only, and a skip that says how.

``KUBEBUILDER_ASSETS`` names the folder of ``etcd`` and ``kube-apiserver`` (controller-runtime's
envtest convention); ``HEALTHAGENT_TEST_CRDS`` the CustomResourceDefinitions, defaulting to
``crds/`` beside the assets folder. Nothing else is looked at, so a test never depends on a folder
that happens to lie near the checkout.
"""

from __future__ import annotations

import pytest

from tests.support.envtest import find_assets, find_crds, missing_crds_reason, missing_reason


@pytest.fixture
def assets(tmp_path):
    folder = tmp_path / "envtest" / "bin"
    folder.mkdir(parents=True)
    for name in ("etcd", "kube-apiserver"):
        (folder / name).write_text("#!/bin/sh\n")
        (folder / name).chmod(0o755)
    return folder


def test_unset_finds_nothing_and_says_what_to_set(monkeypatch):
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    monkeypatch.delenv("HEALTHAGENT_TEST_CRDS", raising=False)
    assert find_assets() is None and find_crds() is None
    assert "KUBEBUILDER_ASSETS is unset" in missing_reason()
    assert "setup-envtest use -p path" in missing_reason()
    assert "set HEALTHAGENT_TEST_CRDS" in missing_crds_reason("the CRDs")


def test_assets_folder_with_both_binaries(monkeypatch, assets):
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    assert find_assets() == assets
    (assets / "etcd").chmod(0o644)
    assert find_assets() is None
    assert missing_reason().endswith(f"KUBEBUILDER_ASSETS={assets} has no executable etcd")


def test_crds_beside_the_assets_or_where_named(monkeypatch, assets, tmp_path):
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    monkeypatch.delenv("HEALTHAGENT_TEST_CRDS", raising=False)
    assert find_crds() is None
    assert f"no crds/ folder beside KUBEBUILDER_ASSETS={assets}" in missing_crds_reason("the CRDs")
    (assets.parent / "crds").mkdir()
    assert find_crds() == assets.parent / "crds"
    named = tmp_path / "elsewhere"
    monkeypatch.setenv("HEALTHAGENT_TEST_CRDS", str(named))
    assert find_crds() is None  # named and missing: never a silent fallback
    assert missing_crds_reason("the CRDs") == f"needs the CRDs: HEALTHAGENT_TEST_CRDS={named} is not a folder"
    named.mkdir()
    assert find_crds() == named
