"""Uploaded COPY archives: `<files_dir>/<filesHash>`, one file per hash (§4).

The SDK's filesHash is a hash of the COPY step and the files' names, modes and bytes, not
of the archive (docs/e2b-template-api.md §4a), so an upload cannot be checked against it:
it is stored under that name as sent. An upload is written to a temporary file in the
same directory and renamed into place only once complete, so a file under a hash is always
whole; anything that fails or is cancelled removes the temporary file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterable
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import InvalidRequest, UploadTooLarge
from ..opcontext import Context
from . import lookup as templates
from .names import is_files_hash

_PARTIAL = ".upload-"
_BATCH = 1 << 20  # bytes handed to the writer thread at a time


def file_path(ctx: Context, files_hash: str) -> Path:
    if not is_files_hash(files_hash):
        raise InvalidRequest("Invalid files hash")
    return ctx.files_dir / files_hash


async def present(ctx: Context, files_hash: str) -> bool:
    """The archive was uploaded (recorded, and its file is there). A use: it is kept
    `build_cache_ttl` from now (the SDK asks before every build that COPYs it)."""
    path = file_path(ctx, files_hash)
    if not await ctx.db(ctx.templates.use_file, files_hash, time.time()):
        return False
    return await asyncio.to_thread(path.is_file)


async def expire(ctx: Context, ttl_s: float, *, dry_run: bool = False) -> dict[str, Any]:
    """Remove the archives unused for `ttl_s` (none while a build waits or runs): their
    rows first, so a later `present` answers no and the SDK uploads again; then each
    file, unless it was written again meanwhile (a new upload of the same hash)."""
    before = time.time() - ttl_s  # wall-clock, as the rows' times
    rows = await ctx.db(ctx.templates.expire_files, before, dry_run=dry_run)

    def unlink() -> None:
        for files_hash, _ in rows:
            path = ctx.files_dir / files_hash
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < before:
                    path.unlink()

    if not dry_run:
        await asyncio.to_thread(unlink)
    return {"files": len(rows), "bytes": sum(size for _, size in rows),
            "digests": [h for h, _ in rows]}


async def template_file(ctx: Context, template_ref: str, files_hash: str) -> bool:
    """GET /templates/{id}/files/{hash}: 400 for a malformed hash, 404 for an unknown
    template; whether the archive is already here."""
    file_path(ctx, files_hash)
    await templates.require(ctx, template_ref)
    return await present(ctx, files_hash)


async def put_file(ctx: Context, files_hash: str, chunks: AsyncIterable[bytes], *,
                   max_bytes: int) -> int:
    """Store an upload under `files_hash`; returns its size. UploadTooLarge beyond
    `max_bytes` (nothing is kept)."""
    final = file_path(ctx, files_hash)
    await asyncio.to_thread(ctx.files_dir.mkdir, mode=0o700, parents=True, exist_ok=True)
    partial = ctx.files_dir / f"{_PARTIAL}{files_hash}.{secrets.token_hex(4)}"
    f: BinaryIO = await asyncio.to_thread(open, partial, "xb")
    size = 0
    try:
        buf = bytearray()
        async for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                raise UploadTooLarge(f"upload of '{files_hash}' is larger than the limit of "
                                     f"{max_bytes} bytes")
            buf += chunk
            if len(buf) >= _BATCH:
                await asyncio.to_thread(f.write, bytes(buf))
                buf.clear()
        await asyncio.to_thread(_finish, f, bytes(buf), partial, final)
    except BaseException:
        await asyncio.to_thread(_discard, f, partial)
        raise
    await ctx.db(ctx.templates.add_file, files_hash, size, time.time())
    return size


async def adopt(ctx: Context, files_hash: str, source: Path) -> int:
    """Store the local archive `source` (a built-in template's, made on the host) under
    `files_hash` without streaming it: a hard link when on the same filesystem, else a
    copy to a temporary name renamed into place. Returns its size."""
    final = file_path(ctx, files_hash)

    def place() -> int:
        ctx.files_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = ctx.files_dir / f"{_PARTIAL}{files_hash}.{secrets.token_hex(4)}"
        try:
            try:
                os.link(source, partial)
            except OSError:
                shutil.copyfile(source, partial)
            os.replace(partial, final)
        finally:
            partial.unlink(missing_ok=True)
        return final.stat().st_size

    size = await asyncio.to_thread(place)
    await ctx.db(ctx.templates.add_file, files_hash, size, time.time())
    return size


def _finish(f: BinaryIO, tail: bytes, partial: Path, final: Path) -> None:
    f.write(tail)
    f.flush()
    os.fsync(f.fileno())
    f.close()
    os.replace(partial, final)


def _discard(f: BinaryIO, partial: Path) -> None:
    with contextlib.suppress(OSError):
        f.close()
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()


def remove_partials(files_dir: Path) -> list[str]:
    """Temporary files of uploads cut short by a restart (blocking; at start)."""
    removed = []
    if files_dir.is_dir():
        for p in files_dir.glob(f"{_PARTIAL}*"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p.name)
    return removed
