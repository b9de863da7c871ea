"""Builds the E2B-compatible REST API (starlette) over an `Orchestrator`."""

from __future__ import annotations

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


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (unknown route, wrong method) as E2B error bodies."""
    assert isinstance(exc, HTTPException)  # noqa: S101 - registered for HTTPException only
    return error_response(exc.status_code, str(exc.detail))


def routes() -> list[Route]:
    sid = "/sandboxes/{sandbox_id}"
    return [
        Route("/health", health, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/v2/sandboxes", sb.create_v2, methods=["POST"]),
        Route("/v2/sandboxes", sb.list_v2, methods=["GET"]),
        Route("/sandboxes", sb.create_v1, methods=["POST"]),
        Route("/sandboxes", sb.list_v1, methods=["GET"]),
        Route(sid, sb.get_one, methods=["GET"]),
        Route(sid, sb.kill, methods=["DELETE"]),
        Route(f"/v2{sid}/connect", sb.connect_v2, methods=["POST"]),
        Route(f"{sid}/connect", sb.connect_v1, methods=["POST"]),
        Route(f"{sid}/pause", sb.pause, methods=["POST"]),
        Route(f"{sid}/resume", sb.resume_v1, methods=["POST"]),
        Route(f"{sid}/timeout", sb.set_timeout, methods=["POST"]),
        Route(f"{sid}/refreshes", sb.refresh, methods=["POST"]),
        Route(f"{sid}/fork", sb.fork, methods=["POST"]),
        Route(f"{sid}/network", sb.update_network, methods=["PUT"]),
        Route(f"{sid}/metrics", sb.metrics, methods=["GET"]),
        Route(f"{sid}/logs", sb.logs_v1, methods=["GET"]),
        Route(f"/v2{sid}/logs", sb.logs_v2, methods=["GET"]),
        Route(f"{sid}/snapshots", snap.create, methods=["POST"]),
        Route("/snapshots", snap.list_all, methods=["GET"]),
        Route("/templates/{template_id:path}", snap.delete_template, methods=["DELETE"]),
    ]


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
