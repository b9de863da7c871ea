"""The Debian packages of a built-in template, fetched and unpacked on the host.

The code interpreter's R and Java kernels need r-base-core and a JDK: 60-odd packages,
about 300 MB unpacked. A guest has no route to a mirror, and `dpkg -i` under TCG (xz
decompression, a fsync per file) costs minutes; so, as pydeps does for pip, the host
does the work: apt resolves the packages against the guest's own dpkg status (read
from the image's root filesystem), downloads what the guest lacks from the image's
mirror and suite, and `dpkg-deb -x` unpacks them into one tree that a COPY step puts in
the guest. apt and dpkg do the resolving and unpacking; written here is only the glue,
and the few things maintainer scripts would have done that these packages need
(`FIXUPS` below), since no maintainer script runs. The tree is cached under
`<cache>/debdeps/<key>`, keyed by the packages, the guest's status and this recipe,
and published by one rename.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

RECIPE_VERSION = 2
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# directories nothing in a sandbox reads: docs, manuals, and the JDK's jmods (jlink only)
_PRUNE = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/lintian",
          "usr/share/locale")
_PRUNE_GLOBS = ("usr/lib/jvm/*/jmods", "usr/lib/jvm/*/lib/src.zip")
Progress = Callable[[str], None]


class DebDepsError(RuntimeError):
    """apt or dpkg-deb failed, or the guest's package status could not be read."""


def mirror() -> str:
    """The mirror the image's base layer came from (rootfs/build.sh reads the same)."""
    return os.environ.get("AENV_DEBIAN_MIRROR", DEFAULT_MIRROR)


