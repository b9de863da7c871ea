"""The two pumps of a relayed WebSocket, between an ASGI client side and a `websockets`
upstream connection, and a refused handshake's answer: used by the sandbox proxy
(websocket.py) and the cluster gateway.

Messages go through one by one (bytes stay bytes, text stays text); a close on one side
is passed on to the other with its code, except the codes that may not be sent in a
close frame (RFC 6455 §7.4.1), which become 1000.
"""

from __future__ import annotations

import contextlib

import websockets
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import ClientConnection

from . import responses

RESERVED_CLOSE_CODES = (1005, 1006, 1015)


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str,
                 sandbox_id: str | None = None, port: int | None = None) -> None:
    """The client's handshake refused: an HTTP answer with E2B's JSON (responses.py) where
    the server can send one (the websocket.http.response extension), else a close (1008)."""
    if (await receive())["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        payload = responses.body(status, message, sandbox_id, port)
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "websocket.http.response.body", "body": payload})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})


def _sendable(code: int) -> int:
    return 1000 if code in RESERVED_CLOSE_CODES else code


async def pump_up(receive: Receive, upstream: ClientConnection) -> None:
    """Client -> upstream, until the client disconnects or the upstream closes."""
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            msg = await receive()
            if msg["type"] == "websocket.receive":
                data = msg.get("bytes")
                await upstream.send(data if data is not None else msg.get("text", ""))
            elif msg["type"] == "websocket.disconnect":
                await upstream.close(code=_sendable(msg.get("code") or 1000))
                return


async def pump_down(upstream: ClientConnection, send: Send) -> None:
    """Upstream -> client, then the upstream's close (the client may be gone already)."""
    with contextlib.suppress(websockets.ConnectionClosed):
        async for data in upstream:
            if isinstance(data, bytes):
                await send({"type": "websocket.send", "bytes": data})
            else:
                await send({"type": "websocket.send", "text": data})
    with contextlib.suppress(Exception):
        await send({"type": "websocket.close", "code": _sendable(upstream.close_code or 1000),
                    "reason": upstream.close_reason or ""})
