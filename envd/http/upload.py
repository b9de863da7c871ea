"""POST /files: multipart/form-data or octet-stream uploads, gzip-encoded or not.

Each file goes to a hidden temp file next to its destination as the body arrives;
the files of one request are published together or not at all, and a failed request
leaves neither files nor the directories it made (services/filesystem/atomic.py).
As E2B's envd, uploads run with envd's rights: missing parents are made and, with the
file, given to the requesting user (issue 14 item 8).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import re
import zlib
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..services.filesystem import (
    PendingFile,
    PublishError,
    publish_all,
    resolve,
    run_blocking,
    submit_blocking,
)
from ..state import Defaults
from ..users import User
from .errors import Endpoint, HTTPError, json_errors
from .files import os_http_error, user_and_path
from .multipart import (
    MultipartError,
    MultipartParser,
    PartData,
    PartEnd,
    PartStart,
    parse_header_params,
)

# Request body bytes gathered before one trip to the writer thread.
WRITE_BATCH = 1024 * 1024
# A stalled upload is dropped after this long without a body chunk.
UPLOAD_IDLE_TIMEOUT_S = 60.0
METADATA_HEADER_PREFIX = "x-metadata-"
_METADATA_KEY = re.compile(r"^[!#$%&'*+\-.^_`|~0-9a-z]+$")
_METADATA_VALUE = re.compile(r"^[\x20-\x7e]*$")
# On an early error, read (and drop) up to this much of the remaining body so the
# client gets to read our JSON answer instead of a broken pipe mid-send.
ERROR_DRAIN_LIMIT = 8 * 1024 * 1024


def _metadata(request: Request) -> dict[str, str] | None:
    metadata: dict[str, str] = {}
    for key, value in request.headers.items():  # starlette lowercases names
        if not key.startswith(METADATA_HEADER_PREFIX):
            continue
        name = key[len(METADATA_HEADER_PREFIX):]
        if not _METADATA_KEY.match(name):
            raise HTTPError(400, f"invalid metadata key '{name}'")
        if not _METADATA_VALUE.match(value):
            raise HTTPError(400, f"invalid metadata value for key '{name}': "
                                 "values must be printable ASCII")
        metadata[name] = value
    return metadata or None


async def _raw_body(request: Request) -> AsyncIterator[bytes]:
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), UPLOAD_IDLE_TIMEOUT_S)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise HTTPError(408, f"no upload data for {UPLOAD_IDLE_TIMEOUT_S:.0f}s") from None
        if chunk:
            yield chunk


async def _decoded(chunks: AsyncIterator[bytes], encoding: str) -> AsyncIterator[bytes]:
    if encoding in ("", "identity"):
        async for chunk in chunks:
            yield chunk
        return
    if encoding not in ("gzip", "x-gzip"):
        raise HTTPError(400, f"unsupported content encoding '{encoding}' (supported: gzip)")
    inflater = zlib.decompressobj(31)
    try:
        async for chunk in chunks:
            out: list[bytes] = []
            data = chunk
            while data:
                if inflater.eof:  # concatenated gzip members
                    inflater = zlib.decompressobj(31)
                out.append(inflater.decompress(data))
                data = inflater.unused_data if inflater.eof else b""
            joined = b"".join(out)
            if joined:
                yield joined
    except zlib.error as exc:
        raise HTTPError(400, f"invalid gzip request body: {exc}") from None
    if not inflater.eof:
        raise HTTPError(400, "invalid gzip request body: truncated stream")


class _Upload:
    """The files of one upload request: written to temp files, published together."""

    def __init__(self, user: User, metadata: dict[str, str] | None) -> None:
        self.user = user
        self.metadata = metadata
        self.files: list[tuple[str, PendingFile]] = []  # (resolved requested path, pending)
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._inflight: tuple[PendingFile, Future[None]] | None = None

    @property
    def current(self) -> PendingFile | None:
        return self.files[-1][1] if self.files else None

    async def start(self, raw_path: str) -> None:
        await self.flush()
        destination = resolve(raw_path, self.user)
        if any(requested == destination for requested, _ in self.files):
            raise HTTPError(400, f"destination '{destination}' appears more than once")
        # envd's own rights (root in a sandbox), the file and new parents the user's.
        owner = (self.user.uid, self.user.gid) if os.geteuid() == 0 else None
        try:
            pending = await run_blocking(functools.partial(
                PendingFile.open, destination, owner=owner, metadata=self.metadata))
        except OSError as exc:
            raise os_http_error(exc, raw_path) from None
        self.files.append((destination, pending))

    async def write(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered >= WRITE_BATCH:
            await self.flush()

    async def flush(self) -> None:
        """Hand buffered bytes to the writer thread. One write stays in flight while the
        next batch is received (double buffering); `settle()` waits for it."""
        await self.settle()
        pending = self.current
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        if chunks and pending is not None:
            self._inflight = (pending, submit_blocking(pending.write, chunks))

    async def settle(self) -> None:
        """Wait for the write in flight; its OSError becomes the HTTP error."""
        if self._inflight is None:
            return
        pending, future = self._inflight
        try:
            await asyncio.wrap_future(future)
        except OSError as exc:
            raise os_http_error(exc, pending.destination) from None
        finally:
            if future.done():
                self._inflight = None

    async def commit(self) -> list[dict[str, Any]]:
        await self.flush()
        await self.settle()
        try:
            await run_blocking(publish_all, [pending for _, pending in self.files],
                               self.metadata)
        except PublishError as exc:
            raise os_http_error(exc.cause, self.files[exc.index][0]) from None
        results = []
        for requested, _ in self.files:
            # Report the path as requested (a symlink stays the reported path).
            info: dict[str, Any] = {"path": requested, "name": os.path.basename(requested),
                                    "type": "file"}
            if self.metadata:
                info["metadata"] = dict(self.metadata)
            results.append(info)
        return results

    def abort(self) -> None:
        # Synchronous on purpose: it must finish even while the request is being cancelled.
        # A write in flight must end before its fd is closed (a reused fd number would
        # receive the rest); it is at most one WRITE_BATCH.
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight[1]])
            self._inflight = None
        # Last first: a later file's new directories may sit in an earlier file's.
        for _, pending in reversed(self.files):
            with contextlib.suppress(OSError):
                pending.abort()


async def _receive_multipart(upload: _Upload, body: AsyncIterator[bytes], boundary: str,
                             path_query: str) -> None:
    try:
        parser = MultipartParser(boundary)
        in_file = False
        async for chunk in body:
            for event in parser.feed(chunk):
                if isinstance(event, PartStart):
                    in_file = event.name == "file"
                    if not in_file:
                        continue  # parts not named `file` are ignored
                    raw_path = path_query or event.filename
                    if not raw_path:
                        raise HTTPError(400, "multipart part 'file' has no filename "
                                             "(destination path) and no 'path' was given")
                    await upload.start(raw_path)
                elif isinstance(event, PartData):
                    if in_file:
                        await upload.write(event.data)
                elif isinstance(event, PartEnd):
                    if in_file:
                        await upload.flush()
                    in_file = False
        parser.close()
    except MultipartError as exc:
        raise HTTPError(400, f"malformed multipart body: {exc}") from None
    if not upload.files:
        raise HTTPError(400, "multipart body has no part named 'file'")


async def _receive_octet_stream(upload: _Upload, body: AsyncIterator[bytes], raw_path: str) -> None:
    if not raw_path:
        raise HTTPError(400, "the 'path' query parameter is required for "
                             "application/octet-stream uploads")
    await upload.start(raw_path)
    async for chunk in body:
        await upload.write(chunk)


async def _drain(body: AsyncIterator[bytes], limit: int) -> None:
    with contextlib.suppress(Exception):
        seen = 0
        async for chunk in body:
            seen += len(chunk)
            if seen > limit:
                return


def upload_endpoint(defaults: Defaults) -> Endpoint:
    @json_errors
    async def upload(request: Request) -> Response:
        user, raw_path, _ = user_and_path(defaults, request, "write")
        metadata = _metadata(request)
        kind, params = parse_header_params(request.headers.get("content-type", ""))
        raw = _raw_body(request)
        body = _decoded(raw, request.headers.get("content-encoding", "").strip().lower())
        upload = _Upload(user, metadata)
        try:
            if kind == "multipart/form-data":
                boundary = params.get("boundary")
                if not boundary:
                    raise HTTPError(400, "multipart/form-data without a boundary")
                await _receive_multipart(upload, body, boundary, raw_path)
            elif kind == "application/octet-stream":
                await _receive_octet_stream(upload, body, raw_path)
            else:
                raise HTTPError(400, f"unsupported content type '{kind or '(none)'}' (use "
                                     "multipart/form-data or application/octet-stream)")
            results = await upload.commit()
        except ClientDisconnect:
            upload.abort()
            return Response(status_code=499)  # nobody reads it; keeps the access log honest
        except HTTPError as exc:
            upload.abort()
            if exc.status != 408:
                await _drain(raw, ERROR_DRAIN_LIMIT)
            raise
        except BaseException:
            upload.abort()
            raise
        return JSONResponse(results)

    return upload


__all__ = ["upload_endpoint"]
