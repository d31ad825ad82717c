"""Putting the stub NVML library in place (``healthagent/demo/stub_setup.py``), the step the demo
and the tests take themselves: for a child process, an environment under which its dynamic loader
finds the stub as ``libnvidia-ml.so.1`` and the stub finds its scenario. (In-process use,
``use_stub_nvml``, is what every in-process NVML test of the suite starts with.)"""

from __future__ import annotations

import os
import shutil

import pytest

from healthagent.demo.stub_nvml import SCENARIO_ENV, SONAME
from healthagent.demo.stub_setup import default_cache_dir, stub_nvml_env
from tests.support.nvml_stub import NO_CC


def test_a_child_finds_the_stub_first_and_keeps_its_library_path(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    base = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/a:/opt/b"}
    env = stub_nvml_env(tmp_path / "scenario.json", tmp_path / "cache", base=base)
    first, *rest = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert first.startswith(str(tmp_path / "cache"))
    assert os.path.isfile(os.path.join(first, SONAME))
    assert rest == ["/opt/a", "/opt/b"]
    assert env[SCENARIO_ENV] == str(tmp_path / "scenario.json") and env["PATH"] == "/usr/bin"
    assert base == {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/a:/opt/b"}  # the caller's is kept


def test_the_cache_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "healthagent"
