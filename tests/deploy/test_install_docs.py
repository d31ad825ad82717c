"""docs/install.md's quick start is three commands that name real overlays and the real image."""

from __future__ import annotations

import re
import shlex

import pytest

from healthagent import __version__
from tests.support.deploy import DEPLOY, REPO, agent_container, render

INSTALL = REPO / "docs" / "install.md"


def quick_start_commands() -> list[str]:
    text = INSTALL.read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line for line in block.splitlines() if line.strip()]


def test_quick_start_is_three_commands():
    commands = quick_start_commands()
    assert len(commands) == 3
    assert commands[0].startswith("docker build ") and f"healthagent:{__version__}" in commands[0]
    assert all("kubectl apply --server-side -f -" in c for c in commands[1:])


@pytest.mark.integration
def test_quick_start_overlays_exist_and_the_sed_hits_the_image(kubectl):
    dry_run, live = quick_start_commands()[1:]
    for command, overlay in ((dry_run, "dry-run"), (live, "generic")):
        words = shlex.split(command)
        assert words[:3] == ["kubectl", "kustomize", f"deploy/overlays/{overlay}"]
        sed = words[words.index("sed") + 1]
        _, old, new, _ = sed.split("|")
        image = agent_container(render(DEPLOY / "overlays" / overlay, kubectl))["image"]
        assert old == f"image: {image}" == f"image: healthagent:{__version__}"
        assert new == f"image: $REGISTRY/healthagent:{__version__}"


def test_documented_components_and_overlays_exist():
    text = INSTALL.read_text(encoding="utf-8")
    for path in set(re.findall(r"deploy/(?:overlays|components)/[a-z-]+", text)):
        assert (REPO / path / "kustomization.yaml").is_file(), path
