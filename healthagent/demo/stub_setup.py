"""Put the stub NVML library in the real one's place: only when the demo or a test asks for it.

Why a step of its own: on a real node the agent loads whatever ``libnvidia-ml.so.1`` the driver
installed, and nothing on the production path (``healthagent run`` / ``check``) compiles code or
changes the environment to swap it. The demo, the tests and the benchmarks want the stub instead
(``stub_nvml.c``, answering from a JSON scenario file), so they call one of these first:

- ``use_stub_nvml(scenario)`` in this process: compile the stub (cached by source hash), name the
  scenario in ``HEALTHAGENT_STUB_NVML_SCENARIO`` (the stub reads it at ``nvmlInit``) and preload it
  so pynvml calls it. Loud (a warning), so a stub can never be mistaken for a real GPU;
- ``stub_nvml_env(scenario)`` for a child process (``healthagent check --host-root DEMO``): the
  environment under which that process's dynamic loader finds the stub as ``libnvidia-ml.so.1``
  and the stub finds its scenario, exactly as the agent would find a driver's library.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

from healthagent.demo import stub_nvml

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where compiled stubs are kept between runs: ``$XDG_CACHE_HOME/healthagent``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "healthagent"


def use_stub_nvml(scenario: Path | str, cache_dir: Path | None = None) -> Path:
    """Make NVML in this process the stub answering from ``scenario``; returns the library path.

    Idempotent; a later call with another scenario re-points the stub (it reads the variable at
    each ``nvmlInit``). Raises ``stub_nvml.StubBuildError`` without a C compiler, and
    RuntimeError when this process already loaded a real NVML (see ``stub_nvml.preload_stub``).
    """
    lib = stub_nvml.build_stub(cache_dir or default_cache_dir())
    os.environ[stub_nvml.SCENARIO_ENV] = str(scenario)
    stub_nvml.preload_stub(lib)
    log.warning("NVML is the stub library %s with scenario %s (demo/test)", lib, scenario)
    return lib


def stub_nvml_env(scenario: Path | str, cache_dir: Path | None = None,
                  base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment (``base``, default this process's) for a child whose NVML is the stub.

    The stub's folder goes first on ``LD_LIBRARY_PATH``: pynvml loads ``libnvidia-ml.so.1`` by
    name, and the stub carries that soname in a folder of its own.
    """
    lib = stub_nvml.build_stub(cache_dir or default_cache_dir())
    env = dict(os.environ if base is None else base)
    paths = [str(lib.parent)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
    env[stub_nvml.SCENARIO_ENV] = str(scenario)
    return env
