"""deploy/install.sh on a fresh Debian 12 root: `--role all --no-start` in a debootstrap'd
chroot (tests/deploy/chroot.py), then the layout it made, its units under
`systemd-analyze verify`, its commands run inside the root, and a second run that changes
nothing and keeps an operator's edit.

The root is the HEAD of this repository (git archive) with the working tree's deploy/ over
it, as a release would ship it. pip inside the root reaches the package index the way this
machine does (its pip configuration and CA certificates are copied in); its downloads are
cached next to the root tarball.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from . import chroot

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
ROLES = ("node", "gateway", "scheduler")
SRC_IN_ROOT = "/usr/src/aenv"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(2400),
    pytest.mark.skipif(os.geteuid() != 0, reason="chroot and mounts need root"),
    pytest.mark.skipif(shutil.which("debootstrap") is None, reason="debootstrap is missing"),
    pytest.mark.skipif(shutil.which("git") is None, reason="git is missing"),
]


@dataclass
class Installed:
    root: Path
    outputs: list[str] = field(default_factory=list)   # install.sh's output, run by run
    seconds: list[float] = field(default_factory=list)

    def install(self, *extra: str) -> str:
        """Run the root's deploy/install.sh --role all inside it."""
        pip_cache = chroot.cache_dir() / "pip-cache"
        pip_cache.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with chroot.mounted(self.root, [(pip_cache, "/root/.cache/pip")]):
            out = chroot.in_root(self.root, [f"{SRC_IN_ROOT}/deploy/install.sh",
                                             "--role", "all", *extra])
        self.seconds.append(time.monotonic() - t0)
        self.outputs.append(out)
        return out

    def run(self, *argv: str) -> str:
        with chroot.mounted(self.root):
            return chroot.in_root(self.root, argv, timeout=300)

    def path(self, p: str) -> Path:
        return self.root / p.lstrip("/")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """A fresh root after one run of install.sh; removed afterwards (nothing left mounted)."""
    packages = subprocess.run([str(DEPLOY / "install.sh"), "--list-packages", "--role", "all"],
                              capture_output=True, text=True, check=True).stdout.split()
    # what install.sh takes from bookworm-backports (QEMU 10, e2fsprogs 1.47.2)
    script = (f"eval \"$(grep '^PKG_BACKPORTS=' {DEPLOY / 'install.sh'})\"; "
              "echo \"${PKG_BACKPORTS[*]}\"")
    backports = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                               check=True).stdout.split()
    assert {"qemu-system-x86", "e2fsprogs"} <= set(backports)
    tarball = chroot.build_tarball(packages, [p for p in backports if p in packages])
    root = tmp_path_factory.mktemp("deploy") / "root"
    try:
        chroot.unpack(tarball, root)
        chroot.prepare(root)
        src = root / SRC_IN_ROOT.lstrip("/")
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        shutil.rmtree(src / "deploy", ignore_errors=True)
        shutil.copytree(DEPLOY, src / "deploy", symlinks=True)
        # as a checkout made under umask 077: install.sh must not pass that on
        subprocess.run(["chmod", "-R", "go-rwx", str(src)], check=True)
        inst = Installed(root)
        inst.install("--no-start")
        yield inst
    finally:
        chroot.remove_root(root)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def _readable_by_all(p: Path) -> bool:
    need = 0o005 if p.is_dir() else 0o004
    return _mode(p) & need == need


