"""envd's plain HTTP routes: /health, /files, /init, /envs, /metrics (spec §4.5), and
/aenv/reclaim (ours: reclaim.py).

Every route but /health needs X-Access-Token once /init set a token; /files also
accepts a signed URL instead. Errors are JSON `{"code": <status>, "message": ...}`.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from ..config import EnvdConfig
from ..state import Defaults
from ..volumes.mounts import Mounts
from .access import token_required
from .download import download_endpoint
from .envs import envs_endpoint
from .errors import HTTPError, json_error
from .health import health
from .init import init_endpoint
from .metrics import metrics
from .reclaim import reclaim_endpoint
from .upload import upload_endpoint


def routes(defaults: Defaults, config: EnvdConfig, mounts: Mounts) -> list[BaseRoute]:
    return [
        Route("/health", health, methods=["GET"]),
        Route("/files", download_endpoint(defaults), methods=["GET"]),
        Route("/files", upload_endpoint(defaults), methods=["POST"]),
        Route("/init", init_endpoint(defaults, mounts), methods=["POST"]),
        Route("/envs", token_required(defaults, envs_endpoint(defaults)), methods=["GET"]),
        Route("/metrics", token_required(defaults, metrics), methods=["GET"]),
        Route("/aenv/reclaim", token_required(defaults, reclaim_endpoint), methods=["POST"]),
    ]


__all__ = ["HTTPError", "json_error", "routes"]
