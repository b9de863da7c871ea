"""envd /health probing: stalled accepts (like slirp before the guest listens) must not
hold the waiter up, and the first real answer ends the wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from host.vmm.readiness import probe_health, wait_for_health

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _server(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def test_stalled_accept_fails_fast() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    server, url = await _server(stall)
    async with server:
        t0 = time.monotonic()
        assert await probe_health(url) is False
        assert time.monotonic() - t0 < 2.5


async def test_wait_ends_at_first_answer() -> None:
    ready_at = time.monotonic() + 1.0
    served: list[float] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if time.monotonic() < ready_at:
            await asyncio.sleep(30)  # the "guest" is not listening yet: stall
            return
        served.append(time.monotonic())
        writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server, url = await _server(handler)
    async with server:
        t0 = time.monotonic()
        await asyncio.wait_for(wait_for_health(url, alive=lambda: True), 10)
        assert served and time.monotonic() - t0 < 3.0


async def test_wait_returns_when_not_alive() -> None:
    await asyncio.wait_for(wait_for_health("http://127.0.0.1:9", alive=lambda: False), 1)


async def test_only_a_2xx_health_answer_counts() -> None:
    answers = iter([b"HTTP/1.1 503 Service Unavailable\r\n\r\n", b"garbage\r\n",
                    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"])
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(next(answers))
        await writer.drain()
        writer.close()

    server, url = await _server(handler)
    async with server:
        assert await probe_health(url) is False
        assert await probe_health(url) is False
        assert await probe_health(url) is True
    assert seen[0].startswith(b"GET /health HTTP/1.1\r\n")
    assert f"Host: {url.removeprefix('http://')}".encode() in seen[0]
    assert await probe_health(url) is False  # nothing listens any more
