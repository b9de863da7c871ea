"""Recipes of the built-in templates: what the node builds, through its own template
build pipeline, the first time a sandbox asks for one of them by name.

A recipe is what an SDK user would send to the template API (a source template, steps,
a start command and a ready check) plus `prepare`, which makes the COPY archives on the
host. `code-interpreter-v1` (the e2b-code-interpreter SDKs' default template) is the
built-in base template plus R and a JDK (Debian packages unpacked on the host), the
Python data stack with the other languages' kernels (pip on the host) and our
Jupyter-backed server on :49999 (templates/code-interpreter/). Its start command runs the
server and its ready check waits until the default python kernel is up, so the template
snapshot holds it warm and a new sandbox runs Python at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from host.contract import BuildStep
from host.vmm.image import ImageNotFound, find_image

from . import archives, debdeps, pydeps

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
CODE_INTERPRETER = "code-interpreter-v1"
GUEST_SITE_PACKAGES = "/usr/local/lib/python3.11/dist-packages"
SERVER_DIR = "/opt/aenv/code-interpreter"
SERVER_PORT = 49999
# the R and Java kernels' runtimes (the other languages' kernels come with pip)
DEBIAN_PACKAGES = ("r-cran-irkernel", "default-jdk-headless")
DEBS_STAGING = "/opt/aenv/debs"

Progress = Callable[[str], None]


class RecipeError(RuntimeError):
    """A recipe's inputs could not be prepared (missing files, pip failed)."""


@dataclass(frozen=True)
class Archive:
    files_hash: str          # the COPY step's filesHash (64 hex)
    path: Path               # the tar on the host, made by `prepare`


@dataclass(frozen=True)
class Prepared:
    steps: tuple[BuildStep, ...]
    archives: tuple[Archive, ...]


@dataclass(frozen=True)
class Recipe:
    alias: str
    cpu_count: int
    memory_mb: int
    min_free_disk_mb: int
    start_cmd: str
    ready_cmd: str
    prepare: Callable[[Path, Progress], Awaitable[Prepared]] = field(repr=False)


def _files_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(("aenv-builtin", *parts)).encode()).hexdigest()


async def _archive(src: Path, arcname: str, out_dir: Path, files_hash: str, *,
                   keep_pycache: bool) -> Archive:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{files_hash}.tar"
    if not path.is_file():
        await asyncio.to_thread(archives.write_tar, src, arcname, path,
                                keep_pycache=keep_pycache)
    return Archive(files_hash, path)


async def _prepare_code_interpreter(cache: Path, progress: Progress) -> Prepared:
    root = TEMPLATES_DIR / "code-interpreter"
    requirements, server = root / "requirements.txt", root / "server"
    if not requirements.is_file() or not (server / "aenv_code_interpreter").is_dir():
        raise RecipeError(f"the {CODE_INTERPRETER} recipe is missing under {root} "
                          "(run the service from a full checkout of the repository)")
    try:
        site = await pydeps.ensure_tree(requirements, cache, progress)
        rootfs = find_image(cache=cache).rootfs
        debs_tree = await debdeps.ensure_tree(DEBIAN_PACKAGES, rootfs, cache, progress)
    except (pydeps.PyDepsError, debdeps.DebDepsError, ImageNotFound) as exc:
        raise RecipeError(str(exc)) from exc
    out = cache / "builtin-archives"
    progress("packing the template's files")
    deps = await _archive(site, "site-packages", out,
                          _files_hash("pydeps", pydeps.tree_key(requirements)), keep_pycache=True)
    debs = await _archive(debs_tree, "debs", out,
                          _files_hash("debdeps", debs_tree.parent.name), keep_pycache=True)
    code = await _archive(server, "server", out, _files_hash(
        "server", await asyncio.to_thread(archives.tree_digest, server)), keep_pycache=False)
    q = shlex.quote
    warm = ("import matplotlib.pyplot, numpy, pandas, ipykernel, jupyter_client, "
            "aenv_code_interpreter")
    steps = (
        BuildStep("COPY", ("debs/", f"{DEBS_STAGING}/", "root", ""), files_hash=debs.files_hash),
        # merged into / as hard links (same disk), then the linker cache: what installing
        # the packages would have left, without dpkg under TCG (host/builtin/debdeps.py)
        BuildStep("RUN", (f"cp -a -l {DEBS_STAGING}/. / && rm -rf {DEBS_STAGING} && ldconfig",
                          "root")),
        BuildStep("COPY", ("site-packages/", f"{GUEST_SITE_PACKAGES}/", "root", ""),
                  files_hash=deps.files_hash),
        BuildStep("COPY", ("server/", f"{SERVER_DIR}/", "root", ""), files_hash=code.files_hash),
        # imports once as the sandbox user: matplotlib's font cache is built here, in the
        # template, instead of in every sandbox's first plot
        BuildStep("RUN", (f"PYTHONPATH={SERVER_DIR} python3 -c {q(warm)}", "user")),
        BuildStep("USER", ("user",)),
        BuildStep("WORKDIR", ("/home/user",)),
    )
    return Prepared(steps=steps, archives=(debs, deps, code))


RECIPES: dict[str, Recipe] = {
    CODE_INTERPRETER: Recipe(
        alias=CODE_INTERPRETER, cpu_count=1, memory_mb=1024, min_free_disk_mb=1024,
        start_cmd=f"PYTHONPATH={SERVER_DIR} python3 -m aenv_code_interpreter",
        ready_cmd=f"curl -sf http://127.0.0.1:{SERVER_PORT}/health",
        prepare=_prepare_code_interpreter),
}
