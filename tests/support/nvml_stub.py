"""Run the real pynvml bindings and ``NvmlSource`` against the stub libnvidia-ml.so.1, isolated.

pynvml keeps module-global library state (the loaded library, cached function pointers, an init
refcount), so each scenario runs in a fresh Python process: ``run_steps`` writes a list of steps,
runs ``python -m tests.support.nvml_driver STEPS`` and returns one JSON result per step. The steps
mutate the scenario with the same helpers the demo and benchmarks use (``healthagent.demo.stub_nvml``)
and call the source exactly as the agent's loop does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT_SECONDS = 300


# Every test that needs the stub library skips with this when there is no C compiler.
NO_CC = ("cc not installed (apt-get install gcc; .ci/run installs it): the stub libnvidia-ml.so.1 is "
         "compiled from C")


def stub_library_or_skip(cache_dir: Path) -> Path:
    """Build the stub (cached by source hash), or skip the calling test when ``cc`` is missing."""
    from healthagent.demo import stub_nvml

    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    return stub_nvml.build_stub(cache_dir)


SANITIZER_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-g", "-O1",
                   "-std=gnu11", "-pthread")
SANITIZER_BUILD_TIMEOUT_SECONDS = 300


def sanitizer_harness(harness: Path, cache_dir: Path) -> Path:
    """The stub compiled with ``harness`` under ASan and UBSan, built once per (sources, flags,
    compiler) into ``cache_dir``: a sanitizer build is the slowest compile of the suite, and the
    same sources give the same binary. Raises ``StubBuildError`` with the compiler's complaint
    (a toolchain without the sanitizer runtimes, say), which the caller turns into a skip."""
    from healthagent.demo import stub_nvml

    compiler = shutil.which("cc")
    if compiler is None:
        raise stub_nvml.StubBuildError("cc not installed")
    key = hashlib.sha256()
    for part in (harness.read_bytes(), stub_nvml.STUB_SOURCE.read_bytes(), "\0".join(SANITIZER_FLAGS).encode(),
                 f"{compiler}\0{os.stat(compiler).st_mtime_ns}".encode()):
        key.update(hashlib.sha256(part).digest())
    target = Path(cache_dir) / f"sanitizer-harness-{key.hexdigest()[:16]}" / "asan_harness"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", dir=target.parent)
    os.close(fd)
    try:
        build = subprocess.run([compiler, *SANITIZER_FLAGS, "-o", tmp_name, str(harness), str(stub_nvml.STUB_SOURCE)],
                               capture_output=True, text=True, timeout=SANITIZER_BUILD_TIMEOUT_SECONDS)
        if build.returncode != 0:
            raise stub_nvml.StubBuildError(build.stderr.strip()[-300:])
        os.replace(tmp_name, target)  # concurrent builders each rename a whole binary into place
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
    return target


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    """The compiled stub library (import this fixture into a test module to use it)."""
    return stub_library_or_skip(tmp_path_factory.mktemp("stub-nvml-cache"))


@pytest.fixture
def scenario(tmp_path) -> Path:
    """A private copy of the bundled 8 x H100 scenario that the test may mutate."""
    from healthagent.demo import stub_nvml

    return stub_nvml.copy_demo_scenario(tmp_path / "nvml-scenario.json")


def run_steps(lib: Path | None, scenario: Path | None, steps: list[dict[str, Any]],
              source_args: dict[str, Any] | None = None) -> list[Any]:
    """Run ``steps`` in a fresh interpreter; ``lib=None`` runs without the stub (no NVML at all)."""
    env = dict(os.environ)
    env.pop("HEALTHAGENT_STUB_NVML_SCENARIO", None)
    if scenario is not None:
        env["HEALTHAGENT_STUB_NVML_SCENARIO"] = str(scenario)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"lib": str(lib) if lib else None, "scenario": str(scenario) if scenario else None,
                   "source_args": source_args or {}, "steps": steps}, fh)
        plan = fh.name
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.support.nvml_driver", plan], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, errors="replace",
                              timeout=SUBPROCESS_TIMEOUT_SECONDS)
    finally:
        os.unlink(plan)
    if proc.returncode != 0:
        raise AssertionError(f"driver exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
