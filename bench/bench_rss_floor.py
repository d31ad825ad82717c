"""Where the agent's resident memory comes from, and how far it is from 60 MiB.

    .venv/bin/python -m bench.bench_rss_floor [--seconds 120]

Three parts:

1. import floors: a fresh interpreter for each row imports one more layer (the standard library
   modules the agent needs, then its third-party dependencies one at a time, then the agent's own
   modules, then ``kubernetes.client``) and reports VmRSS and the module count. The rows are
   cumulative, so each difference is what that layer costs on top of the ones before.
2. what the running agent holds: ``AgentRuntime`` built as ``healthagent run --kube kubeconfig``
   builds it, then the top-level packages in ``sys.modules``. Only the packages the production
   image installs (``pip install .``: no test extras) may appear; ``kubernetes_validate``,
   ``jsonschema``, ``pytest`` and ``hypothesis`` are test-only and must not.
3. ``healthagent run`` writing to a fake API server through the ``kubernetes`` client for
   ``--seconds`` (the demo node, stub NVML): from this venv (test extras installed: the
   ``kubernetes`` package imports ``kubernetes_validate`` and ``jsonschema`` when they are
   installed), and from a fresh venv holding what the production image installs (``pip install
   .``, no extras), with glibc's default malloc arenas and with ``MALLOC_ARENA_MAX=2`` (each thread
   that allocates may otherwise get its own arena, whose touched pages stay resident).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, mib, table
from tests.support.live_agent import AgentProcess, HoldingKubeFake, write_kubeconfig

LAYERS = (
    ("bare interpreter", ""),
    ("+ standard library the agent uses (ssl, http.server, json, logging, threading)",
     "import ssl, http.server, http.client, json, logging, threading, urllib.request, socketserver"),
    ("+ yaml", "import yaml"),
    ("+ pynvml", "import pynvml"),
    ("+ requests", "import requests"),
    ("+ prometheus_client", "import prometheus_client, prometheus_client.parser"),
    ("+ the agent without Kubernetes (wiring, sources, policy, telemetry)", "import healthagent.wiring"),
    ("+ kubernetes.client (every API model class)", "import kubernetes.client, kubernetes.watch, kubernetes.config"),
)
TEST_ONLY = ("kubernetes_validate", "jsonschema", "referencing", "pytest", "hypothesis", "_pytest")

RSS_PROBE = ("import sys\n{code}\nrss = [l for l in open('/proc/self/status') if l.startswith('VmRSS')][0]\n"
             "print(int(rss.split()[1]), len(sys.modules))")

PACKAGES_PROBE = """
import json, sys, tempfile
from pathlib import Path
from healthagent.config import load_settings
from healthagent.demo.node import build_demo_root
from healthagent.wiring import AgentRuntime
work = Path(tempfile.mkdtemp())
demo = build_demo_root(work / "root")
settings = load_settings(env={}, flags=dict(host_root=str(demo.root), kube="kubeconfig", kubeconfig=sys.argv[1],
    node_name="gpu-node-0", listen="127.0.0.1:0", state_file=str(work / "state.json"), nvml=False,
    log_level="ERROR"))
runtime = AgentRuntime(settings)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules if not name.startswith("_")})))
"""


def import_floors() -> list[list]:
    rows, code, before = [], "", None
    for name, layer in LAYERS:
        code = f"{code}\n{layer}" if layer else code
        out = subprocess.run([sys.executable, "-c", RSS_PROBE.format(code=code)], capture_output=True,
                             text=True, check=True).stdout.split()
        rss, modules = int(out[0]), int(out[1])
        rows.append([name, mib(rss), "" if before is None else f"{(rss - before) / 1024:+.1f} MiB", modules])
        before = rss
    return rows


def loaded_packages(kubeconfig: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PACKAGES_PROBE, str(kubeconfig)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def production_venv(where: Path) -> str:
    """A venv with the package and its runtime dependencies only, as the image's ``pip install``."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    subprocess.run([str(where / "bin" / "pip"), "install", "-q", str(Path(__file__).resolve().parent.parent)],
                   check=True)
    return str(where / "bin" / "python")


def agent_rss(seconds: float, kube_url: str, work: Path, extra_env: dict[str, str], python: str | None) -> dict:
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import stub_nvml_env

    demo = build_demo_root(work / "root")
    env = dict(stub_nvml_env(demo.scenario, work / "cache" / "healthagent"), **extra_env)
    agent = AgentProcess(dict(host_root=demo.root, node_name="gpu-node-0", listen="127.0.0.1:0",
                              state_file=work / "state.json", expected_gpus=8, expected_efa_devices=32,
                              kube="kubeconfig", kubeconfig=write_kubeconfig(kube_url, work / "kubeconfig")),
                         work / "agent.log", env=env, python=python)
    try:
        agent.wait_metric(lambda s: s.value("healthagent_efa_devices") == 32, what="a first cycle")
        time.sleep(seconds)
        return {"rss": agent.rss_kib(), "peak": agent.hwm_kib()}
    finally:
        agent.signal(signal.SIGTERM)
        agent.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    print(f"resident memory floors; {machine()}")
    print("\n1. import floors (each row a fresh interpreter, layers cumulative)")
    print(table(["layer", "VmRSS", "added", "modules"], import_floors()))
    with tempfile.TemporaryDirectory(prefix="bench-rss-") as tmp, HoldingKubeFake() as fake:
        fake.seed_nodes(20)
        packages = loaded_packages(write_kubeconfig(fake.url, Path(tmp) / "kubeconfig"))
        test_only = [p for p in packages if p in TEST_ONLY]
        print(f"\n2. top-level packages the agent process holds ({len(packages)}); test-only among them: "
              f"{', '.join(test_only) or 'none'}")
        print("   third-party: " + ", ".join(p for p in packages if p in (
            "kubernetes", "urllib3", "requests", "certifi", "charset_normalizer", "idna", "yaml", "pynvml",
            "prometheus_client", "dateutil", "six", "google", "oauthlib", "requests_oauthlib", "websocket",
            "durationpy")))
        production = production_venv(Path(tmp) / "production-venv")
        rows = []
        for venv, python in (("this venv (test extras)", None), ("production (pip install .)", production)):
            for name, env in (("default arenas", {}), ("MALLOC_ARENA_MAX=2", {"MALLOC_ARENA_MAX": "2"})):
                got = agent_rss(args.seconds, fake.url, Path(tmp) / f"run-{len(rows)}", env, python)
                rows.append([venv, name, mib(got["rss"]), mib(got["peak"])])
        print(f"\n3. healthagent run through the kubernetes client, {args.seconds:.0f} s after its first cycle")
        print(table(["packages", "allocator", "RSS", "peak RSS"], rows))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
