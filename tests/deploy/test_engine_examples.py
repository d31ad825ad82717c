"""Every Karpenter example in the docs is accepted by a REAL kube-apiserver serving Karpenter's CRDs.

The docs show Karpenter objects (a NodePool whose disruption budgets sit beside the agent's own
budget). Whether such an object is real is for the CRD's structural schema, enums and CEL rules to
say, and only a server runs those. So every YAML code block of ``docs/*.md`` and ``README.md``
whose ``apiVersion`` is ``karpenter.sh/*`` or ``karpenter.k8s.aws/*`` is created with
``dryRun=All`` and ``fieldValidation=Strict`` (an unknown field is an error, not a silent drop)
after the CRDs of the Karpenter release the docs name are installed. Nothing is persisted.

The CRDs come from the ``karpenter/`` folder of the test CRD folder (``find_crds()``:
``HEALTHAGENT_TEST_CRDS``, or ``crds/`` beside ``KUBEBUILDER_ASSETS``); without it the server tests
skip and say so.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.support.crds import crd_served
from tests.support.envtest import ControlPlane, find_crds, missing_crds_reason
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
GROUPS = ("karpenter.sh/", "karpenter.k8s.aws/")
FENCE = re.compile(r"^```(?:yaml|yml)[ \t]*\n(.*?)^```", re.M | re.S)
CRD_TIMEOUT_SECONDS = 120.0
KARPENTER_VERSION = "v1.14.1"  # the release the docs check against; the CRD folder's README names it


def karpenter_examples() -> list[tuple[str, dict[str, Any]]]:
    """(``doc:line``, object) for every Karpenter object in a YAML code block of the docs."""
    found = []
    for path in DOCS:
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        for block in FENCE.finditer(text):
            where = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, block.start()) + 1}"
            names_karpenter = re.search(r"^\s*apiVersion:\s*karpenter\.(sh|k8s\.aws)/", block.group(1), re.M)
            try:
                docs = list(yaml.safe_load_all(block.group(1)))
            except yaml.YAMLError as exc:
                assert not names_karpenter, f"{where}: a Karpenter example that is not YAML: {exc}"
                continue
            for doc in docs:
                if isinstance(doc, dict) and str(doc.get("apiVersion", "")).startswith(GROUPS):
                    found.append((where, doc))
    return found


EXAMPLES = karpenter_examples()


def test_the_docs_show_a_karpenter_nodepool_with_disruption_budgets():
    """The docs' account of repair and NodePool budgets rests on an example that can be checked."""
    pools = [obj for _, obj in EXAMPLES if obj.get("kind") == "NodePool"]
    assert pools, "no karpenter.sh NodePool example in docs/*.md or README.md"
    assert any((pool.get("spec") or {}).get("disruption", {}).get("budgets") for pool in pools)


def test_the_docs_name_the_karpenter_release_the_examples_are_checked_against():
    install = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
    assert f"Karpenter {KARPENTER_VERSION}" in install


# -- the real server -------------------------------------------------------------------------------


def karpenter_crds() -> list[dict[str, Any]]:
    crds = find_crds()
    if crds is None:
        pytest.skip(missing_crds_reason("Karpenter's CRDs (in the CRD folder's karpenter/)"))
    folder = crds / "karpenter"
    if not folder.is_dir():
        pytest.skip(f"needs Karpenter's CRDs: no karpenter/ folder in {crds}")
    readme = folder / "README.md"
    if readme.exists():
        assert KARPENTER_VERSION in readme.read_text(encoding="utf-8"), f"{folder} holds another release"
    found = [doc for path in sorted(folder.glob("*.y*ml"))
             for doc in yaml.safe_load_all(path.read_text(encoding="utf-8"))
             if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition"]
    if not found:
        pytest.skip(f"no CustomResourceDefinition in {folder}: put their YAML there (the release assets of each project)")
    return found


@pytest.fixture(scope="module")
def karpenter_server(control_plane: ControlPlane):
    """An admin session on the real server, with Karpenter's CRDs installed (for real: a CRD
    cannot be dry-run into existence) and served. Returns (session, url, {(group, kind): plural})."""
    crds = karpenter_crds()
    session, url = control_plane.admin_session(), control_plane.url
    for crd in crds:
        created = session.post(f"{url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd, timeout=30)
        assert created.status_code in (201, 409), f"installing {crd['metadata']['name']}: {created.text}"
    for crd in crds:
        name = crd["metadata"]["name"]
        wait_for(lambda name=name: crd_served(url, session, name),
                 CRD_TIMEOUT_SECONDS, f"CRD {name} Established and served", retry_on=(requests.RequestException,),
                 interval=0.1)
    plurals = {(crd["spec"]["group"], crd["spec"]["names"]["kind"]): crd["spec"]["names"]["plural"] for crd in crds}
    return session, url, plurals


def dry_run_create(server, obj: dict[str, Any]) -> requests.Response:
    """POST ``obj`` with dryRun=All and strict field validation: every stage runs, nothing persists."""
    session, url, plurals = server
    group, _, version = obj["apiVersion"].partition("/")
    plural = plurals.get((group, obj.get("kind")))
    assert plural, f"{obj['apiVersion']} {obj.get('kind')}: no such kind among the installed Karpenter CRDs"
    return session.post(f"{url}/apis/{group}/{version}/{plural}", json=obj,
                        params={"dryRun": "All", "fieldValidation": "Strict"}, timeout=30)


@pytest.mark.integration
@pytest.mark.parametrize("where,obj", EXAMPLES, ids=[f"{w}-{o.get('kind')}" for w, o in EXAMPLES])
def test_the_server_accepts_every_karpenter_example(karpenter_server, where: str, obj: dict[str, Any]):
    reply = dry_run_create(karpenter_server, obj)
    assert reply.status_code == 201, f"{where}: the server refused {obj.get('kind')}: {reply.text}"
    assert not reply.headers.get("Warning"), f"{where}: the server warned: {reply.headers['Warning']}"


@pytest.mark.integration
def test_the_check_can_fail_a_budget_for_repair_is_refused(karpenter_server):
    """No Karpenter release has an ``Unhealthy`` budget reason: the same NodePool with one is refused."""
    pools = [(where, obj) for where, obj in EXAMPLES if obj.get("kind") == "NodePool"
             and (obj.get("spec") or {}).get("disruption", {}).get("budgets")]
    assert pools, "no NodePool example with disruption budgets to alter"
    where, pool = pools[0]
    altered = yaml.safe_load(yaml.safe_dump(pool))
    altered["spec"]["disruption"]["budgets"][0]["reasons"] = ["Unhealthy"]
    reply = dry_run_create(karpenter_server, altered)
    assert reply.status_code == 422, f"{where} with reasons [Unhealthy] was not refused: {reply.status_code} {reply.text}"
    causes = {(c.get("field"), c.get("message", "").split(":")[0]) for c in reply.json()["details"]["causes"]}
    assert ("spec.disruption.budgets[0].reasons[0]", "Unsupported value") in causes, reply.text
    assert 'Unsupported value: "Unhealthy"' in reply.json()["message"], reply.text
