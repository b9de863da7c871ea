"""Exchanges the proxy has open into a sandbox end when its running incarnation ends
(`Route.gone` set by the orchestrator: it is being paused or killed), instead of hanging
on a VM that is gone. Against a REAL envd (Connect streams) and real upstream servers;
the in-memory orchestrator double's pause()/kill() set the event."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from host.orchestrator.model import RunEnded
from tests.api.conftest import ServerThread

from .conftest import DOMAIN

ENVD = 49983
STREAM = {"content-type": "application/connect+json", "connect-protocol-version": "1"}


def host(port: int, sid: str) -> dict[str, str]:
    return {"Host": f"{port}-{sid}.{DOMAIN}"}


def envelope(message: dict) -> bytes:
    payload = json.dumps(message).encode()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class Frames:
    """Splits a Connect stream into (flags, message) as bytes arrive."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[tuple[int, dict]]:
        self.buf += data
        out = []
        while len(self.buf) >= 5:
            size = int.from_bytes(self.buf[1:5], "big")
            if len(self.buf) < 5 + size:
                break
            out.append((self.buf[0], json.loads(self.buf[5:5 + size])))
            self.buf = self.buf[5 + size:]
        return out


async def _kill_process(envd_port: int, pid: int) -> None:
    async with httpx.AsyncClient(timeout=10) as c:
        await c.post(f"http://127.0.0.1:{envd_port}/process.Process/SendSignal",
                     json={"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"},
                     headers={"connect-protocol-version": "1"})


@pytest.mark.parametrize("action", ["pause", "kill"])
async def test_connect_stream_is_cut_when_the_sandbox_goes(proxy_url, orch, envd_port,
                                                           action) -> None:
    """As on E2B (the VM's connections die with it): the client's connection is closed
    mid-stream, with no end-of-stream message of ours (issue 14 item 9)."""
    sid = orch.add(token=None).sandbox_id
    frames = Frames()
    got: list[tuple[int, dict]] = []
    pid = None
    async with httpx.AsyncClient(base_url=proxy_url, timeout=30) as c:
        body = envelope({"process": {"cmd": "sleep", "args": ["1000"]}})
        async with c.stream("POST", "/process.Process/Start", content=body,
                            headers={**STREAM, **host(ENVD, sid)}) as resp:
            assert resp.status_code == 200
            chunks = resp.aiter_raw()
            try:
                while pid is None:   # the start event: the process runs, the stream is open
                    for flags, msg in frames.feed(await anext(chunks)):
                        got.append((flags, msg))
                        pid = msg.get("event", {}).get("start", {}).get("pid", pid)
                await getattr(orch, action)(sid)
                with pytest.raises(httpx.RemoteProtocolError):
                    async with asyncio.timeout(60):   # a guard against a hang only
                        async for chunk in chunks:
                            got += frames.feed(chunk)
            finally:
                if pid is not None:
                    await _kill_process(envd_port, pid)
    assert got and all(f == 0 for f, _ in got), got   # no end-of-stream message was added


@pytest.mark.parametrize("action", ["kill", "pause"])
def test_sdk_background_command_of_a_gone_sandbox_raises_killed(servers, orch, envd_port,
                                                                monkeypatch, action) -> None:
    """The e2b SDK's handle of a background command (a Start stream) sees the connection
    terminated, probes the sandbox, finds it gone and raises its "killed or reached its
    end of life" TimeoutException, as against E2B (issue 14 item 9)."""
    from e2b import Sandbox, TimeoutException

    api, proxy = servers
    monkeypatch.setenv("E2B_API_URL", api.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", proxy.url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_test_key")
    monkeypatch.setenv("E2B_DOMAIN", DOMAIN)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    sid = orch.add(token=None).sandbox_id
    sbx = Sandbox.connect(sid)
    handle = sbx.commands.run("sleep 1000", background=True, timeout=0)
    try:
        asyncio.run(getattr(orch, action)(sid))
        with pytest.raises(TimeoutException, match="killed or reached its end of life"):
            handle.wait()
    finally:
        asyncio.run(_kill_process(envd_port, handle.pid))


@pytest.fixture
def endless_upstream():
    """GET /bytes: a plain (not Connect) response that never ends; /connect-partial: a
    Connect stream that stops in the middle of an envelope."""
    async def endless(request: Request) -> StreamingResponse:
        async def gen():
            while True:
                yield b"x" * 1000
                await asyncio.sleep(0.05)
        return StreamingResponse(gen(), media_type="application/octet-stream")

    async def partial(request: Request) -> StreamingResponse:
        async def gen():
            yield envelope({"a": 1})
            yield b"\x00\x00\x00\x01\x00" + b"{"   # a 256-byte envelope, barely begun
            await asyncio.sleep(1000)
        return StreamingResponse(gen(), media_type="application/connect+json")

    app = Starlette(routes=[Route("/bytes", endless), Route("/connect-partial", partial)])
    with ServerThread(app) as srv:
        yield srv.port


