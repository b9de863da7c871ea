"""GET /files (download) and POST /files (upload), spec §4.5.

Both run file access as the user from the `username` query (default: the sandbox
default user), are authorized by X-Access-Token or a signed URL, stream the body
in bounded chunks (nothing is held in memory whole) and answer errors as JSON.
Uploads are all-or-nothing per request (services/filesystem/atomic.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import stat
import zlib
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ..auth import require_file_access
from ..services.filesystem import PendingFile, resolve, run_as, run_blocking, submit_blocking
from ..state import Defaults
from ..users import User
from .errors import Endpoint, HTTPError, json_errors, os_error_message, os_error_status
from .multipart import (
    MultipartError,
    MultipartParser,
    PartData,
    PartEnd,
    PartStart,
    parse_header_params,
)

READ_CHUNK = 1024 * 1024
# Request body bytes gathered before one trip to the writer thread.
WRITE_BATCH = 1024 * 1024
# A stalled upload is dropped after this long without a body chunk.
UPLOAD_IDLE_TIMEOUT_S = 60.0
METADATA_HEADER_PREFIX = "x-metadata-"
_METADATA_KEY = re.compile(r"^[!#$%&'*+\-.^_`|~0-9a-z]+$")
_METADATA_VALUE = re.compile(r"^[\x20-\x7e]*$")


# ---------------------------------------------------------------- shared helpers

def _user_and_path(defaults: Defaults, request: Request, operation: str) -> tuple[User, str, str]:
    """Authorize the request; return (user, raw path query, username query)."""
    q = request.query_params
    raw_path = q.get("path", "")
    username = q.get("username", "")
    require_file_access(
        defaults,
        presented_token=request.headers.get("x-access-token"),
        path=raw_path,
        operation=operation,
        user=username,
        signature=q.get("signature"),
        expiration=q.get("signature_expiration"),
    )
    return User.lookup(username or defaults.user), raw_path, username


def _os_http_error(exc: OSError, path: str) -> HTTPError:
    return HTTPError(os_error_status(exc), os_error_message(exc, path))


# ---------------------------------------------------------------- download

def choose_encoding(accept_encoding: str | None) -> str | None:
    """'gzip', 'identity' or None (nothing acceptable → 406).

    gzip is used when the client asks for it specifically (the SDKs send exactly
    `Accept-Encoding: gzip` for `gzip=True`); generic transport defaults that offer
    several codings (`gzip, deflate, br`) get identity, the fastest choice for
    file transfers and a no-op for already-compressed data.
    """
    if accept_encoding is None or not accept_encoding.strip():
        return "identity"
    prefs: dict[str, float] = {}
    for item in accept_encoding.split(","):
        token, *params = item.strip().split(";")
        token = token.strip().lower()
        if not token:
            continue
        q = 1.0
        for param in params:
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        prefs["gzip" if token == "x-gzip" else token] = q
    wildcard = prefs.get("*")
    identity_q = prefs.get("identity", wildcard if wildcard is not None else 1.0)
    gzip_q = prefs.get("gzip", wildcard if wildcard is not None else 0.0)
    others = [t for t, q in prefs.items() if t not in ("gzip", "identity", "*") and q > 0]
    if "gzip" in prefs and gzip_q > 0 and not others and gzip_q >= identity_q:
        return "gzip"
    if identity_q > 0:
        return "identity"
    if gzip_q > 0:
        return "gzip"
    return None


def _open_for_read(path: str) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "path is a directory", path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size if stat.S_ISREG(st.st_mode) else -1


class FileStreamResponse(Response):
    """Streams an open fd (closing it in every case) and stops when the client leaves."""

    def __init__(self, fd: int, size: int, *, gzip: bool) -> None:
        super().__init__(media_type="application/octet-stream")
        self.fd, self.size, self.gzip = fd, size, gzip
        if gzip:
            self.headers["content-encoding"] = "gzip"
            self.headers["vary"] = "Accept-Encoding"
            del self.headers["content-length"]
        elif size >= 0:
            self.headers["content-length"] = str(size)
        else:
            del self.headers["content-length"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch_disconnect())
        compressor = zlib.compressobj(6, zlib.DEFLATED, 31) if self.gzip else None
        remaining = self.size  # never send more than Content-Length if the file grows

        def next_chunk() -> tuple[bytes, bool]:
            nonlocal remaining
            want = READ_CHUNK if remaining < 0 else min(READ_CHUNK, remaining)
            data = os.read(self.fd, want) if want else b""
            if remaining >= 0:
                remaining -= len(data)
            finished = not data or remaining == 0
            if compressor is None:
                return data, finished
            out = compressor.compress(data)
            return (out + compressor.flush(), True) if finished else (out, False)

        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            finished = False
            while not finished and not gone.is_set():
                chunk, finished = await run_blocking(next_chunk)
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            os.close(self.fd)


def download_endpoint(defaults: Defaults) -> Endpoint:
    @json_errors
    async def download(request: Request) -> Response:
        user, raw_path, _ = _user_and_path(defaults, request, "read")
        path = resolve(raw_path, user)
        encoding = choose_encoding(request.headers.get("accept-encoding"))
        if encoding is None:
            raise HTTPError(406, "none of the accepted encodings is supported "
                                 "(supported: gzip, identity)")
        try:
            fd, size = await run_as(user, _open_for_read, path)
        except IsADirectoryError:
            raise HTTPError(400, f"path '{raw_path}' is a directory") from None
        except OSError as exc:
            raise _os_http_error(exc, raw_path) from None
        return FileStreamResponse(fd, size, gzip=encoding == "gzip")

    return download


# ---------------------------------------------------------------- upload

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
        try:
            pending = await run_as(self.user, PendingFile.open, destination)
        except OSError as exc:
            raise _os_http_error(exc, raw_path) from None
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
            raise _os_http_error(exc, pending.destination) from None
        finally:
            if future.done():
                self._inflight = None

    async def commit(self) -> list[dict[str, Any]]:
        await self.flush()
        await self.settle()
        results = []
        for requested, pending in self.files:
            try:
                await run_as(self.user, pending.commit, self.metadata)
            except OSError as exc:
                raise _os_http_error(exc, requested) from None
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
        for _, pending in self.files:
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
        user, raw_path, _ = _user_and_path(defaults, request, "write")
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
