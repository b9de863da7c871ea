"""The proxy's pooled upstream client: keep-alive reuse, replacing a pooled
connection the server closed while idle, refused ports, streamed request bodies."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from host.proxy.upstream import Pool, UpstreamUnreachable
from tests.api.conftest import free_port


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return body
            body += chunk[:-2]
    return b""


@contextlib.asynccontextmanager
async def serve():
    """(Not a fixture: async fixtures run on the session loop, these tests on their own.)
    Answers every request on a connection; `close_after` closes it after N responses."""
    state = {"connections": 0, "close_after": 0, "bodies": []}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state["connections"] += 1
        served = 0
        try:
            while True:
                state["bodies"].append(await read_request(reader))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
                served += 1
                if state["close_after"] and served >= state["close_after"]:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    state["port"] = srv.sockets[0].getsockname()[1]
    async with srv:
        yield state


async def fetch(pool: Pool, port: int, body=None) -> bytes:
    headers = [(b"host", b"x")]
    if body is not None:
        headers.append((b"transfer-encoding", b"chunked"))
    resp = await pool.request("127.0.0.1", port, b"POST" if body else b"GET", b"/", headers, body)
    return b"".join([c async for c in resp.aiter_body()])


async def test_keep_alive_reuses_one_connection() -> None:
    async with serve() as server:
        pool = Pool()
        for _ in range(5):
            assert await fetch(pool, server["port"]) == b"ok"
        assert server["connections"] == 1
        await pool.aclose()


async def test_idle_connection_closed_by_server_is_replaced() -> None:
    async with serve() as server:
        server["close_after"] = 1
        pool = Pool()
        assert await fetch(pool, server["port"]) == b"ok"
        await asyncio.sleep(0.05)  # the server has closed the pooled connection by now
        assert await fetch(pool, server["port"]) == b"ok"
        assert server["connections"] == 2
        await pool.aclose()


async def test_streamed_request_body() -> None:
    async with serve() as server:
        async def body():
            for part in (b"he", b"llo"):
                yield part
        pool = Pool()
        assert await fetch(pool, server["port"], body()) == b"ok"
        assert server["bodies"][-1] == b"hello"
        await pool.aclose()


async def test_refused_port() -> None:
    pool = Pool(connect_timeout_s=2)
    with pytest.raises(UpstreamUnreachable):
        await fetch(pool, free_port())


async def test_a_body_closed_before_its_first_read_closes_the_connection() -> None:
    """A client gone between the response head and the first body read: closing the
    never-started body iterator runs none of its code, `abandon()` closes the connection
    (neither pooled nor left open)."""
    async with serve() as state:
        pool = Pool()
        resp = await pool.request("127.0.0.1", state["port"], b"GET", b"/", [(b"host", b"x")],
                                  None)
        body = resp.aiter_body()
        await body.aclose()
        assert not resp.conn.writer.is_closing()  # the unstarted generator did nothing
        resp.abandon()
        assert resp.conn.writer.is_closing() and not pool._idle.get(("127.0.0.1", state["port"]))
        # a body read to its end is pooled, and abandon() after that changes nothing
        resp = await pool.request("127.0.0.1", state["port"], b"GET", b"/", [(b"host", b"x")],
                                  None)
        body = resp.aiter_body()
        assert b"".join([c async for c in body]) == b"ok"
        await body.aclose()
        resp.abandon()
        assert not resp.conn.writer.is_closing()
        assert pool._idle[("127.0.0.1", state["port"])] == [resp.conn]
        await pool.aclose()
