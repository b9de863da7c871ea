"""The /terminal WebSocket PTY (websockets client)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

TOKEN = "term-token"


class Screen:
    """Accumulates a terminal's binary output so that waits never lose bytes."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.buf = b""
        self.pos = 0  # consumed up to here

    async def expect(self, needle: bytes, timeout_s: float = 10.0) -> bytes:
        """Wait until `needle` appears after the previous match; return the text up to it."""
        deadline = time.monotonic() + timeout_s
        while (i := self.buf.find(needle, self.pos)) < 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"{needle!r} not seen; got {self.buf[-500:]!r}")
            msg = await asyncio.wait_for(self.ws.recv(), remaining)
            if isinstance(msg, bytes):
                self.buf += msg
        start, self.pos = self.pos, i + len(needle)
        return self.buf[start:self.pos]


async def read_until(ws, needle: bytes, timeout_s: float = 10.0) -> bytes:
    return await Screen(ws).expect(needle, timeout_s)


def ws_url(http_url: str, query: str = "") -> str:
    return http_url.replace("http://", "ws://") + "/terminal" + (f"?{query}" if query else "")


async def test_echo_resize_and_exit(envd_url):
    async with connect(ws_url(envd_url, "cols=90&rows=30")) as ws:
        screen = Screen(ws)
        await ws.send(b"echo hello-$((40+2)); stty size\n")
        await screen.expect(b"hello-42")
        await screen.expect(b"30 90")
        await ws.send(json.dumps({"type": "resize", "cols": 120, "rows": 40}))
        await ws.send(json.dumps({"type": "input", "data": "stty size; id -un\n"}))
        await screen.expect(b"40 120")
        await screen.expect(b"user")
        await ws.send(b"exit 4\n")
        exit_msg = None
        try:
            while True:
                msg = await asyncio.wait_for(ws.recv(), 10)
                if isinstance(msg, str):
                    exit_msg = json.loads(msg)
        except ConnectionClosed as closed:
            assert closed.rcvd is not None and closed.rcvd.code == 1000
        assert exit_msg == {"type": "exit", "exitCode": 4, "status": "exit status 4"}


async def test_cmd_and_user_query(envd_url):
    async with connect(ws_url(envd_url, "cmd=id%20-un%3B%20tty&user=root")) as ws:
        out = await read_until(ws, b"/dev/pts/")
        assert b"root" in out


async def test_disconnect_kills_terminal_process(inprocess_envd):
    table = inprocess_envd.app.state.processes.table
    async with connect(ws_url(inprocess_envd.url, "tag=term-kill")) as ws:
        await ws.send(b"echo ready\n")
        await read_until(ws, b"ready")
        proc = table.by_tag("term-kill")
    deadline = time.monotonic() + 5
    while proc.running and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not proc.running


async def test_token_required(inprocess_envd):
    inprocess_envd.defaults.access_token = TOKEN
    try:
        async with connect(ws_url(inprocess_envd.url)) as ws:
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 5)
        assert info.value.rcvd.code == 4401
        async with connect(ws_url(inprocess_envd.url),
                           additional_headers={"X-Access-Token": "wrong"}) as ws:
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 5)
        assert info.value.rcvd.code == 4401
        async with connect(ws_url(inprocess_envd.url),
                           additional_headers={"X-Access-Token": TOKEN}) as ws:
            await ws.send(b"echo tok-ok\n")
            await read_until(ws, b"tok-ok")
        async with connect(ws_url(inprocess_envd.url, f"access_token={TOKEN}")) as ws:
            await ws.send(b"echo q-ok\n")
            await read_until(ws, b"q-ok")
    finally:
        inprocess_envd.defaults.access_token = None


async def test_bad_control_message_closes(envd_url):
    async with connect(ws_url(envd_url)) as ws:
        await ws.send("not json")
        with pytest.raises(ConnectionClosed) as info:
            while True:
                await asyncio.wait_for(ws.recv(), 5)
        assert info.value.rcvd.code == 1003
