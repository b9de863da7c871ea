"""Builds the E2B-compatible REST API (starlette) over an `Orchestrator`."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from host.metrics import Metrics, metrics_route
from host.orchestrator import Orchestrator
from host.web.links import TerminalLinks

from .auth import ApiKeyMiddleware, ApiKeys, NodeKeys, check_separate
from .errors import error_response
from .openapi import served_document
from .routes import OPERATIONS, starlette_routes
from .uploads import DEFAULT_MAX_UPLOAD_BYTES, SECRET_FILE, Uploads, UploadSigner


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (unknown route, wrong method) as E2B error bodies."""
    assert isinstance(exc, HTTPException)
    resp = error_response(exc.status_code, str(exc.detail))
    resp.headers.update(exc.headers or {})
    return resp


def build_api_app(orchestrator: Orchestrator, keys: ApiKeys | Path | str, *,
                  domain: str | None = None, state_dir: Path | None = None,
                  max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
                  terminal_links: TerminalLinks | None = None,
                  terminal_base_url: str | None = None,
                  metrics: Metrics | None = None,
                  extra_routes: Sequence[BaseRoute] = (),
                  node_keys: NodeKeys | None = None) -> Starlette:
    """The REST API app.

    `keys`: an `ApiKeys`, or the path of the key file (created with one key on first use).
    `domain`: returned as `domain` in Sandbox objects so the SDK reaches envd through our
    proxy; defaults to `orchestrator.domain`. `state_dir` keeps the secret that signs
    COPY upload URLs (default: the orchestrator's `state_dir`; with neither, a secret
    that lives as long as the app); `max_upload_bytes` bounds one upload.
    `terminal_links` + `terminal_base_url` (the proxy's public URL) enable the web
    terminal's signed links.
    `metrics`: serve them at `GET /metrics` (no API key, not in the E2B document).
    `extra_routes`: more routes behind the API key (a cluster node's peer file route).
    `node_keys`: the cluster's node key (a node in a cluster): it opens the /cluster/
    routes, which no API key opens, and the rest of the API (host/api/auth.py).
    """
    if not isinstance(keys, ApiKeys):
        keys = ApiKeys.load_or_create(keys)
    if node_keys is not None:
        check_separate(keys, node_keys)
    app = Starlette(
        routes=[*starlette_routes(OPERATIONS), *([metrics_route(metrics)] if metrics else []),
                *extra_routes],
        middleware=[Middleware(ApiKeyMiddleware, keys=keys, node_keys=node_keys)],
        exception_handlers={HTTPException: http_error},
    )
    app.state.orchestrator = orchestrator
    app.state.domain = domain
    app.state.keys = keys
    app.state.openapi = served_document()
    state_dir = state_dir or getattr(orchestrator, "state_dir", None)
    signer = (UploadSigner.load_or_create(Path(state_dir) / SECRET_FILE) if state_dir
              else UploadSigner(secrets.token_bytes(32)))
    app.state.uploads = Uploads(signer=signer, max_bytes=max_upload_bytes)
    # POST /sandboxes/{id}/terminal mints links to the proxy's web terminal (host/web)
    app.state.terminal_links = terminal_links
    app.state.terminal_base_url = terminal_base_url
    return app