async def _run(*argv: str, what: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"})
    out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise DebDepsError(f"{what} failed (exit {proc.returncode}): {tail}")
    return text


async def guest_status(rootfs: Path) -> bytes:
    """The guest's /var/lib/dpkg/status, read out of its ext4 root filesystem image."""
    if shutil.which("debugfs") is None:
        raise DebDepsError("debugfs is missing (e2fsprogs; run make setup)")
    proc = await asyncio.create_subprocess_exec(
        "debugfs", "-R", "cat /var/lib/dpkg/status", str(rootfs),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0 or b"Package: " not in out:
        raise DebDepsError(f"cannot read the dpkg status of {rootfs}: "
                           f"{err.decode(errors='replace').strip()[-300:]}")
    return out


def tree_key(packages: Sequence[str], status: bytes) -> str:
    h = hashlib.sha256()
    h.update(f"recipe={RECIPE_VERSION} suite={SUITE} mirror={mirror()}\n".encode())
    h.update(" ".join(sorted(packages)).encode() + b"\n")
    h.update(status)
    return h.hexdigest()[:16]


def _apt_options(state: Path, status: Path) -> list[str]:
    """apt confined to its own sources, lists, cache and preferences, resolving against
    the guest's status file instead of this machine's."""
    return ["-o", f"Dir::Etc::SourceList={state / 'sources.list'}",
            "-o", f"Dir::Etc::SourceParts={state / 'sources.list.d'}",
            "-o", f"Dir::Etc::Preferences={state / 'preferences'}",
            "-o", f"Dir::Etc::PreferencesParts={state / 'preferences.d'}",
            "-o", f"Dir::State::Lists={state / 'lists'}",
            "-o", f"Dir::State::status={status}",
            "-o", f"Dir::Cache={state / 'cache'}",
            "-o", f"Dir::Cache::Archives={state / 'archives'}",
            "-o", "APT::Architecture=amd64", "-o", "APT::Get::List-Cleanup=0",
            "-o", "Debug::NoLocking=1", "-o", "APT::Install-Recommends=0",
            "-o", "APT::Install-Suggests=0"]


async def _download(packages: Sequence[str], status: Path, state: Path,
                    progress: Progress) -> list[Path]:
    for sub in ("sources.list.d", "preferences.d", "lists/partial", "cache",
                "archives/partial"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "sources.list").write_text(f"deb [signed-by={KEYRING}] {mirror()} {SUITE} main\n")
    (state / "preferences").write_text("")
    opts = _apt_options(state, status)
    progress(f"apt: package lists of {mirror()} {SUITE}")
    await _run("apt-get", *opts, "-q", "update", what="apt-get update")
    # what the guest lacks, by apt's resolver ("Inst NAME (VERSION ... [ARCH])" lines of
    # a simulated install), fetched into the shared archive cache
    out = await _run("apt-get", *opts, "-q", "-y", "--simulate", "install", *packages,
                     what=f"resolving {' '.join(packages)}")
    debs = [state / "archives" / _deb_name(line) for line in out.splitlines()
            if line.startswith("Inst ")]
    if not debs:
        raise DebDepsError(f"apt found nothing to install for {' '.join(packages)}: "
                           "the image has them already, or the status read is wrong")
    progress(f"apt: downloading {len(debs)} packages for {' '.join(packages)}")
    await _run("apt-get", *opts, "-q", "-y", "--download-only", "install", *packages,
               what="apt-get --download-only install")
    missing = [d.name for d in debs if not d.is_file()]
    if missing:
        raise DebDepsError(f"apt did not download {missing[:5]}")
    return debs


def _deb_name(inst_line: str) -> str:
    """The archive file name apt gives the package of one simulated `Inst` line."""
    parts = inst_line.split()
    name, version, arch = parts[1], parts[2].lstrip("("), parts[-1].strip("[])")
    return f"{name}_{version.replace(':', '%3a')}_{arch}.deb"


def _merge_usr(root: Path) -> None:
    """/bin, /sbin, /lib* are symlinks into /usr on bookworm: a tree with real
    directories there would clash with them when copied over the guest's root."""
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        src = root / top
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, root / "usr" / top, symlinks=True, dirs_exist_ok=True)
            shutil.rmtree(src)


# update-alternatives' job in the postinst scripts: (link, the glob of its target)
ALTERNATIVES = (
    ("usr/bin/java", "usr/lib/jvm/*/bin/java"),          # openjdk-*-jre-headless
    ("usr/bin/jshell", "usr/lib/jvm/*/bin/jshell"),      # openjdk-*-jdk-headless
    ("usr/bin/javac", "usr/lib/jvm/*/bin/javac"),
    # libblas3 / liblapack3: R links against the generic names
    ("usr/lib/x86_64-linux-gnu/libblas.so.3", "usr/lib/x86_64-linux-gnu/blas/libblas.so.3"),
    ("usr/lib/x86_64-linux-gnu/liblapack.so.3",
     "usr/lib/x86_64-linux-gnu/lapack/liblapack.so.3"),
)


def _alternatives(root: Path) -> None:
    for link_rel, pattern in ALTERNATIVES:
        found = sorted(root.glob(pattern))
        link = root / link_rel
        if found and not link.exists() and not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to("/" + found[-1].relative_to(root).as_posix())


def _r_environ(root: Path) -> None:
    # r-base-core's postinst writes /etc/R/Renviron from this template (ucf); R reads it
    # through R_HOME/etc/Renviron and refuses to start without it
    template = root / "usr/lib/R/etc/Renviron.ucf"
    target = root / "etc/R/Renviron"
    if template.is_file() and not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(template, target)


FIXUPS: tuple[Callable[[Path], None], ...] = (_merge_usr, _alternatives, _r_environ)


async def ensure_tree(packages: Sequence[str], rootfs: Path, cache: Path,
                      progress: Progress = lambda _m: None) -> Path:
    """The unpacked tree of `packages` and what they need beyond the guest image
    `rootfs` already has (its `root` directory), made once."""
    status = await guest_status(rootfs)
    key = tree_key(packages, status)
    base = cache / "debdeps"
    final = base / key
    tree = final / "root"
    if tree.is_dir():
        return tree
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=base))
    try:
        status_file = work / "status"
        status_file.write_bytes(status)
        debs = await _download(packages, status_file, base / "apt", progress)
        progress(f"unpacking {len(debs)} packages")
        root = work / "root"
        root.mkdir()
        for deb in debs:
            await _run("dpkg-deb", "-x", str(deb), str(root), what=f"dpkg-deb -x {deb.name}")
        for rel in _PRUNE:
            shutil.rmtree(root / rel, ignore_errors=True)
        for pattern in _PRUNE_GLOBS:
            for path in root.glob(pattern):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for fixup in FIXUPS:
            fixup(root)
        listing = root / "usr/share/aenv/debdeps.list"
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.write_text("".join(f"{d.name}\n" for d in debs))
        status_file.unlink()
        work.rename(final)
    except OSError as exc:
        if not tree.is_dir():
            raise DebDepsError(f"cannot build the package tree in {base}: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress(f"guest Debian packages ready: {tree}")
    return tree
