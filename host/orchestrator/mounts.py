"""Volume mounts of sandboxes (E2B `volumeMounts`): checked at create, served while the
sandbox runs, mounted by envd at every /init.

A sandbox's mounts (volume name, guest path) live in its record (`runtime.volume_mounts`)
and pass to its forks. Each time it starts running (create, fork, resume) the runtime
opens a socket where only its guest connects (its gateway address, inside its network
namespace), the node's `Volumes` serves the mounted volumes there, and envd's /init is
told to mount each one (envd/volumes). The server goes when the run ends
(`Context.end_run`).
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Sequence
from typing import Any

from host.network.sandbox import GATEWAY_IP, GUEST_SERVICE_PORT
from host.volumes import VolumeNotFound

from .errors import InvalidRequest, OperationFailed
from .opcontext import Context
from .states import SandboxState
from .store import SandboxRecord

log = logging.getLogger(__name__)

KEY = "volume_mounts"
MAX_MOUNTS = 16


def _problem(name: str, path: str, seen: set[str]) -> str | None:
    if not path:
        return "path cannot be empty"
    if not path.startswith("/"):
        return "path must be absolute"
    if path == "/":
        return "path must not be the root"
    if posixpath.normpath(path) != path:
        return "path must not contain any '.' or '..' components"
    if path in seen:
        return f"path '{path}' is already used"
    for other in seen:   # E2B lets mounts nest; a mount inside another's volume writes there
        if path.startswith(other + "/") or other.startswith(path + "/"):
            return f"path '{path}' overlaps the mount at '{other}'"
    return None


async def check(ctx: Context, mounts: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    """The create request's mounts as the record keeps them; E2B's one 400 listing every
    bad mount (`invalid mounts:\\n\\t- volume mount #i: <reason>`) otherwise."""
    if not mounts:
        return []
    if ctx.volumes is None:
        raise InvalidRequest("volume mounts are not supported by this server")
    if len(mounts) > MAX_MOUNTS:
        raise InvalidRequest(f"at most {MAX_MOUNTS} volume mounts, got {len(mounts)}")
    problems: list[str] = []
    seen: set[str] = set()
    for i, (name, path) in enumerate(mounts):
        problem = _problem(name, path, seen)
        if problem is None:
            try:
                await ctx.volumes.find(name)
            except VolumeNotFound:
                problem = f"volume '{name}' not found"
        if problem is not None:
            problems.append(f"volume mount #{i}: {problem}")
        seen.add(path)
    if problems:
        raise InvalidRequest("invalid mounts:\n\t- " + "\n\t- ".join(problems))
    return [{"name": name, "path": path} for name, path in mounts]


def of(rec: SandboxRecord) -> list[dict[str, str]]:
    return list(rec.runtime.get(KEY) or [])


async def attach(ctx: Context, sandbox_id: str,
                 mounts: list[dict[str, str]]) -> list[dict[str, str]] | None:
    """Serve `mounts` to the sandbox's guest; what its /init carries (None: no mounts)."""
    if not mounts or ctx.volumes is None:
        return None
    try:
        sock = await ctx.runtime.listen(sandbox_id)
        await ctx.volumes.attach(sandbox_id, [m["name"] for m in mounts], sock)
    except Exception as exc:
        raise OperationFailed(f"serving the volumes of {sandbox_id} failed: {exc}") from exc
    address = f"{GATEWAY_IP}:{GUEST_SERVICE_PORT}"
    return [{"name": m["name"], "path": m["path"], "address": address} for m in mounts]


async def detach(ctx: Context, sandbox_id: str) -> None:
    if ctx.volumes is not None:
        await ctx.volumes.detach(sandbox_id)


async def serve_running(ctx: Context) -> None:
    """After a restart: serve again the mounts of the sandboxes still running (their
    guests' mounts reconnect by themselves)."""
    for rec in await ctx.db(ctx.store.list_sandboxes, [SandboxState.RUNNING]):
        if of(rec):
            try:
                await attach(ctx, rec.id, of(rec))
            except OperationFailed:
                log.exception("serving the volumes of %s again failed", rec.id)


def wire(rec: SandboxRecord) -> list[dict[str, Any]]:
    return [{"name": m["name"], "path": m["path"]} for m in of(rec)]
