"""A service for the template API tests: the REST API over a real `NodeOrchestrator` whose
runtime is the fake (tests/orchestrator/fakes.py: no VM), as an ASGI app that starts and
closes the orchestrator in the serving loop's lifespan (uvicorn with lifespan="on")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.types import Receive, Scope, Send

from host.api import ApiKeys, build_api_app
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from tests.orchestrator.fakes import FakeEnvd, FakeRuntime

from .conftest import API_KEY

DOMAIN = "sbx.test"


class NodeService:
    """`app` is the API; `runtime`, `envd`, `node` and `state_dir` are there to inspect."""

    def __init__(self, state_dir: Path, **api: Any) -> None:
        self.state_dir = state_dir
        self.runtime = FakeRuntime()
        self.envd = self.runtime.envd = FakeEnvd()
        self.store = Store(state_dir / "state.db")
        self.node = NodeOrchestrator(self.store, self.runtime, domain=DOMAIN,
                                     envd=EnvdClient(transport=self.envd.transport()))
        self.app = build_api_app(self.node, ApiKeys([API_KEY]), domain=DOMAIN, **api)

    @property
    def files_dir(self) -> Path:
        return self.state_dir / "template-files"

    async def start(self) -> None:
        await self.node.start(ttl_interval_s=3600)

    async def aclose(self) -> None:
        await self.node.aclose(grace_s=5)

    def close_store(self) -> None:
        self.store.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            await self.start()
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await self.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await self.app(scope, receive, send)
