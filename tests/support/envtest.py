"""A REAL Kubernetes control plane for tests: etcd and kube-apiserver on loopback.

The binaries come from ``KUBEBUILDER_ASSETS`` and from nowhere else: controller-runtime's envtest
convention, a folder holding ``etcd`` and ``kube-apiserver`` (``setup-envtest use -p path`` prints
one). Without them ``find_assets()`` returns None and the tests that need the server skip, naming
what is missing, so a fresh clone still passes. The CustomResourceDefinitions some tests install
(prometheus-operator's, and Karpenter's in a ``karpenter/`` subfolder) come from the folder
``HEALTHAGENT_TEST_CRDS`` names, or else from ``crds/`` beside the ``KUBEBUILDER_ASSETS`` folder.

One ``ControlPlane`` serves a whole test session: its own PKI made with ``openssl`` (a CA, a serving
certificate for 127.0.0.1, an admin client certificate in ``system:masters`` and the service
account signing key pair), free loopback ports, RBAC authorization and the admission plugins the
API server enables by default (ValidatingAdmissionPolicy included). Tests keep apart by node and
namespace names, never by a server each. No controller-manager, scheduler or kubelet runs: nothing
marks a Node Ready, so the ``TaintNodesByCondition`` admission plugin leaves its
``node.kubernetes.io/not-ready:NoSchedule`` on every Node a test creates (a foreign taint the agent
must keep).

``restart_apiserver()`` stops kube-apiserver and starts it again over the same etcd, as a rolling
control-plane upgrade does: its watch cache starts afresh, so a watch resumed from a version the
new cache does not hold gets a real ``410 Gone``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.support.wait import wait_for

ASSETS_ENV = "KUBEBUILDER_ASSETS"
CRDS_ENV = "HEALTHAGENT_TEST_CRDS"
BINARIES = ("etcd", "kube-apiserver")
START_TIMEOUT_SECONDS = 90.0
STOP_TIMEOUT_SECONDS = 15.0
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


def find_assets() -> Path | None:
    """The ``KUBEBUILDER_ASSETS`` folder when it holds executable ``etcd`` and ``kube-apiserver``."""
    named = os.environ.get(ASSETS_ENV, "")
    if named and all(os.access(Path(named) / name, os.X_OK) for name in BINARIES):
        return Path(named)
    return None


def missing_reason() -> str:
    """Why the real API server cannot run here: the skip reason tests give."""
    named = os.environ.get(ASSETS_ENV, "")
    if not named:
        return (f"needs a real kube-apiserver and etcd: {ASSETS_ENV} is unset; set it to a folder "
                f"holding both (controller-runtime's envtest layout: `setup-envtest use -p path` prints one, "
                f"after `go install sigs.k8s.io/controller-runtime/tools/setup-envtest@latest`)")
    missing = [name for name in BINARIES if not os.access(Path(named) / name, os.X_OK)]
    return (f"needs a real kube-apiserver and etcd: {ASSETS_ENV}={named} has no executable "
            f"{' nor '.join(missing)}")


def find_crds() -> Path | None:
    """The folder of CustomResourceDefinitions to install, or None: ``HEALTHAGENT_TEST_CRDS``, else
    ``crds/`` beside the ``KUBEBUILDER_ASSETS`` folder. Tests that need the CRDs skip on None with
    ``missing_crds_reason()``."""
    named = os.environ.get(CRDS_ENV, "")
    if named:
        return Path(named) if Path(named).is_dir() else None
    assets = os.environ.get(ASSETS_ENV, "")
    beside = Path(assets).parent / "crds" if assets else None
    return beside if beside is not None and beside.is_dir() else None


def missing_crds_reason(what: str) -> str:
    """Why ``what`` (a list of CRDs) cannot be installed here: the skip reason tests give."""
    named = os.environ.get(CRDS_ENV, "")
    if named:
        return f"needs {what}: {CRDS_ENV}={named} is not a folder"
    assets = os.environ.get(ASSETS_ENV, "")
    where = f"no crds/ folder beside {ASSETS_ENV}={assets}" if assets else f"{ASSETS_ENV} is unset too"
    return (f"needs {what}: {CRDS_ENV} is unset and {where}; set {CRDS_ENV} to a folder of their YAML "
            "(each project's release assets: prometheus-operator's stripped-down-crds.yaml, Karpenter's "
            "pkg/apis/crds in karpenter/)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Pki:
    """Files of the control plane's PKI (all under one temporary folder)."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(folder: Path) -> Pki:
    """A CA, the API server's serving cert (127.0.0.1, localhost), the admin client cert
    (O=system:masters) and the service-account signing keys: openssl, RSA 2048, one day."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=envtest-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=folder)
    (folder / "serving.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                        "extendedKeyUsage=serverAuth\n")
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subject, ext in (("serving", "/CN=127.0.0.1", "serving.ext"),
                               ("admin", "/O=system:masters/CN=envtest-admin", "client.ext")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", ext, "-out", f"{name}.crt", cwd=folder)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=folder)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)
    return Pki(folder / "ca.crt", folder / "ca.key", folder / "serving.crt", folder / "serving.key",
               folder / "admin.crt", folder / "admin.key", folder / "sa.key", folder / "sa.pub")


class ControlPlane:
    """etcd + kube-apiserver from ``assets``; ``start()``/``stop()``, or a context manager."""

    def __init__(self, assets: Path, workdir: Path | None = None, extra_args: tuple[str, ...] = ()) -> None:
        """``extra_args``: more kube-apiserver flags (feature gates, runtime-config)."""
        self.assets = assets
        self.extra_args = tuple(extra_args)
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="envtest-"))
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.port = free_port()
        self.pki: Pki | None = None
        self._etcd: subprocess.Popen | None = None
        self._apiserver: subprocess.Popen | None = None

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> "ControlPlane":
        self.pki = make_pki(self.workdir / "pki")
        try:
            self._start_etcd()
            self._start_apiserver()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in (self._apiserver, self._etcd):
            _terminate(proc)
        self._apiserver = self._etcd = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def stop_apiserver(self) -> None:
        """kube-apiserver goes away (connections refused); etcd keeps the data."""
        _terminate(self._apiserver)
        self._apiserver = None

    def start_apiserver(self) -> None:
        self._start_apiserver()

    def restart_apiserver(self, ready_within: float = START_TIMEOUT_SECONDS) -> None:
        """Stop and start kube-apiserver; ``ready_within``: how long /readyz may take (a server
        coming back to thousands of returning watches takes minutes on 2 cores)."""
        self.stop_apiserver()
        self._start_apiserver(ready_within)

    def _start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        self._etcd = self._spawn("etcd", [
            "--name", "envtest", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"envtest={peer}", "--unsafe-no-fsync"])

        def healthy() -> bool:
            self._check_alive(self._etcd, "etcd")
            return requests.get(f"{client}/health", timeout=2).ok

        wait_for(healthy, START_TIMEOUT_SECONDS, "etcd /health", retry_on=(requests.RequestException,),
                 interval=0.1)

    def _start_apiserver(self, ready_within: float = START_TIMEOUT_SECONDS) -> None:
        pki = self.pki
        assert pki is not None
        self._apiserver = self._spawn("kube-apiserver", [
            "--bind-address=127.0.0.1", f"--secure-port={self.port}",
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--authorization-mode=RBAC", "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            "--v=0", *self.extra_args])
        wait_for(self._ready, ready_within, "kube-apiserver /readyz",
                 retry_on=(requests.RequestException,), interval=0.2)

    def _check_alive(self, proc: subprocess.Popen | None, name: str) -> None:
        if proc is not None and proc.poll() is not None:
            log = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited ({proc.returncode}):\n{log}")

    def _ready(self) -> bool:
        self._check_alive(self._apiserver, "kube-apiserver")
        reply = self.admin_session().get(f"{self.url}/readyz", timeout=3)
        return reply.status_code == 200

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            return subprocess.Popen([str(self.assets / name), *args], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    # -- clients -----------------------------------------------------------------------------------

    def admin_session(self) -> requests.Session:
        pki = self.pki
        assert pki is not None
        session = requests.Session()
        session.trust_env = False  # REQUESTS_CA_BUNDLE would replace the CA below
        session.verify = str(pki.ca_cert)
        session.cert = (str(pki.admin_cert), str(pki.admin_key))
        return session

    def configuration(self, token: str | None = None):
        """A ``kubernetes`` client Configuration: the admin's certificate, or a bearer ``token``."""
        from kubernetes import client

        pki = self.pki
        assert pki is not None
        configuration = client.Configuration(host=self.url)
        configuration.ssl_ca_cert = str(pki.ca_cert)
        if token is None:
            configuration.cert_file = str(pki.admin_cert)
            configuration.key_file = str(pki.admin_key)
        else:
            configuration.api_key = {"authorization": f"Bearer {token}"}
        return configuration

    def api_client(self, token: str | None = None):
        from kubernetes import client

        return client.ApiClient(self.configuration(token))

    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        """A kubeconfig for the admin (or ``token``), as ``kubectl`` and ``--kubeconfig`` read it."""
        import yaml

        pki = self.pki
        assert pki is not None
        user = ({"token": token} if token is not None else
                {"client-certificate": str(pki.admin_cert), "client-key": str(pki.admin_key)})
        document = {
            "apiVersion": "v1", "kind": "Config", "current-context": "envtest",
            "clusters": [{"name": "envtest", "cluster": {"server": self.url,
                                                         "certificate-authority": str(pki.ca_cert)}}],
            "users": [{"name": "envtest", "user": user}],
            "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": "envtest"}}],
        }
        path.write_text(yaml.safe_dump(document))
        return path


def _terminate(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(STOP_TIMEOUT_SECONDS)


def wait_until_serving(plane: ControlPlane) -> None:
    """After a restart: the API server answers a real request (not only /readyz)."""
    wait_for(lambda: plane.admin_session().get(f"{plane.url}/api/v1/nodes?limit=1", timeout=3).ok,
             START_TIMEOUT_SECONDS, "the node list", retry_on=(requests.RequestException,), interval=0.2)


if __name__ == "__main__":  # python -m tests.support.envtest: start one by hand and wait
    assets = find_assets()
    if assets is None:
        raise SystemExit(missing_reason())
    with ControlPlane(assets) as plane:
        kubeconfig = plane.write_kubeconfig(plane.workdir / "kubeconfig")
        print(f"serving at {plane.url}; KUBECONFIG={kubeconfig}; Ctrl-C stops it", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
