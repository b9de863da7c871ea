"""The sandbox reverse proxy: a pure ASGI app (served by uvicorn) that forwards each request
to `orchestrator.route(...)`, streaming both ways.

Why ASGI rather than a raw byte relay: one client connection may carry requests for
different sandboxes (E2B_SANDBOX_URL routes every request by headers), so the proxy has
to understand HTTP/1.1 framing on both sides anyway. uvicorn does the client side and
hands us body chunks as they arrive; upstream.py (h11 over asyncio streams, pooled) sends
them on as they come and yields response bytes as soon as they are read. Nothing is
buffered beyond one socket read. WebSockets are relayed message by message through the
`websockets` client after both handshakes.

When the orchestrator says the sandbox's running incarnation ended (`Route.gone` set: it
is being paused or killed), open exchanges end at once instead of hanging on a VM that
is gone, the way they end on E2B, where the VM's connections die with it: a response not
started yet becomes a 502, a started one is cut (the client's connection is closed, so
the SDKs probe the sandbox and report it killed or ended), and a WebSocket is closed
with 1001 (going away). The pool's idle connections into that incarnation are closed
then too: a node that served thousands of sandboxes keeps no sockets to dead ones.

What a request into a sandbox carries (our credentials dropped, X-Forwarded-For the
peer) is forwarding.py's. An id the service cannot have issued is answered "not found"
without asking the orchestrator, which keeps no state for ids it does not hold.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import weakref
from collections.abc import AsyncIterator

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from host.api.auth import ApiKeys
from host.httpheaders import FORWARDED_HOST, HOP_BY_HOP, TRAFFIC_TOKEN, header
from host.ids import is_sandbox_id
from host.orchestrator.errors import OrchestratorError, SandboxNotFound, StateConflict
from host.orchestrator.model import ListFilter, Route, RunEnded
from host.orchestrator.service import Orchestrator
from host.web.links import TerminalLinks
from host.web.terminal import TerminalSite

from . import responses, websocket
from .forwarding import guest_headers
from .routing import (
    ENVD_PORT,
    BadTarget,
    Target,
    host_name,
    masked_host,
    parse_target,
    routes_by_headers,
)
from .signed import SignedFileRequest
from .upstream import Pool, UpstreamError, UpstreamUnreachable
from .wspump import refuse

log = logging.getLogger(__name__)

# envd control routes only the host may call (spec §1.6.3).
BLOCKED_ENVD_PATHS = frozenset({"/init", "/freeze", "/unfreeze", "/fsfreeze", "/fsthaw",
                                "/collapse", "/upgrade"})


# (method, target, headers, streamed body or None) of one forwarded request
_Forward = tuple[bytes, bytes, list[tuple[bytes, bytes]], AsyncIterator[bytes] | None]




class _ClientGone(Exception):
    """The client disconnected while we were reading its body."""


class _Cut:
    """Why the exchange's pump was cancelled by one of its watchers (the first wins)."""

    __slots__ = ("why",)

    def __init__(self) -> None:
        self.why: str | None = None  # "client" (disconnected) or "gone" (sandbox went away)

    def cancel(self, task: asyncio.Task[None], why: str) -> None:
        if self.why is None:
            self.why = why
            task.cancel()


class _Progress:
    """How far the response to the client has got (updated only after a send returned:
    uvicorn awaits flow control before writing, so a send cancelled wrote nothing)."""

    __slots__ = ("finishing", "started")

    def __init__(self) -> None:
        self.started = False      # http.response.start was sent
        self.finishing = False    # the body is complete, the final message is being sent


