"""A fresh Debian 12 root to run deploy/install.sh in, and the mounts a chroot into it needs.

The root is debootstrap'd (minbase + systemd) once, with the Debian packages install.sh asks
for already installed, and cached as a tarball under
`$AENV_CACHE/deploy-chroot/<key>/root.tar.zst`, keyed by the suite, the mirror and that
package list: a changed list builds a new one. Each test run unpacks a copy and removes it.

`mounted()` guarantees that nothing stays mounted under the root when it exits, even on
failure, and `remove_root()` refuses to delete a tree that still has a mount in it (a
bind-mounted /dev must never meet `rm -rf`; the test runs do without the host's /dev).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

SUITE = "bookworm"
RECIPE_VERSION = 1  # bump when build_tarball() changes what the root holds
# systemd: `systemctl enable` works offline and the targets the units name exist
BASE_PACKAGES = ("systemd", "ca-certificates")
CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive",
    "PIP_DEFAULT_TIMEOUT": "180", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}


def cache_dir() -> Path:
    return Path(os.environ.get("AENV_CACHE", "/var/cache/aenv")) / "deploy-chroot"


def debian_mirror() -> str:
    """The mirror this machine's apt uses (as rootfs/build.sh: AENV_DEBIAN_MIRROR wins)."""
    if os.environ.get("AENV_DEBIAN_MIRROR"):
        return os.environ["AENV_DEBIAN_MIRROR"]
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.is_file():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    return "http://deb.debian.org/debian"


def root_key(packages: Sequence[str], backports: Sequence[str] = ()) -> str:
    spec: dict[str, object] = {"suite": SUITE, "mirror": debian_mirror(),
                               "recipe": RECIPE_VERSION,
                               "packages": sorted({*BASE_PACKAGES, *packages})}
    if backports:
        spec["backports"] = sorted(backports)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def run(argv: Sequence[str], *, timeout: float = 1800, **kw: object) -> str:
    """Run a command; on failure raise with its output (the last 4000 characters)."""
    p = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}:\n{p.stdout[-4000:]}")
    return str(p.stdout)


def in_root(root: Path, argv: Sequence[str], *, timeout: float = 1800) -> str:
    """Run argv inside the root (chroot) with a clean environment."""
    return run(["chroot", str(root), *argv], timeout=timeout, env=CHROOT_ENV)


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below root, deepest first."""
    base = str(root.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")  # \040 -> " "
        if point == base or point.startswith(base + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


@contextlib.contextmanager
def mounted(root: Path, binds: Sequence[tuple[Path, str]] = (), *,
            dev: bool = False) -> Iterator[None]:
    """/proc and the given (host dir, path in root) binds mounted while inside, and the
    host's /dev with `dev` (package installs; otherwise the device nodes debootstrap made
    do, and no removal of the root can ever reach the host's /dev).

    On exit everything is unmounted (lazily if busy) and RuntimeError is raised if a mount
    is still left under root."""
    done: list[Path] = []

    def mount(args: list[str], target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        run(["mount", *args, str(target)])
        done.append(target)

    try:
        mount(["-t", "proc", "proc"], root / "proc")
        if dev:
            mount(["--bind", "/dev"], root / "dev")
        for src, dst in binds:
            mount(["--bind", str(src)], root / dst.lstrip("/"))
        yield
    finally:
        for target in reversed(done):
            if subprocess.run(["umount", str(target)], check=False,
                              capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(target)], check=False,
                               capture_output=True)
        left = mounts_under(root)
        if left:
            raise RuntimeError(f"still mounted under {root}: {left}")


def remove_root(root: Path) -> None:
    """rm -rf root, but never across a mount point."""
    if not root.exists():
        return
    left = mounts_under(root)
    if left:
        raise RuntimeError(f"refusing to remove {root}: still mounted: {left}")
    shutil.rmtree(root)


def _sources(mirror: str) -> str:
    security = mirror.replace("/debian", "/debian-security") if mirror.endswith("/debian") \
        else "http://deb.debian.org/debian-security"
    return (f"Types: deb\nURIs: {mirror}\nSuites: {SUITE} {SUITE}-updates\nComponents: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
            f"Types: deb\nURIs: {security}\nSuites: {SUITE}-security\nComponents: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")


def build_tarball(packages: Sequence[str], backports: Sequence[str] = ()) -> Path:
    """The cached root tarball with `packages` installed, those of `backports` from
    bookworm-backports (as deploy/install.sh installs them; its sources stay), built now
    if missing."""
    d = cache_dir() / root_key(packages, backports)
    tarball = d / "root.tar.zst"
    if tarball.is_file():
        return tarball
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building the same key
        if tarball.is_file():
            return tarball
        work = Path(tempfile.mkdtemp(prefix="build-", dir=d))
        root = work / "root"
        try:
            mirror = debian_mirror()
            run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                 SUITE, str(root), mirror], timeout=3600)
            (root / "etc/apt/sources.list").unlink(missing_ok=True)
            (root / "etc/apt/sources.list.d/debian.sources").write_text(_sources(mirror))
            shutil.copy2("/etc/resolv.conf", root / "etc/resolv.conf")
            policy = root / "usr/sbin/policy-rc.d"  # no daemon starts in the chroot
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
            with mounted(root, dev=True):
                in_root(root, ["apt-get", "-q", "update"])
                in_root(root, ["apt-get", "-q", "install", "-y", "--no-install-recommends",
                               *packages], timeout=3600)
                if backports:
                    (root / "etc/apt/sources.list.d/backports.sources").write_text(
                        f"Types: deb\nURIs: {mirror}\nSuites: {SUITE}-backports\n"
                        "Components: main\n"
                        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
                    in_root(root, ["apt-get", "-q", "update"])
                    in_root(root, ["apt-get", "-q", "install", "-y", "--no-install-recommends",
                                   "-t", f"{SUITE}-backports", *backports], timeout=3600)
                in_root(root, ["apt-get", "clean"])
            policy.unlink()
            for lists in (root / "var/lib/apt/lists").glob("*_*"):
                lists.unlink()
            (root / "etc/resolv.conf").unlink()
            tmp = d / "root.tar.zst.tmp"
            run(["tar", "-C", str(root), "--numeric-owner", "--xattrs", "-I", "zstd -T0 -3",
                 "-cf", str(tmp), "."], timeout=3600)
            tmp.rename(tarball)
        finally:
            remove_root(work)
    return tarball


def unpack(tarball: Path, root: Path) -> None:
    root.mkdir(parents=True)
    run(["tar", "-C", str(root), "--numeric-owner", "--xattrs", "-I", "zstd -T0",
         "-xf", str(tarball)], timeout=1800)


def prepare(root: Path) -> None:
    """Make the root reach this machine's network the way the host does: its resolver and
    hosts, its CA certificates (an egress proxy may sign TLS with its own) and its pip
    configuration (index, constraints)."""
    for f in ("/etc/resolv.conf", "/etc/hosts"):
        target = root / f.lstrip("/")
        target.unlink(missing_ok=True)
        shutil.copy2(f, target)
    local_ca = Path("/usr/local/share/ca-certificates")
    if local_ca.is_dir() and any(local_ca.iterdir()):
        shutil.copytree(local_ca, root / "usr/local/share/ca-certificates", dirs_exist_ok=True)
        in_root(root, ["update-ca-certificates"])
    for conf in ("/etc/pip.conf", "/etc/xdg/pip"):
        src = Path(conf)
        if src.is_dir():
            shutil.copytree(src, root / conf.lstrip("/"), dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, root / conf.lstrip("/"))