@pytest.mark.parametrize("path", ["/bytes", "/connect-partial"])
async def test_other_responses_are_cut(proxy_url, orch, endless_upstream, path) -> None:
    sid = orch.add().sandbox_id
    async with (httpx.AsyncClient(base_url=proxy_url, timeout=30) as c,
                c.stream("GET", path, headers=host(endless_upstream, sid)) as resp):
        assert resp.status_code == 200
        chunks = resp.aiter_raw()
        got = len(await anext(chunks))
        if path == "/connect-partial":  # the proxy must be mid-envelope, not at a boundary
            while got < len(envelope({"a": 1})) + 6:
                got += len(await anext(chunks))
        assert orch.end_run(sid, "killed")
        with pytest.raises(httpx.RemoteProtocolError):
            async with asyncio.timeout(60):   # a guard against a hang only
                async for _ in chunks:
                    pass


async def test_request_not_answered_yet_is_502(proxy_url, orch) -> None:
    """An upstream that has not started its response: the client gets the proxy's 502."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(30)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        sid = orch.add().sandbox_id
        async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as c:
            pending = asyncio.create_task(c.get("/", headers=host(port, sid)))
            while sid not in orch.runs:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            await orch.pause(sid)
            resp = await asyncio.wait_for(pending, 60)
        assert resp.status_code == 502
        assert resp.json()["message"] == "The sandbox was not found: it was paused"
        assert resp.json()["sandboxId"] == sid


async def test_websocket_closed_going_away(proxy_url, orch) -> None:
    async def echo(ws) -> None:
        async for msg in ws:
            await ws.send(msg)

    async with websockets.serve(echo, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        sid = orch.add().sandbox_id
        uri = proxy_url.replace("http://", "ws://") + "/ws"
        routing = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)}
        async with websockets.connect(uri, additional_headers=routing) as ws:
            await ws.send("hello")
            assert await ws.recv() == "hello"
            await orch.kill(sid)
            with pytest.raises(websockets.ConnectionClosed) as info:
                async with asyncio.timeout(60):   # a guard against a hang only
                    await ws.recv()
        assert info.value.rcvd is not None
        assert info.value.rcvd.code == 1001
        assert info.value.rcvd.reason == f"sandbox {sid} was killed"


async def test_unwatched_and_unrelated_exchanges_are_untouched(proxy_url, orch) -> None:
    """Ending one sandbox's run leaves another's exchanges alone; a normal response ends
    normally (the watcher is cancelled with it)."""
    a, b = orch.add(token=None).sandbox_id, orch.add(token=None).sandbox_id
    async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as c:
        assert (await c.get("/health", headers=host(ENVD, a))).status_code == 204
        assert (await c.get("/health", headers=host(ENVD, b))).status_code == 204
        await orch.kill(a)
        assert (await c.get("/health", headers=host(ENVD, b))).status_code == 204


async def test_run_ended_keeps_the_first_reason_and_calls_subscribers_once() -> None:
    run = RunEnded()
    calls: list[str] = []
    run.subscribe(lambda: calls.append("a"))
    unsubscribe = run.subscribe(lambda: calls.append("b"))
    unsubscribe()
    run.subscribe(lambda: 1 / 0)   # a failing subscriber is logged, the others still run
    run.subscribe(lambda: calls.append("c"))
    assert run.reason == "stopped" and not run.is_set()
    run.end("paused")
    run.end("killed")
    assert run.is_set() and run.reason == "paused"
    assert sorted(calls) == ["a", "c"]
    run.subscribe(lambda: calls.append("late"))   # already ended: called at once
    assert calls[-1] == "late"
    await asyncio.wait_for(run.wait(), 1)


async def test_run_end_closes_the_pools_connections_into_it(proxy_url, orch,
                                                            envd_port) -> None:
    """The proxy keeps upstream connections alive between requests; when the sandbox's
    run ends they are closed, not left ESTABLISHED to a dead address (issue 14 item 21)."""
    import psutil

    def upstream() -> list:
        return [c for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.raddr.port == envd_port and c.status == psutil.CONN_ESTABLISHED]

    sid = orch.add(token=None).sandbox_id
    async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as c:
        for _ in range(3):
            assert (await c.get("/health", headers=host(ENVD, sid))).status_code == 204
    assert upstream(), "the pool kept no connection alive: nothing to test"
    await orch.kill(sid)
    async with asyncio.timeout(30):   # a guard against a hang only
        while upstream():
            await asyncio.sleep(0.05)
