"""WebSocket sandbox traffic: relayed message by message to the node's proxy (which relays
it into the sandbox), after both handshakes. The node's proxy sees the client's Host and
headers, so it resolves the same sandbox port the gateway did.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import websockets
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import connect as ws_connect

from host.proxy import responses
from host.proxy.wspump import pump_down, pump_up

from ..errors import NodeUnreachable
from .forward import HOP, host_port

if TYPE_CHECKING:
    from .metrics import GatewayMetrics

_HANDSHAKE = frozenset({b"host", b"upgrade", b"connection", b"sec-websocket-key",
                        b"sec-websocket-version", b"sec-websocket-extensions",
                        b"sec-websocket-protocol", b"content-length"})


async def deny(scope: Scope, receive: Receive, send: Send, status: int, message: str,
               sandbox_id: str | None = None) -> None:
    """Refuse the handshake with a JSON body where the server can send one."""
    if (await receive())["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        payload = responses.body(status, message, sandbox_id)
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "websocket.http.response.body", "body": payload})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})


async def relay_websocket(address: str, scope: Scope, receive: Receive, send: Send, *,
                          sandbox_id: str, open_timeout_s: float = 10.0,
                          metrics: GatewayMetrics | None = None) -> None:
    """Relay one WebSocket session to the node proxy at `address` (`metrics`: a node that
    cannot be reached is counted as an error; the node's own refusal is its answer)."""
    host, port = host_port(address)
    raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = scope.get("query_string", b"").decode("latin-1")
    client_host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"),
                       f"{host}:{port}")
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
               if k not in _HANDSHAKE and k not in HOP]
    # the URI carries the client's Host (the node's proxy routes by it); the TCP connection
    # goes to the node's proxy
    uri = f"ws://{client_host}{raw_path}" + (f"?{query}" if query else "")
    try:
        upstream = await ws_connect(
            uri, host=host, port=port, additional_headers=headers,
            subprotocols=scope.get("subprotocols") or None, open_timeout=open_timeout_s,
            max_size=None, compression=None, user_agent_header=None, ping_interval=None)
    except websockets.InvalidStatus as exc:
        await deny(scope, receive, send, exc.response.status_code,
                   f"the node refused the WebSocket: {exc}", sandbox_id)
        return
    except (OSError, TimeoutError, websockets.InvalidHandshake, websockets.InvalidURI) as exc:
        if metrics is not None:
            metrics.error(502, NodeUnreachable.error_code)
        await deny(scope, receive, send, 502, f"The sandbox's node is unreachable: {exc}",
                   sandbox_id)
        return
    async with upstream:
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        tasks: set[asyncio.Task[Any]] = {asyncio.create_task(pump_down(upstream, send)),
                                         asyncio.create_task(pump_up(receive, upstream))}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