class ProxyApp:
    """ASGI app; build with `build_proxy_app`. Call `aclose()` (or run the ASGI lifespan)."""

    def __init__(self, orchestrator: Orchestrator, domain: str | None, *,
                 api_app: ASGIApp | None = None, auto_resume: bool = True,
                 connect_timeout_s: float = 5.0, terminal_links: TerminalLinks | None = None,
                 keys: ApiKeys | None = None) -> None:
        self.orchestrator = orchestrator
        self.domain = domain.lower() if domain else None
        self.api_app = api_app
        self.auto_resume = auto_resume
        self.connect_timeout_s = connect_timeout_s
        self._pool = Pool(connect_timeout_s=connect_timeout_s)
        # runs whose end drops the pool's idle connections into them (one callback each)
        self._watched: weakref.WeakSet[RunEnded] = weakref.WeakSet()
        # the web terminal's pages (`/terminal/<id>` on hosts that are not a sandbox's)
        self.terminal = (TerminalSite(orchestrator, terminal_links, self._relay_terminal,
                                      keys=keys) if terminal_links is not None else None)

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
        host = host_name(header(scope, b"host") or "")
        if self.terminal is not None and self._terminal_request(scope, host):
            await self.terminal(scope, receive, send)
            return
        if self.api_app is not None and self.domain and host == f"api.{self.domain}":
            await self.api_app(scope, receive, send)
            return
        target: Target | None
        try:
            target = parse_target(host, header(scope, b"e2b-sandbox-id"),
                                  header(scope, b"e2b-sandbox-port"), self.domain)
        except BadTarget as exc:
            target = await self._signed_target(scope, host)
            if target is None:
                await self._deny(scope, receive, send, 400, str(exc))
                return
        route = await self._route(scope, receive, send, target)
        if route is None:
            return
        if scope["type"] == "websocket":
            await websocket.relay(scope, receive, send, target, route,
                                  connect_timeout_s=self.connect_timeout_s)
        else:
            await self._http_exchange(scope, receive, send, target, route)

    def _terminal_request(self, scope: Scope, host: str) -> bool:
        """A web-terminal path on the proxy's own host (not a sandbox's `<port>-<id>` host,
        not a request routed by E2b-Sandbox-* headers)."""
        if not scope["path"].startswith("/terminal/") or header(scope, b"e2b-sandbox-id"):
            return False
        return routes_by_headers(host, self.domain) or (
            self.domain is not None and host in (self.domain, f"api.{self.domain}"))

    async def _relay_terminal(self, scope: Scope, receive: Receive, send: Send,
                              sandbox_id: str) -> None:
        """The web terminal's WebSocket to envd's /terminal (authorised by terminal.py),
        without resuming a paused sandbox: an open tab must not keep one running."""
        target = Target(sandbox_id, ENVD_PORT)
        route = await self._route(scope, receive, send, target, resume=False)
        if route is not None:
            await websocket.relay(scope, receive, send, target, route,
                                  connect_timeout_s=self.connect_timeout_s)

    async def _signed_target(self, scope: Scope, host: str) -> Target | None:
        """envd of the sandbox that signed a file URL sent without E2b-Sandbox-* headers
        to a host that routes by them (E2B_SANDBOX_URL mode; signed.py)."""
        if not routes_by_headers(host, self.domain) or header(scope, b"e2b-sandbox-id"):
            return None
        signed = SignedFileRequest.of(scope)
        if signed is None:
            return None
        sid = signed.signer(await self.orchestrator.list(ListFilter()))
        return Target(sid, ENVD_PORT) if sid is not None else None

    async def _deny(self, scope: Scope, receive: Receive, send: Send, status: int, message: str,
                    *, sandbox_id: str | None = None, port: int | None = None) -> None:
        if scope["type"] == "websocket":
            await refuse(scope, receive, send, status, message, sandbox_id, port)
        else:
            await responses.send_json(send, status, message, sandbox_id=sandbox_id, port=port)

    async def _route(self, scope: Scope, receive: Receive, send: Send, target: Target, *,
                     resume: bool | None = None) -> Route | None:
        """Resolve and authorize; answers the client itself and returns None on refusal.
        `resume`: whether a paused sandbox is resumed (default: the proxy's auto_resume)."""
        sid, port = target.sandbox_id, target.port
        resume = self.auto_resume if resume is None else resume
        if not is_sandbox_id(sid):
            # well-formed (routing.py) but never issued: nothing to look up
            await self._deny(scope, receive, send, 502, responses.NOT_FOUND, sandbox_id=sid)
            return None
        try:
            route = await self.orchestrator.route(sid, port, resume=resume)
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
            given = header(scope, TRAFFIC_TOKEN) or ""
            if not hmac.compare_digest(given.encode(), route.traffic_token.encode()):
                msg = ("missing e2b-traffic-access-token header" if not given
                       else "invalid e2b-traffic-access-token")
                await self._deny(scope, receive, send, 403, msg, sandbox_id=sid)
                return None
        self._watch_run(route)
        return route

    def _watch_run(self, route: Route) -> None:
        """When this incarnation ends, close the idle connections into it."""
        gone = route.gone
        if gone is None or gone in self._watched:
            return
        self._watched.add(gone)
        host = route.host
        gone.subscribe(lambda: self._pool.drop(host))

    # --- HTTP -------------------------------------------------------------------------

    async def _http_exchange(self, scope: Scope, receive: Receive, send: Send,
                             target: Target, route: Route) -> None:
        body_done = asyncio.Event()
        request = self._upstream_request(scope, receive, target, route, body_done)

        # The response is pumped in this task; a watcher cancels it when the client goes
        # away, so an endless upstream stream does not keep running for nobody, and a
        # callback when the sandbox goes away, so that the client is not left hanging.
        this = asyncio.current_task()
        assert this is not None
        cut = _Cut()
        progress = _Progress()
        watcher = asyncio.create_task(self._wait_disconnect(receive, body_done, cut, this))
        unsubscribe = None
        if route.gone is not None:
            unsubscribe = route.gone.subscribe(lambda: cut.cancel(this, "gone"))
        try:
            await self._pump(request, send, target, route, progress)
        except asyncio.CancelledError:
            if cut.why is None or this.uncancel() != 0:
                raise
            # our own cancellation
            if cut.why == "gone":
                assert route.gone is not None
                await self._end_exchange(send, target, progress, route.gone.reason)
            return
        except _ClientGone:
            return
        finally:
            watcher.cancel()
            if unsubscribe is not None:
                unsubscribe()

    def _upstream_request(self, scope: Scope, receive: Receive, target: Target, route: Route,
                          body_done: asyncio.Event) -> _Forward:
        """The request as it goes into the guest: the headers a guest may see (no
        credentials of ours, X-Forwarded-For set), the Host the sandbox asked for, and
        the client's body streamed through (`body_done` is set once it is read)."""
        headers = guest_headers(scope, target.port)
        masked = masked_host(route, target)
        if masked is not None:
            # the client's Host goes on as X-Forwarded-Host (what E2B's proxy does)
            original = header(scope, b"host")
            headers = [(k, v) for k, v in headers if k != b"host"]
            headers.append((b"host", masked.encode()))
            if original:
                headers.append((FORWARDED_HOST, original.encode("latin-1")))
        names = {k for k, _ in headers}
        if b"host" not in names:
            headers.append((b"host", f"{route.host}:{route.port}".encode()))
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
        return (scope["method"].encode(), raw_path + (b"?" + query if query else b""),
                headers, content)

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
    async def _wait_disconnect(receive: Receive, body_done: asyncio.Event, cut: _Cut,
                               task: asyncio.Task[None]) -> None:
        await body_done.wait()  # receive() belongs to the body reader until then
        while True:
            msg: Message = await receive()
            if msg["type"] == "http.disconnect":
                cut.cancel(task, "client")
                return

    @staticmethod
    async def _end_exchange(send: Send, target: Target, progress: _Progress,
                            reason: str) -> None:
        """The sandbox went away mid-exchange (the pump was cancelled, having closed the
        upstream connection): finish the response as cleanly as its state allows."""
        sid = target.sandbox_id
        try:
            async with asyncio.timeout(responses.END_GRACE_S):
                if not progress.started:
                    await responses.send_json(
                        send, 502, f"{responses.NOT_FOUND}: it was {reason}",
                        sandbox_id=sid, port=target.port)
                elif progress.finishing:
                    await send({"type": "http.response.body", "body": b"",
                                "more_body": False})
                else:
                    # Returning with the response incomplete makes uvicorn close the
                    # connection: the client sees the connection terminated (as on E2B,
                    # whose SDKs then probe the sandbox), not a hang. A Connect stream is
                    # cut too, not ended with an error message of ours: the SDKs turn
                    # only a terminated connection into "the sandbox was killed".
                    log.info("sandbox %s was %s: cutting a response from port %s", sid,
                             reason, target.port)
        except Exception as exc:  # noqa: BLE001 - the client is gone or stuck: nothing to do
            log.debug("ending an exchange with sandbox %s failed: %r", sid, exc)

    async def _pump(self, request: _Forward, send: Send, target: Target, route: Route,
                    progress: _Progress) -> None:
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
                                    if k.lower() not in HOP_BY_HOP]})
            progress.started = True
            try:
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError as exc:
                # The response has started: all we can do is cut the client off too.
                log.info("upstream %s:%s broke mid-response: %s", target.sandbox_id,
                         target.port, exc)
                raise _ClientGone from exc
            progress.finishing = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await body.aclose()  # returns the connection to the pool, or closes it
            upstream.abandon()  # closes it if the body was cut off before its first read


def build_proxy_app(orchestrator: Orchestrator, domain: str | None, *,
                    api_app: ASGIApp | None = None, auto_resume: bool = True,
                    terminal_links: TerminalLinks | None = None,
                    keys: ApiKeys | None = None) -> ProxyApp:
    """The sandbox proxy. `api_app`, when given, serves requests for `api.<domain>` (one
    TLS listener for everything); `auto_resume` is passed to `orchestrator.route`.

    Serve it with uvicorn, `lifespan="on"` (closes the upstream pool), a long
    `timeout_keep_alive` (SDK pools reuse connections; 300 s like envd), and for TLS
    `ssl_certfile`/`ssl_keyfile` from `tls.ensure_certificates(state_dir, domain)`.
    `terminal_links` turns on the web terminal (host/web), opened by those links or by
    one of `keys`.
    """
    return ProxyApp(orchestrator, domain, api_app=api_app, auto_resume=auto_resume,
                    terminal_links=terminal_links, keys=keys)
