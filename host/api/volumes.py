"""The volume handlers: `/volumes` (API key) and `/volumecontent/{volumeID}/...` (the
volume's own token, `Authorization: Bearer`, checked by `Volumes.files`).

File bytes stream both ways: a read is sent in chunks from an open fd, a write is copied
from the request body into an upload that appears in the volume only when complete
(host/volumes/files.py); every blocking call runs off the event loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from host.volumes import Volumes
from host.volumes.files import Entry, VolumeFiles

from . import volume_models as vm
from .errors import ApiError
from .sandboxes import orch, reply

CHUNK = 1 << 20


def volumes(request: Request) -> Volumes:
    """The node orchestrator's volumes (a cluster's gateway keeps none yet)."""
    found: Volumes | None = getattr(orch(request), "volumes", None)
    if found is None:
        raise ApiError(501, "this server keeps no volumes")
    return found


def _time(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def stat_model(e: Entry) -> vm.VolumeEntryStat:
    body = vm.VolumeEntryStat(name=e.name, type=e.type,  # type: ignore[arg-type]
                              path=e.path, size=e.size, mode=e.mode, uid=e.uid, gid=e.gid,
                              atime=_time(e.atime), mtime=_time(e.mtime),
                              ctime=_time(e.ctime))
    if e.target is not None:
        body.target = e.target
    return body


# --- /volumes ---------------------------------------------------------------------------

async def create(request: Request, *, body: vm.NewVolume) -> Response:
    vols = volumes(request)
    rec = await vols.create(body.name)
    return reply(vm.VolumeAndToken(volumeID=rec.volume_id, name=rec.name,
                                   token=vols.token(rec)), 201)


async def list_all(request: Request) -> Response:
    return reply([vm.Volume(volumeID=r.volume_id, name=r.name)
                  for r in await volumes(request).list()])


async def get_one(request: Request) -> Response:
    vols = volumes(request)
    rec = await vols.get(request.path_params["volumeID"])
    return reply(vm.VolumeAndToken(volumeID=rec.volume_id, name=rec.name,
                                   token=vols.token(rec)))


async def destroy(request: Request) -> Response:
    await volumes(request).destroy(request.path_params["volumeID"])
    return Response(status_code=204)


# --- /volumecontent/{volumeID}/... ------------------------------------------------------

def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


async def _files(request: Request) -> VolumeFiles:
    return await volumes(request).files(request.path_params["volumeID"], _bearer(request))


async def _on(request: Request, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
    """`fn(files, ...)` on the volume's files, off the event loop; the files closed after."""
    files = await _files(request)
    try:
        return await asyncio.to_thread(fn, files, *args, **kwargs)
    finally:
        files.close()


async def stat(request: Request, *, query: vm.PathQuery) -> Response:
    return reply(stat_model(await _on(request, VolumeFiles.stat, query.path)))


async def list_dir(request: Request, *, query: vm.DirQuery) -> Response:
    entries = await _on(request, VolumeFiles.list, query.path, query.depth)
    return reply([stat_model(e) for e in entries])


async def make_dir(request: Request, *, query: vm.CreateQuery) -> Response:
    entry = await _on(request, VolumeFiles.make_dir, query.path, uid=query.uid,
                      gid=query.gid, mode=query.mode, force=query.force)
    return reply(stat_model(entry), 201)


async def set_metadata(request: Request, *, query: vm.PathQuery,
                       body: vm.VolumeMetadata) -> Response:
    entry = await _on(request, VolumeFiles.set_meta, query.path, uid=body.uid,
                      gid=body.gid, mode=body.mode)
    return reply(stat_model(entry))


async def remove(request: Request, *, query: vm.PathQuery) -> Response:
    await _on(request, VolumeFiles.remove, query.path)
    return Response(status_code=204)


async def read_file(request: Request, *, query: vm.PathQuery) -> Response:
    files = await _files(request)
    try:
        fd, entry = await asyncio.to_thread(files.open_read, query.path)
    finally:
        files.close()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while data := await asyncio.to_thread(os.read, fd, CHUNK):
                yield data
        finally:
            os.close(fd)

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"Content-Length": str(entry.size)})


async def write_file(request: Request, *, query: vm.CreateQuery) -> Response:
    files = await _files(request)
    try:
        upload = await asyncio.to_thread(files.create, query.path, force=query.force,
                                         uid=query.uid, gid=query.gid)
        try:
            async for chunk in request.stream():
                if chunk:
                    await asyncio.to_thread(upload.write, chunk)
            entry = await asyncio.to_thread(upload.commit, uid=query.uid, gid=query.gid,
                                            mode=query.mode)
        except BaseException:
            await asyncio.to_thread(upload.abort)
            raise
    finally:
        files.close()
    return reply(stat_model(entry), 201)