def test_first_run_lays_out_code_config_state_and_units(installed: Installed) -> None:
    out = installed.outputs[0]
    last = out.strip().splitlines()[-1]
    assert last.startswith("install: done (") and last.endswith("roles node gateway scheduler")
    for role in ROLES:
        unit = installed.path(f"/etc/systemd/system/aenv-{role}.service")
        assert unit.read_bytes() == (DEPLOY / "systemd" / unit.name).read_bytes()
        assert f"unit: /etc/systemd/system/aenv-{role}.service" in out
        wants = installed.path(f"/etc/systemd/system/multi-user.target.wants/{unit.name}")
        assert wants.is_symlink(), f"{unit.name} is not enabled"
        env = installed.path(f"/etc/aenv/{role}.env")
        assert _mode(env) == 0o600 and env.stat().st_uid == 0 and env.stat().st_gid == 0
        assert env.read_bytes() == (DEPLOY / "systemd" / f"{role}.env").read_bytes()
    keys = installed.path("/etc/aenv/api_keys")
    assert _mode(keys) == 0o600
    lines = keys.read_text().split()
    assert len(lines) == 1 and lines[0].startswith("e2b_") and len(lines[0]) == 44
    node_key = installed.path("/etc/aenv/node_key")   # its own secret, not a client's key
    assert _mode(node_key) == 0o600
    (key,) = node_key.read_text().split()
    assert key.startswith("aenv_node_") and len(key) == 74 and key not in lines
    state = installed.path("/var/lib/aenv")
    assert state.is_dir() and _mode(state) == 0o700
    assert os.readlink(state / "api_keys") == "/etc/aenv/api_keys"
    assert os.readlink(state / "node_key") == "/etc/aenv/node_key"
    assert os.readlink(installed.path("/usr/local/bin/aenv")) == "/opt/aenv/.venv/bin/aenv"
    assert installed.path("/opt/aenv/.venv/bin/python").exists()
    assert (installed.path("/opt/aenv/host/__main__.py")).is_file()
    # readable by the cluster services' dynamic users, though the source was root's only
    unreadable = [p for p in installed.path("/opt/aenv").rglob("*")
                  if ".venv" not in p.parts and not p.is_symlink() and not _readable_by_all(p)]
    assert not unreadable, unreadable[:5]
    # only the source tree was copied, not the checkout's tests or VCS data
    assert not installed.path("/opt/aenv/tests").exists()
    assert not installed.path("/opt/aenv/.git").exists()
    assert "note: no guest kernel/image" in out
    # nothing of the package step: the cached root has them (keyed by --list-packages)
    assert "apt-get install" not in out


def test_units_verify_against_the_installed_root(installed: Installed) -> None:
    units = [f"aenv-{r}.service" for r in ROLES]
    p = subprocess.run(["systemd-analyze", "verify", f"--root={installed.root}", *units],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    ours = [ln for ln in (p.stdout + p.stderr).splitlines() if "aenv" in ln]
    assert not ours, ours


def test_installed_commands_run_inside_the_root(installed: Installed) -> None:
    out = installed.run("/opt/aenv/.venv/bin/python", "-m", "host", "--help")
    assert "--state-dir" in out and "--api-port" in out
    out = installed.run("aenv", "--help")
    assert "Usage" in out or "usage" in out
    for role in ("gateway", "scheduler"):
        if not installed.path(f"/opt/aenv/host/cluster/{role}/__main__.py").exists():
            continue  # the cluster services are not in this HEAD yet
        out = installed.run("/opt/aenv/.venv/bin/python", "-m", f"host.cluster.{role}", "--help")
        assert "--redis" in out and "--listen" in out


def test_second_run_changes_nothing_and_keeps_the_operators_config(
        installed: Installed) -> None:
    node_env = installed.path("/etc/aenv/node.env")
    edited = node_env.read_text() + "AENV_LOG_LEVEL=debug  # the operator's edit\n"
    node_env.write_text(edited)
    units = {r: installed.path(f"/etc/systemd/system/aenv-{r}.service").stat().st_mtime_ns
             for r in ROLES}
    out = installed.install()  # without --no-start: it sees that systemd does not run here
    assert "install: systemd is not running here: nothing is started" in out
    assert out.strip().splitlines()[-1].startswith("install: nothing to do"), out
    assert node_env.read_text() == edited
    assert _mode(node_env) == 0o600
    assert units == {r: installed.path(f"/etc/systemd/system/aenv-{r}.service")
                     .stat().st_mtime_ns for r in ROLES}
    # the no-op is fast: no copy, no pip
    assert installed.seconds[1] < 30, installed.seconds
