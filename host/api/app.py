"""Builds the E2B-compatible REST API (starlette) over an `Orchestrator`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from host.orchestrator.service import Orchestrator

from . import sandboxes as sb
from . import snapshots as snap
from .auth import ApiKeyMiddleware, ApiKeys
from .errors import error_response
from .openapi import document

Endpoint = Callable[[Request], Awaitable[Response]]


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (unknown route, wrong method) as E2B error bodies."""
    assert isinstance(exc, HTTPException)
    resp = error_response(exc.status_code, str(exc.detail))
    resp.headers.update(exc.headers or {})
    return resp


def _by_method(handlers: dict[str, Endpoint]) -> Endpoint:
    """One endpoint per path, so that a 405 lists every allowed method in `Allow`."""
    if "GET" in handlers:
        handlers = {**handlers, "HEAD": handlers["GET"]}

    async def endpoint(request: Request) -> Response:
        return await handlers[request.method](request)

    endpoint.methods = list(handlers)  # type: ignore[attr-defined]
    return endpoint


def routes() -> list[Route]:
    sid = "/sandboxes/{sandbox_id}"
    table: dict[str, dict[str, Endpoint]] = {
        "/health": {"GET": health},
        "/openapi.json": {"GET": openapi},
        "/v2/sandboxes": {"POST": sb.create_v2, "GET": sb.list_v2},
        "/sandboxes": {"POST": sb.create_v1, "GET": sb.list_v1},
        sid: {"GET": sb.get_one, "DELETE": sb.kill},
        f"/v2{sid}/connect": {"POST": sb.connect_v2},
        f"{sid}/connect": {"POST": sb.connect_v1},
        f"{sid}/pause": {"POST": sb.pause},
        f"{sid}/resume": {"POST": sb.resume_v1},
        f"{sid}/timeout": {"POST": sb.set_timeout},
        f"{sid}/refreshes": {"POST": sb.refresh},
        f"{sid}/fork": {"POST": sb.fork},
        f"{sid}/network": {"PUT": sb.update_network},
        f"{sid}/metrics": {"GET": sb.metrics},
        f"{sid}/logs": {"GET": sb.logs_v1},
        f"/v2{sid}/logs": {"GET": sb.logs_v2},
        f"{sid}/snapshots": {"POST": snap.create},
        "/snapshots": {"GET": snap.list_all},
        # `path` convertor: ids like team/snap:default arrive as team%2Fsnap%3Adefault
        "/templates/{template_id:path}": {"DELETE": snap.delete_template},
    }
    out = []
    for path, handlers in table.items():
        endpoint = _by_method(handlers)
        out.append(Route(path, endpoint, methods=endpoint.methods))  # type: ignore[attr-defined]
    return out


def build_api_app(orchestrator: Orchestrator, keys: ApiKeys | Path | str, *,
                  domain: str | None = None) -> Starlette:
    """The REST API app.

    `keys`: an `ApiKeys`, or the path of the key file (created with one key on first use).
    `domain`: returned as `domain` in Sandbox objects so the SDK reaches envd through our
    proxy; defaults to `orchestrator.domain`.
    """
    if not isinstance(keys, ApiKeys):
        keys = ApiKeys.load_or_create(keys)
    app = Starlette(
        routes=routes(),
        middleware=[Middleware(ApiKeyMiddleware, keys=keys)],
        exception_handlers={HTTPException: http_error},
    )
    app.state.orchestrator = orchestrator
    app.state.domain = domain
    app.state.keys = keys
    app.state.openapi = document()
    return app
