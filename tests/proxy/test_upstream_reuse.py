"""The upstream pool and a pooled keep-alive connection whose peer is gone.

The bug: a sandbox is killed (its VM and network namespace vanish without a FIN reaching
the proxy), a new sandbox later gets the same address; the pooled connection still looks
idle and fine, so the next request goes out on it and the new guest answers with a reset:
the first request through the proxy failed with ECONNRESET. Now the proxy drops the
pool's idle connections into a sandbox when its run ends (tests/proxy/test_sandbox_gone),
the pool drops idle connections the peer closed or reset, and a request that fails on a
reused connection before any response byte is sent once more on a fresh connection, but
only when that cannot run it twice (issue 14 item 16): an idempotent method (the body
read so far, up to 64 KiB, is kept for that), or a request whose head never reached the
socket. A POST (a Connect RPC, an upload) that went out is never sent again: the reset
may come from a server that read it and died.

`test_killed_namespace_then_same_address` reproduces it with a real upstream server in a
network namespace that is destroyed and recreated with the same address and port (root
+ iproute2); the others use loopback servers that close or reset connections."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from host.proxy.upstream import Pool, UpstreamError

SERVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = sys.argv[3].encode()

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        body = NAME + b":" + self.rfile.read(n)
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _answer
    def log_message(self, *a):
        pass

ThreadingHTTPServer.allow_reuse_address = True
ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""


async def call(pool: Pool, host: str, port: int, body: bytes | None = None,
               method: bytes | None = None) -> bytes:
    headers = [(b"host", b"upstream")]
    content = None
    if body is not None:
        headers.append((b"content-length", str(len(body)).encode()))

        async def gen():
            yield body
        content = gen()
    if method is None:
        method = b"POST" if body is not None else b"GET"
    resp = await pool.request(host, port, method, b"/", headers, content)
    assert resp.status == 200
    return b"".join([c async for c in resp.aiter_body()])


# ---- a real server in a namespace that is destroyed and recreated ---------------------------

NS = f"ae2e-ut{os.getpid() % 100000}"
VETH_HOST, VETH_NS = f"ae2eu{os.getpid() % 100000}", f"ae2ev{os.getpid() % 100000}"
HOST_IP, NS_IP = "10.216.255.1", "10.216.255.2"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def make_namespace() -> None:
    sh("ip", "netns", "add", NS)
    sh("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
    sh("ip", "link", "set", VETH_NS, "netns", NS)
    sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", VETH_HOST)
    sh("ip", "link", "set", VETH_HOST, "up")
    sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", VETH_NS)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", VETH_NS, "up")
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")


def destroy_namespace() -> None:
    subprocess.run(["ip", "link", "delete", VETH_HOST], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "delete", NS], capture_output=True, check=False)


def start_server(port: int, name: str) -> subprocess.Popen:
    proc = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-c", SERVER, NS_IP,
                             str(port), name], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection((NS_IP, port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def stop_server(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.fixture
def namespace():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    destroy_namespace()
    make_namespace()
    try:
        yield
    finally:
        destroy_namespace()


@pytest.mark.parametrize("body", [None, b"{\"process\":{\"cmd\":\"true\"}}"],
                         ids=["GET", "POST-small-body"])
async def test_killed_namespace_then_same_address(namespace, body: bytes | None) -> None:
    port = 8000
    pool = Pool(connect_timeout_s=5)
    old = start_server(port, "old")
    try:
        assert await call(pool, NS_IP, port, body) == b"old:" + (body or b"")
        assert len(pool._idle[(NS_IP, port)]) == 1  # kept alive in the pool
        # the "VM" dies with its network: no FIN ever reaches us
        sh("ip", "netns", "exec", NS, "ip", "link", "set", VETH_NS, "down")
        stop_server(old)
        destroy_namespace()
        # a new "sandbox" gets the same address and port
        make_namespace()
        new = start_server(port, "new")
        try:
            # the pooled connection looks idle and fine; the new peer resets it
            if body is None:      # GET: sent again on a fresh connection
                assert await call(pool, NS_IP, port, body) == b"new:"
            else:                 # POST: it went out, it is not sent twice
                with pytest.raises(UpstreamError):
                    await call(pool, NS_IP, port, body)
            assert await call(pool, NS_IP, port, body) == b"new:" + (body or b"")
        finally:
            stop_server(new)
    finally:
        stop_server(old)
        await pool.aclose()


# ---- loopback servers ------------------------------------------------------------------

@contextlib.asynccontextmanager
async def server(mode: str):
    """`reset-next`: answers the first request on a connection, then resets the connection
    (SO_LINGER 0) when the next request arrives, without answering: what a new guest on a
    reused address does. `close-idle`: closes each connection right after its response."""
    state = {"connections": 0, "requests": [], "read": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state["connections"] += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":")[1])
                body = await reader.readexactly(n) if n else b""
                state["read"] += 1
                if served and mode == "reset-next":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                state["requests"].append(body)
                out = b"ok:" + body
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out))
                await writer.drain()
                served += 1
                if mode == "close-idle":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    state["port"] = srv.sockets[0].getsockname()[1]
    async with srv:
        yield state


@pytest.mark.parametrize("method", [b"GET", b"PUT", b"DELETE"])
@pytest.mark.parametrize("body", [None, b"", b"x" * 1000, b"y" * 65536])
async def test_idempotent_request_reset_on_reused_connection_is_retried_fresh(
        method: bytes, body: bytes | None) -> None:
    async with server("reset-next") as s:
        pool = Pool()
        assert await call(pool, "127.0.0.1", s["port"], body, method) == b"ok:" + (body or b"")
        assert await call(pool, "127.0.0.1", s["port"], body, method) == b"ok:" + (body or b"")
        assert s["connections"] == 2 and s["requests"] == [body or b""] * 2
        await pool.aclose()


@pytest.mark.parametrize("body", [None, b"", b"x" * 1000])
async def test_post_reset_on_reused_connection_is_not_sent_twice(body: bytes | None) -> None:
    """The server read the second POST, then reset the connection: it may have acted on
    it, so the pool does not send it again (the proxy answers 502)."""
    async with server("reset-next") as s:
        pool = Pool()
        assert await call(pool, "127.0.0.1", s["port"], body, b"POST") == b"ok:" + (body or b"")
        with pytest.raises(UpstreamError):
            await call(pool, "127.0.0.1", s["port"], body, b"POST")
        assert s["connections"] == 1 and s["read"] == 2
        await pool.aclose()


async def test_drop_closes_the_idle_connections_to_a_host() -> None:
    async with server("reset-next") as s:
        pool = Pool()
        assert await call(pool, "127.0.0.1", s["port"], b"a", b"POST") == b"ok:a"
        assert pool.idle_count() == 1
        assert pool.drop("127.0.0.2") == 0 and pool.drop("127.0.0.1") == 1
        assert pool.idle_count() == 0
        # the next POST goes out on a fresh connection: nothing to reset
        assert await call(pool, "127.0.0.1", s["port"], b"b", b"POST") == b"ok:b"
        assert s["connections"] == 2
        await pool.aclose()


async def test_large_streamed_body_is_not_replayed() -> None:
    """More than 64 KiB already read from the client cannot be sent again: the error
    stands (the proxy answers 502) rather than sending a truncated body."""
    async with server("reset-next") as s:
        pool = Pool()
        assert await call(pool, "127.0.0.1", s["port"], b"a") == b"ok:a"
        with pytest.raises(UpstreamError):
            await call(pool, "127.0.0.1", s["port"], b"z" * (4 * 65536))
        assert s["connections"] == 1
        await pool.aclose()


async def test_idle_connection_closed_by_peer_is_not_reused() -> None:
    """The peer closed the pooled connection (FIN): detected before reuse, no request is
    sent on it (the server counts each request it saw)."""
    async with server("close-idle") as s:
        pool = Pool()
        for i in range(3):
            assert await call(pool, "127.0.0.1", s["port"], b"%d" % i) == b"ok:%d" % i
            await asyncio.sleep(0.05)
        assert s["connections"] == 3 and s["requests"] == [b"0", b"1", b"2"]
        await pool.aclose()


async def test_stale_check_sees_fin_before_the_loop_does() -> None:
    """A FIN that arrived but that the event loop has not processed yet (no await between
    the peer's close and the reuse) is caught by the MSG_PEEK probe."""
    async with server("close-idle") as s:
        pool = Pool()
        assert await call(pool, "127.0.0.1", s["port"]) == b"ok:"
        conn = pool._idle[("127.0.0.1", s["port"])][-1]
        deadline = time.monotonic() + 5
        while not conn.stale(60) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert conn.stale(60)
        await pool.aclose()
