"""deploy/README.md names every deployment and the test that checks it, and the "from
source" method is still the top-level README's two commands, whose make targets exist."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
FROM_SOURCE = ("make setup kernel image run", "make setup && make test")


def test_readme_names_every_deployment_and_its_test() -> None:
    text = (DEPLOY / "README.md").read_text()
    entries = [f"`{p.name}/`" if p.is_dir() else f"`{p.name}`"
               for p in sorted(DEPLOY.iterdir()) if p.name != "README.md"]
    entries = [e.replace("`compose/`", "`compose/docker-compose.yml`") for e in entries]
    assert not [e for e in entries if e not in text]
    tests = [p.name for p in sorted(Path(__file__).parent.glob("test_*.py"))]
    assert not [t for t in tests if t not in text]


def test_from_source_is_the_readmes_two_commands() -> None:
    top = (REPO / "README.md").read_text()
    ours = (DEPLOY / "README.md").read_text()
    for command in FROM_SOURCE:
        assert command in top and command in ours


@pytest.mark.skipif(shutil.which("make") is None, reason="make is missing")
@pytest.mark.parametrize("targets", [["setup", "kernel", "image", "run"], ["setup", "test"]])
def test_from_source_targets_exist(targets: list[str]) -> None:
    """`make -n` expands the targets without running them."""
    p = subprocess.run(["make", "-n", "-C", str(REPO), *targets], capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert "scripts/setup.sh" in p.stdout
