"""A real loopback HTTP server posing as a hostile envd, and a measure of the host process's
peak memory (tests/orchestrator/test_envd_limits.py, tests/test_guestio.py).

The server is a raw asyncio server: it writes whatever an answer function writes, so it
can answer a 1 GiB body or claim a 1 GiB Connect message. Huge bodies are generated
lazily, one shared 64 KiB chunk at a time, and the writer waits for the socket to drain:
the test itself never holds more than a chunk, so the memory measured is the host's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Self

from host.contract import Placement

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
CHUNK = 64 * KIB
_ZEROS = bytes(CHUNK)

Writer = asyncio.StreamWriter
Answer = Callable[[Writer], Awaitable[None]]


def frame(message: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message).encode()
    return bytes([flags]) + len(payload).to_bytes(4, "big") + payload


async def _head(w: Writer, status: int, headers: dict[str, str]) -> None:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
    w.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    await w.drain()


async def _body(w: Writer, parts: Iterator[bytes], *, chunked: bool) -> None:
    """Write `parts` until they end or the host hangs up (then drain raises)."""
    for part in parts:
        if w.transport.is_closing():
            return
        w.write(f"{len(part):x}\r\n".encode() + part + b"\r\n" if chunked else part)
        await w.drain()
    if chunked:
        w.write(b"0\r\n\r\n")
        await w.drain()


def zeros(size: int) -> Iterator[bytes]:
    """`size` zero bytes, a shared chunk at a time (never materialized)."""
    left = size
    while left > 0:
        n = min(left, CHUNK)
        yield _ZEROS if n == CHUNK else _ZEROS[:n]
        left -= n


def huge(size: int = GIB, *, status: int = 200, length: bool = True,
         content_type: str = "application/json",
         headers: dict[str, str] | None = None) -> Answer:
    """An answer with a `size`-byte body of zeros: with a Content-Length saying so
    (`length`), or chunked (the host learns the size only by reading)."""
    async def answer(w: Writer) -> None:
        framing = {"Content-Length": str(size)} if length else {"Transfer-Encoding": "chunked"}
        await _head(w, status, {"Content-Type": content_type, **framing, **(headers or {})})
        await _body(w, zeros(size), chunked=not length)
    return answer


def claimed_message(claim: int = GIB) -> Answer:
    """A Connect stream whose first envelope header claims `claim` bytes, then that
    many bytes of body (lazily) for a host that would wait for them."""
    async def answer(w: Writer) -> None:
        await _head(w, 200, {"Content-Type": "application/connect+json",
                             "Transfer-Encoding": "chunked"})
        await _body(w, _chain(bytes([0]) + claim.to_bytes(4, "big"), zeros(claim)),
                    chunked=True)
    return answer


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def output_stream(size: int, *, exit_code: int = 0) -> Answer:
    """A process stream that prints `size` bytes of 'x' on stdout without a newline (one
    envelope of 48 KiB of output, reused), then ends with `exit_code`."""
    data = frame({"event": {"data": {"stdout": base64.b64encode(b"x" * (48 * KIB)).decode()}}})

    def parts() -> Iterator[bytes]:
        yield frame({"event": {"start": {"pid": 7}}})
        for _ in range(-(-size // (48 * KIB))):
            yield data
        yield frame({"event": {"end": {"exitCode": exit_code, "exited": True}}})
        yield frame({}, flags=2)

    async def answer(w: Writer) -> None:
        await _head(w, 200, {"Content-Type": "application/connect+json",
                             "Transfer-Encoding": "chunked"})
        await _body(w, parts(), chunked=True)
    return answer


def plain(status: int = 200, body: bytes = b"", *,
          content_type: str = "application/json") -> Answer:
    async def answer(w: Writer) -> None:
        await _head(w, status, {"Content-Type": content_type,
                                "Content-Length": str(len(body))})
        w.write(body)
        await w.drain()
    return answer


class HostileEnvd:
    """`routes` maps a path (no query) to its answer; anything else answers 404.
    `asked` records the paths in order."""

    def __init__(self, routes: dict[str, Answer] | None = None) -> None:
        self.routes: dict[str, Answer] = dict(routes or {})
        self.asked: list[str] = []
        self._server: asyncio.Server | None = None
        self._writers: set[Writer] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        # hang up on every connection still open: its handler ends on the closed socket
        for w in list(self._writers):
            w.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def placement(self, sandbox_id: str = "sbx-hostile") -> Placement:
        """A placement whose envd port (49983) is forwarded here, as user-mode
        networking forwards it."""
        return Placement(sandbox_id=sandbox_id, envd_host="127.0.0.1", envd_port=self.port,
                         facts={"port_forwards": {"49983": self.port}})

    async def _serve(self, reader: asyncio.StreamReader, w: Writer) -> None:
        self._writers.add(w)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:  # keep-alive: one request after another until the host hangs up
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *fields = head.decode("latin-1").split("\r\n")
                path = request_line.split(" ")[1].split("?")[0]
                length = next((int(f.split(":", 1)[1]) for f in fields
                               if f.lower().startswith("content-length:")), 0)
                await reader.readexactly(length)
                self.asked.append(path)
                await self.routes.get(path, plain(404, b'{"message":"no"}'))(w)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._writers.discard(w)
            self._handlers.discard(task)
            w.close()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


class PeakRss:
    """How much the process's resident memory rose at its peak inside the block: the
    kernel's high-water mark (VmHWM), reset on entry through /proc/self/clear_refs, less
    VmRSS on entry. A body read whole and dropped again shows here, where a VmRSS read
    after the block would miss it. Where the reset is refused, VmRSS after the block."""

    def __init__(self) -> None:
        self.grown_bytes = 0
        self._base_kib = 0
        self._peak = False

    def __enter__(self) -> Self:
        gc.collect()
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS
            self._peak = True
        self._base_kib = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        after = _status_kib("VmHWM" if self._peak else "VmRSS")
        self.grown_bytes = max(0, after - self._base_kib) * KIB
