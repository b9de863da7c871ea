"""GET /files: stream a file to the client, optionally gzip-compressed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import zlib

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..services.filesystem import resolve, run_as, run_blocking
from ..state import Defaults
from .errors import Endpoint, HTTPError, json_errors
from .files import os_http_error, user_and_path

READ_CHUNK = 1024 * 1024


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
    return fd, st.st_size if stat.S_ISREG(st.st_mode) and not _size_unknown(path, st) else -1


def _size_unknown(path: str, st: os.stat_result) -> bool:
    """Files whose size says nothing about their content: procfs reports 0 (`boot_id`,
    `meminfo`), sysfs a page. They are read to EOF and sent without Content-Length."""
    if st.st_size == 0:
        return True
    real = os.path.realpath(path)
    return real.startswith(("/proc/", "/sys/"))


class FileStreamResponse(Response):
    """Streams an open fd (closing it in every case) and stops when the client leaves."""

    def __init__(self, fd: int, size: int, *, gzip: bool, head: bytes = b"") -> None:
        """`head`: the file's first bytes, already read (so that a file that cannot be
        read at all is an error status, not a response cut after its headers)."""
        super().__init__(media_type="application/octet-stream")
        self.fd, self.size, self.gzip, self.head = fd, size, gzip, head
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
        head: bytes | None = self.head

        def next_chunk() -> tuple[bytes, bool]:
            nonlocal remaining, head
            want = READ_CHUNK if remaining < 0 else min(READ_CHUNK, remaining)
            if head is not None:
                data, head = head, None
            else:
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
        user, raw_path, _ = user_and_path(defaults, request, "read")
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
            raise os_http_error(exc, raw_path) from None
        want = READ_CHUNK if size < 0 else min(READ_CHUNK, size)
        try:
            head = await run_blocking(os.read, fd, want) if want else b""
        except OSError as exc:
            os.close(fd)
            if size < 0:  # a special file that refuses reads (/proc/self/mem): the request
                raise HTTPError(400, f"cannot read '{raw_path}': "  # is wrong, not envd
                                     f"{exc.strerror or exc}") from None
            raise os_http_error(exc, raw_path) from None
        return FileStreamResponse(fd, size, gzip=encoding == "gzip", head=head)

    return download



__all__ = ["FileStreamResponse", "choose_encoding", "download_endpoint"]
