"""The sandbox reverse proxy: a pure ASGI app (served by uvicorn) that forwards each request
to `orchestrator.route(...)`, streaming both ways.

Why ASGI rather than a raw byte relay: one client connection may carry requests for
different sandboxes (E2B_SANDBOX_URL routes every request by headers), so the proxy has
to understand HTTP/1.1 framing on both sides anyway. uvicorn does the client side and
hands us body chunks as they arrive; upstream.py (h11 over asyncio streams, pooled) sends
them on as they come and yields response bytes as soon as they are read. Nothing is
buffered beyond one socket read. WebSockets are relayed message by message through the
`websockets` client after both handshakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator

import websockets
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from host.orchestrator.errors import OrchestratorError, SandboxNotFound, StateConflict
from host.orchestrator.model import Route
from host.orchestrator.service import Orchestrator

from . import responses
from .routing import ENVD_PORT, BadTarget, Target, host_name, parse_target
from .upstream import Pool, UpstreamError, UpstreamUnreachable

log = logging.getLogger(__name__)

# envd control routes only the host may call (spec §1.6.3).
BLOCKED_ENVD_PATHS = frozenset({"/init", "/freeze", "/unfreeze", "/fsfreeze", "/fsthaw",
                                "/collapse", "/upgrade"})
TRAFFIC_TOKEN_HEADER = b"e2b-traffic-access-token"

# Hop-by-hop headers (RFC 9110 §7.6.1) plus those the server side already handled.
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                  b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
                  b"expect"})
_WS_HANDSHAKE = frozenset({b"host", b"upgrade", b"connection", b"sec-websocket-key",
                           b"sec-websocket-version", b"sec-websocket-extensions",
                           b"sec-websocket-protocol", b"content-length"})


# (method, target, headers, streamed body or None) of one forwarded request
_Forward = tuple[bytes, bytes, list[tuple[bytes, bytes]], AsyncIterator[bytes] | None]


class _ClientGone(Exception):
    """The client disconnected while we were reading its body."""


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v).decode("latin-1")
    return None


class ProxyApp:
    """ASGI app; build with `build_proxy_app`. Call `aclose()` (or run the ASGI lifespan)."""

    def __init__(self, orchestrator: Orchestrator, domain: str | None, *,
                 api_app: ASGIApp | None = None, auto_resume: bool = True,
                 connect_timeout_s: float = 5.0) -> None:
        self.orchestrator = orchestrator
        self.domain = domain.lower() if domain else None
        self.api_app = api_app
        self.auto_resume = auto_resume
        self.connect_timeout_s = connect_timeout_s
        self._pool = Pool(connect_timeout_s=connect_timeout_s)

    # --- lifecycle --------------------------------------------------------------------

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- dispatch ---------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        host = host_name(_header(scope, b"host") or "")
        if self.api_app is not None and self.domain and host == f"api.{self.domain}":
            await self.api_app(scope, receive, send)
            return
        try:
            target = parse_target(host, _header(scope, b"e2b-sandbox-id"),
                                  _header(scope, b"e2b-sandbox-port"), self.domain)
        except BadTarget as exc:
            await self._deny(scope, receive, send, 400, str(exc))
            return
        route = await self._route(scope, receive, send, target)
        if route is None:
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, target, route)
        else:
            await self._http_exchange(scope, receive, send, target, route)

    async def _deny(self, scope: Scope, receive: Receive, send: Send, status: int, message: str,
                    *, sandbox_id: str | None = None, port: int | None = None) -> None:
        if scope["type"] == "websocket":
            await self._deny_websocket(scope, receive, send, status, message, sandbox_id, port)
        else:
            await responses.send_json(send, status, message, sandbox_id=sandbox_id, port=port)

    async def _route(self, scope: Scope, receive: Receive, send: Send,
                     target: Target) -> Route | None:
        """Resolve and authorize; answers the client itself and returns None on refusal."""
        sid, port = target.sandbox_id, target.port
        try:
            route = await self.orchestrator.route(sid, port, resume=self.auto_resume)
        except (SandboxNotFound, StateConflict):
            # unknown, killed, or paused without auto-resume: the SDK reads "was not found"
            await self._deny(scope, receive, send, 502, responses.NOT_FOUND, sandbox_id=sid)
            return None
        except OrchestratorError as exc:
            await self._deny(scope, receive, send, 502, f"The sandbox is unavailable: {exc}",
                             sandbox_id=sid)
            return None
        if port == ENVD_PORT:
            path = scope["path"].rstrip("/") or "/"
            if path in BLOCKED_ENVD_PATHS:
                await self._deny(scope, receive, send, 403,
                                 f"envd route {path} is not reachable through the proxy",
                                 sandbox_id=sid)
                return None
        elif route.traffic_token is not None:
            given = _header(scope, TRAFFIC_TOKEN_HEADER) or ""
            if not hmac.compare_digest(given.encode(), route.traffic_token.encode()):
                msg = ("missing e2b-traffic-access-token header" if not given
                       else "invalid e2b-traffic-access-token")
                await self._deny(scope, receive, send, 403, msg, sandbox_id=sid)
                return None
        return route

    # --- HTTP -------------------------------------------------------------------------

    async def _http_exchange(self, scope: Scope, receive: Receive, send: Send,
                             target: Target, route: Route) -> None:
        body_done = asyncio.Event()
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP]
        names = {k for k, _ in headers}
        if b"host" not in names:
            headers.append((b"host", f"{route.host}:{route.port}".encode()))
        client = scope.get("client")
        if client:
            headers.append((b"x-forwarded-for", client[0].encode()))
        content = None
        if b"content-length" in names:
            content = self._request_body(receive, body_done)
        elif any(k == b"transfer-encoding" for k, _ in scope["headers"]):
            headers.append((b"transfer-encoding", b"chunked"))
            content = self._request_body(receive, body_done)
        else:
            body_done.set()
        query = scope.get("query_string", b"")
        raw_path = scope.get("raw_path") or scope["path"].encode()
        request = (scope["method"].encode(), raw_path + (b"?" + query if query else b""),
                   headers, content)

        # The response is pumped in this task; a watcher cancels it when the client goes
        # away, so an endless upstream stream does not keep running for nobody.
        this = asyncio.current_task()
        assert this is not None
        gone = asyncio.Event()
        watcher = asyncio.create_task(self._wait_disconnect(receive, body_done, gone, this))
        try:
            await self._pump(request, send, target, route)
        except asyncio.CancelledError:
            if gone.is_set() and this.uncancel() == 0:
                return  # our own cancellation: the client disconnected
            raise
        except _ClientGone:
            return
        finally:
            watcher.cancel()

    @staticmethod
    async def _request_body(receive: Receive, done: asyncio.Event) -> AsyncIterator[bytes]:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _ClientGone
            chunk = msg.get("body", b"")
            if chunk:
                yield chunk
            if not msg.get("more_body", False):
                break
        done.set()

    @staticmethod
    async def _wait_disconnect(receive: Receive, body_done: asyncio.Event, gone: asyncio.Event,
                               task: asyncio.Task[None]) -> None:
        await body_done.wait()  # receive() belongs to the body reader until then
        while True:
            msg: Message = await receive()
            if msg["type"] == "http.disconnect":
                gone.set()
                task.cancel()
                return

    async def _pump(self, request: _Forward, send: Send, target: Target, route: Route) -> None:
        method, path, headers, content = request
        try:
            upstream = await self._pool.request(route.host, route.port, method, path, headers,
                                                content)
        except UpstreamUnreachable:
            await responses.send_json(send, 502, responses.PORT_CLOSED,
                                      sandbox_id=target.sandbox_id, port=target.port)
            return
        except UpstreamError as exc:
            await responses.send_json(send, 502, f"The sandbox closed the connection: {exc}",
                                      sandbox_id=target.sandbox_id, port=target.port)
            return
        body = upstream.aiter_body()
        try:
            await send({"type": "http.response.start", "status": upstream.status,
                        "headers": [(k, v) for k, v in upstream.headers
                                    if k.lower() not in _HOP]})
            try:
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError as exc:
                # The response has started: all we can do is cut the client off too.
                log.info("upstream %s:%s broke mid-response: %s", target.sandbox_id,
                         target.port, exc)
                raise _ClientGone from exc
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await body.aclose()  # returns the connection to the pool, or closes it
            upstream.abandon()  # closes it if the body was cut off before its first read

    # --- WebSocket --------------------------------------------------------------------

    async def _deny_websocket(self, scope: Scope, receive: Receive, send: Send, status: int,
                              message: str, sandbox_id: str | None, port: int | None) -> None:
        msg = await receive()  # websocket.connect
        if msg["type"] != "websocket.connect":
            return
        if "websocket.http.response" in scope.get("extensions", {}):
            payload = responses.body(status, message, sandbox_id, port)
            await send({"type": "websocket.http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "websocket.http.response.body", "body": payload})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, target: Target,
                         route: Route) -> None:
        query = scope.get("query_string", b"")
        raw_path = scope.get("raw_path") or scope["path"].encode()
        uri = f"ws://{route.host}:{route.port}{raw_path.decode('latin-1')}"
        if query:
            uri += "?" + query.decode("latin-1")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k not in _WS_HANDSHAKE and k not in _HOP]
        try:
            upstream = await ws_connect(
                uri, additional_headers=headers, subprotocols=scope.get("subprotocols") or None,
                open_timeout=self.connect_timeout_s, max_size=None, compression=None,
                user_agent_header=None, ping_interval=None)
        except (TimeoutError, OSError):
            await self._deny_websocket(scope, receive, send, 502, responses.PORT_CLOSED,
                                       target.sandbox_id, target.port)
            return
        except websockets.InvalidStatus as exc:
            await self._deny_websocket(scope, receive, send, exc.response.status_code,
                                       f"upstream refused the WebSocket: {exc}",
                                       target.sandbox_id, target.port)
            return
        async with upstream:
            if (await receive())["type"] != "websocket.connect":
                return
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
            down = asyncio.create_task(self._ws_down(upstream, send))
            up = asyncio.create_task(self._ws_up(receive, upstream))
            try:
                await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (down, up):
                    task.cancel()
                await asyncio.gather(down, up, return_exceptions=True)

    @staticmethod
    async def _ws_up(receive: Receive, upstream: ClientConnection) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            await ProxyApp._ws_up_loop(receive, upstream)

    @staticmethod
    async def _ws_up_loop(receive: Receive, upstream: ClientConnection) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "websocket.receive":
                data = msg.get("bytes")
                await upstream.send(data if data is not None else msg.get("text", ""))
            elif msg["type"] == "websocket.disconnect":
                code = msg.get("code") or 1000
                await upstream.close(code=1000 if code in (1005, 1006, 1015) else code)
                return

    @staticmethod
    async def _ws_down(upstream: ClientConnection, send: Send) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for data in upstream:
                if isinstance(data, bytes):
                    await send({"type": "websocket.send", "bytes": data})
                else:
                    await send({"type": "websocket.send", "text": data})
        code = upstream.close_code or 1000
        if code in (1005, 1006, 1015):  # reserved: may not be sent in a close frame
            code = 1000
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": code,
                        "reason": upstream.close_reason or ""})


def build_proxy_app(orchestrator: Orchestrator, domain: str | None, *,
                    api_app: ASGIApp | None = None, auto_resume: bool = True) -> ProxyApp:
    """The sandbox proxy. `api_app`, when given, serves requests for `api.<domain>` (one
    TLS listener for everything); `auto_resume` is passed to `orchestrator.route`.

    Serve it with uvicorn, `lifespan="on"` (closes the upstream pool), a long
    `timeout_keep_alive` (SDK pools reuse connections; 300 s like envd), and for TLS
    `ssl_certfile`/`ssl_keyfile` from `tls.ensure_certificates(state_dir, domain)`.
    """
    return ProxyApp(orchestrator, domain, api_app=api_app, auto_resume=auto_resume)
