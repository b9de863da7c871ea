"""The Python packages of a built-in template, resolved and installed on the host.

The guest's python3 (Debian bookworm: CPython 3.11, glibc 2.36) gets a ready tree of
packages instead of running pip itself: under TCG a guest pip (resolve, download, unzip,
byte-compile) costs minutes, the guest may have no route to an index, and the host's pip
already knows this machine's index and certificates. pip does the work (`--target` with
the guest's platform tags), not hand-written wheel handling; the tree is cached under
`<cache>/pydeps/<key>`, keyed by the requirements file and this recipe, and published by
one rename, so a crash leaves no half tree behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

RECIPE_VERSION = 3
GUEST_PYTHON = "3.11"
# glibc 2.36 runs every tag up to 2_36; these are the ones the pinned wheels carry
GUEST_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64")
# package directories whose test suites are never imported (about 70 MB of 370)
_PRUNE_TESTS = ("numpy", "pandas", "matplotlib")


class PyDepsError(RuntimeError):
    """pip could not install the requirements."""


def tree_key(requirements: Path) -> str:
    h = hashlib.sha256()
    h.update(f"recipe={RECIPE_VERSION} python={GUEST_PYTHON} {GUEST_PLATFORMS}\n".encode())
    h.update(requirements.read_bytes())
    return h.hexdigest()[:16]


def pip_argv(requirements: Path, target: Path) -> list[str]:
    argv = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "--no-warn-conflicts", "--no-input", "--target", str(target),
            "--only-binary=:all:", "--implementation", "cp",
            "--python-version", GUEST_PYTHON, "-r", str(requirements)]
    for p in GUEST_PLATFORMS:
        argv += ["--platform", p]
    return argv


async def ensure_tree(requirements: Path, cache: Path,
                      progress: Callable[[str], None] = lambda _m: None) -> Path:
    """The installed tree for `requirements` (its `site-packages` directory), made once."""
    key = tree_key(requirements)
    final = cache / "pydeps" / key
    site = final / "site-packages"
    if site.is_dir():
        return site
    final.parent.mkdir(parents=True, exist_ok=True)
    work = final.parent / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    progress(f"installing the guest's Python packages ({requirements.name}) with pip")
    proc = await asyncio.create_subprocess_exec(
        *pip_argv(requirements, work / "site-packages"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"})
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        tail = out.decode(errors="replace").strip().splitlines()[-15:]
        raise PyDepsError(f"pip install -r {requirements} failed (exit {proc.returncode}): "
                          + "\n".join(tail))
    _prune(work / "site-packages")
    try:
        work.rename(final)
    except OSError:                 # another process published the same tree first
        shutil.rmtree(work, ignore_errors=True)
    progress(f"guest Python packages ready: {site}")
    return site


def _prune(site: Path) -> None:
    # console scripts carry the host interpreter's path in their shebang: useless in the
    # guest; binaries a wheel ships there (deno) stay, their package finds them in bin/
    for path in sorted((site / "bin").glob("*")) if (site / "bin").is_dir() else ():
        with open(path, "rb") as f:
            if f.read(2) == b"#!":
                path.unlink()
    for pkg in _PRUNE_TESTS:
        root = site / pkg
        if root.is_dir():
            for tests in sorted(root.rglob("tests"), reverse=True):
                if tests.is_dir():
                    shutil.rmtree(tests, ignore_errors=True)
