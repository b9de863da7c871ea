"""Builds envd's ASGI app: Connect services, plain HTTP routes, terminal, lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Mount

from . import http, rpc
from .config import EnvdConfig
from .services.filesystem import FilesystemService
from .services.process import ProcessService, terminal_route
from .spec.filesystem.filesystem_connect import FilesystemASGIApplication
from .spec.process.process_connect import ProcessASGIApplication
from .state import Defaults
from .volumes.mounts import Mounts

# Connect headers browsers must be allowed to read (upstream uses connectrpc.com/cors).
_EXPOSED_HEADERS = [
    "Grpc-Status", "Grpc-Message", "Grpc-Status-Details-Bin",
    "Connect-Content-Encoding", "Connect-Accept-Encoding", "Content-Encoding",
]


def build_app(config: EnvdConfig | None = None) -> Starlette:
    config = config or EnvdConfig()
    defaults = Defaults.from_config(config)
    processes = ProcessService(defaults, keepalive_default_s=config.default_keepalive_s)
    filesystem = FilesystemService(defaults)
    mounts = Mounts()   # volumes /init asks for (envd/volumes)
    interceptors = rpc.interceptors(defaults)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await mounts.aclose()
            await filesystem.aclose()
            await processes.aclose()

    routes = [
        *http.routes(defaults, config, mounts),
        terminal_route(processes.table, defaults),
        Mount("/process.Process", ProcessASGIApplication(
            processes, interceptors=interceptors, read_max_bytes=config.read_max_bytes,
            codecs=rpc.codecs())),
        Mount("/filesystem.Filesystem", FilesystemASGIApplication(
            filesystem, interceptors=interceptors, read_max_bytes=config.read_max_bytes,
            codecs=rpc.codecs())),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[
            Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"],
                       allow_headers=["*"], expose_headers=_EXPOSED_HEADERS),
            Middleware(rpc.DisconnectMiddleware),
            Middleware(rpc.RefuseGrpcMiddleware),
        ],
    )
    app.state.defaults = defaults
    app.state.processes = processes
    app.state.config = config
    return app
