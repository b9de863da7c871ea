"""The sandbox proxy's WebSockets (app.py hands them here): the upstream handshake through
the `websockets` client (the guest's headers as for HTTP, a masked Host where the sandbox
asks), then both pumps (wspump.py) until a side closes or the sandbox goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import websockets
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import connect as ws_connect

from host.httpheaders import FORWARDED_HOST, WS_HANDSHAKE, header
from host.orchestrator.model import Route

from . import responses
from .forwarding import guest_headers
from .routing import Target, masked_host
from .wspump import pump_down, pump_up, refuse


async def relay(scope: Scope, receive: Receive, send: Send, target: Target, route: Route,
                *, connect_timeout_s: float) -> None:
    """The client's WebSocket relayed to `target`'s port, message by message (wspump.py),
    until either side closes or the sandbox's incarnation ends (`route.gone`: 1001)."""
    query = scope.get("query_string", b"")
    raw_path = scope.get("raw_path") or scope["path"].encode()
    headers = [(k.decode("latin-1"), v.decode("latin-1"))
               for k, v in guest_headers(scope, target.port, drop=WS_HANDSHAKE)]
    masked = masked_host(route, target)
    address: dict[str, Any] = {}
    if masked is None:
        uri = f"ws://{route.host}:{route.port}{raw_path.decode('latin-1')}"
    else:
        # websockets takes the Host from the URI: the mask goes there, the address to
        # connect to separately; the client's Host goes on as X-Forwarded-Host
        uri = f"ws://{masked}{raw_path.decode('latin-1')}"
        address = {"host": route.host, "port": route.port}
        original = header(scope, b"host")
        if original:
            headers.append((FORWARDED_HOST.decode(), original))
    if query:
        uri += "?" + query.decode("latin-1")
    try:
        upstream = await ws_connect(
            uri, additional_headers=headers, subprotocols=scope.get("subprotocols") or None,
            open_timeout=connect_timeout_s, max_size=None, compression=None,
            user_agent_header=None, ping_interval=None, **address)
    except websockets.InvalidURI:
        await refuse(scope, receive, send, 502,
                     f"invalid network.maskRequestHost {masked!r}",
                     target.sandbox_id, target.port)
        return
    except (TimeoutError, OSError):
        await refuse(scope, receive, send, 502, responses.PORT_CLOSED,
                     target.sandbox_id, target.port)
        return
    except websockets.InvalidStatus as exc:
        await refuse(scope, receive, send, exc.response.status_code,
                     f"upstream refused the WebSocket: {exc}",
                     target.sandbox_id, target.port)
        return
    async with upstream:
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        down = asyncio.create_task(pump_down(upstream, send))
        up = asyncio.create_task(pump_up(receive, upstream))
        tasks: set[asyncio.Task[Any]] = {down, up}
        ended: asyncio.Task[Any] | None = None
        gone_first = False
        if route.gone is not None:
            ended = asyncio.create_task(route.gone.wait())
            tasks.add(ended)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            gone_first = ended is not None and done == {ended}
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if gone_first:
            # The sandbox went away: no closing handshake with it (it would wait for a
            # VM that is gone), the client hears "going away".
            assert route.gone is not None
            upstream.transport.abort()
            reason = f"sandbox {target.sandbox_id} was {route.gone.reason}"
            with contextlib.suppress(Exception):
                async with asyncio.timeout(responses.END_GRACE_S):
                    await send({"type": "websocket.close", "code": 1001,
                                "reason": reason[:120]})
