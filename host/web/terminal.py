"""The web terminal: `/terminal/<sandbox id>` on the sandbox proxy.

A page with xterm.js (vendored by `make web`, served from `static/`) that attaches to
envd's `/terminal` WebSocket through the proxy. Who may open it: a request with a valid
API key (`X-API-Key`), or a signed link (`?token=`, links.py) as `aenv terminal --web`
prints. Either way the page is answered with the token in an HttpOnly, SameSite=Strict
cookie scoped to `/terminal/<id>`, and a link's token is then dropped from the address
bar by a redirect. The page's WebSocket (`/terminal/<id>/ws`) and its status probe
(`/terminal/<id>/status`) are authorised by that cookie only, and the WebSocket must
come from the page's own origin. The guest never sees the cookie or the API key: the
upstream request carries only the sandbox's envd access token.

The proxy relays the WebSocket without resuming the sandbox (an open browser tab must
not keep a paused sandbox alive); the page polls `/status` and reconnects once the sandbox
runs again.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from host.api.auth import ApiKeys
from host.orchestrator.errors import SandboxNotFound
from host.orchestrator.service import Orchestrator

from .links import DEFAULT_TTL_S, TerminalLinks

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
VENDORED = ("vendor/xterm.mjs", "vendor/addon-fit.mjs", "vendor/xterm.css")
COOKIE = "aenv_terminal"
ENVD_TERMINAL_PATH = "/terminal"
CLOSE_EXPIRED = 4401     # as envd's own "unauthorized" close code
CLOSE_NOT_FOUND = 4404

# relays an already authorised WebSocket to envd: (scope, receive, send, sandbox id)
Relay = Callable[[Scope, Receive, Send, str], Awaitable[None]]


def vendored() -> bool:
    return all((STATIC_DIR / name).is_file() for name in VENDORED)


def _page(sandbox_id: str) -> str:
    return (STATIC_DIR / "terminal.html").read_text().replace("{{SANDBOX_ID}}", html.escape(sandbox_id))


class TerminalSite:
    """ASGI app for the `/terminal/...` paths the proxy hands it."""

    def __init__(self, orchestrator: Orchestrator, links: TerminalLinks, relay: Relay, *,
                 keys: ApiKeys | None = None) -> None:
        self.orchestrator = orchestrator
        self.links = links
        self.keys = keys
        self.relay = relay
        # a Starlette app, not a bare Router: StaticFiles' 404s need its exception handling
        self.app = Starlette(routes=[
            Mount("/terminal/_static", StaticFiles(directory=STATIC_DIR, check_dir=False)),
            Route("/terminal/{sandbox_id}", self.page, methods=["GET"]),
            Route("/terminal/{sandbox_id}/status", self.status, methods=["GET"]),
            WebSocketRoute("/terminal/{sandbox_id}/ws", self.websocket),
        ])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    # --- the page ---------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        sid = request.path_params["sandbox_id"]
        link = request.query_params.get("token")
        cookie = request.cookies.get(COOKIE)
        if link is not None:
            expires = self.links.expiry(sid, link)
            if expires is None:
                return _refused(401, "This terminal link is invalid or has expired: print a "
                                     f"new one with `aenv terminal --web {sid}`.")
            token = link
        elif self.keys is not None and self.keys.accepts(request.headers.get("x-api-key")):
            token, expires = self.links.token(sid, DEFAULT_TTL_S)
        elif self.links.expiry(sid, cookie) is not None:
            token, expires = cookie or "", 0  # keep the cookie as it is
        else:
            return _refused(401, "Open this page through the link `aenv terminal --web "
                                 f"{sid}` prints, or send X-API-Key.")
        if not vendored():
            return _refused(503, "xterm.js is not vendored on this host: run `make web` "
                                 "(or scripts/vendor-web.sh) and reload.")
        try:
            await self.orchestrator.get(sid)
        except SandboxNotFound:
            return _refused(404, f"Sandbox {sid} was not found.")
        if link is not None:  # out of the address bar and the history
            response: Response = RedirectResponse(request.url.path, status_code=303)
        else:
            response = HTMLResponse(_page(sid), headers=_PAGE_HEADERS)
        if expires:
            response.set_cookie(COOKIE, token, max_age=max(1, expires - int(self.links.clock())),
                                path=f"/terminal/{sid}", httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
        return response

    async def status(self, request: Request) -> Response:
        """{"state": running|paused|...} for the page's reconnect loop (cookie only)."""
        sid = request.path_params["sandbox_id"]
        if self.links.expiry(sid, request.cookies.get(COOKIE)) is None:
            return JSONResponse({"code": 401, "message": "terminal link expired"}, 401)
        try:
            info = await self.orchestrator.get(sid)
        except SandboxNotFound:
            return JSONResponse({"code": 404, "message": f"sandbox {sid} not found"}, 404)
        return JSONResponse({"state": info.state.value}, headers={"cache-control": "no-store"})

    # --- the WebSocket ----------------------------------------------------------------

    async def websocket(self, ws: WebSocket) -> None:
        sid = ws.path_params["sandbox_id"]
        origin = ws.headers.get("origin")
        if origin is not None and origin != _own_origin(ws):
            await ws.close(code=1008)  # before the handshake: the HTTP answer is a 403
            return
        if self.links.expiry(sid, ws.cookies.get(COOKIE)) is None:
            # accepted, then closed: the page reads the code and stops reconnecting
            await _accept_and_close(ws, CLOSE_EXPIRED, "terminal link expired")
            return
        try:
            info = await self.orchestrator.get(sid)
        except SandboxNotFound:
            await _accept_and_close(ws, CLOSE_NOT_FOUND, "sandbox not found")
            return
        params = {k: v for k, v in ws.query_params.items() if k in ("cols", "rows")}
        # Only what envd needs goes on: never the browser's cookies or headers.
        headers: list[tuple[bytes, bytes]] = [(b"host", b"envd")]
        if info.envd_access_token:
            headers.append((b"x-access-token", info.envd_access_token.encode()))
        upstream: dict[str, Any] = dict(ws.scope)
        upstream.update(path=ENVD_TERMINAL_PATH, raw_path=ENVD_TERMINAL_PATH.encode(),
                        query_string=urlencode(params).encode(), headers=headers,
                        subprotocols=[])
        await self.relay(upstream, ws.receive, ws.send, sid)


_PAGE_HEADERS = {
    "cache-control": "no-store",
    # the page loads only its own scripts and styles and talks only to its own origin
    "content-security-policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; "
                                "frame-ancestors 'none'; base-uri 'none'"),
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}


async def _accept_and_close(ws: WebSocket, code: int, reason: str) -> None:
    await ws.accept()
    await ws.close(code=code, reason=reason)


def _own_origin(ws: WebSocket) -> str:
    scheme = "https" if ws.url.scheme == "wss" else "http"
    return f"{scheme}://{ws.headers.get('host', '')}"


def _refused(status: int, message: str) -> Response:
    page = (f"<!doctype html><meta charset=utf-8><title>aenv terminal</title>"
            f"<p>{html.escape(message)}</p>")
    return HTMLResponse(page, status_code=status, headers={"cache-control": "no-store"})


__all__ = ["COOKIE", "TerminalSite", "vendored"]
