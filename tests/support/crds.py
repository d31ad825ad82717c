"""CustomResourceDefinitions on the real test API server: when one can be used."""

from __future__ import annotations

import requests


def crd_served(url: str, session: requests.Session, name: str) -> bool:
    """Established, and listed by discovery in every served version: only then does a client map
    the kind to a resource (an early request fails with ``no matches for kind``, a test-setup
    race, not a finding)."""
    reply = session.get(f"{url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}", timeout=10)
    if reply.status_code != 200:
        return False
    crd = reply.json()
    conditions = {c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions") or []}
    if conditions.get("Established") != "True":
        return False
    group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
    for version in (v["name"] for v in crd["spec"]["versions"] if v.get("served")):
        listing = session.get(f"{url}/apis/{group}/{version}", timeout=10)
        if listing.status_code != 200 or plural not in {r["name"] for r in listing.json()["resources"]}:
            return False
    return True
