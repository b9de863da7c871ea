"""A service for the template API tests: the REST API over a real `NodeOrchestrator` whose
runtime is the fake (tests/orchestrator/fakes.py: no VM), as an ASGI app that starts and
closes the orchestrator in the serving loop's lifespan (uvicorn with lifespan="on").

`node_service` serves one over HTTP for a test; tests/api (the e2b SDK) and tests/cli
(`aenv template ...`) import it as a fixture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send

from host.api import ApiKeys, build_api_app
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from tests.orchestrator.fakes import FakeEnvd, FakeRuntime

from .conftest import API_KEY, ServerThread

DOMAIN = "sbx.test"


class NodeService:
    """`app` is the API; `runtime`, `envd`, `node` and `state_dir` are there to inspect;
    `url` is where `node_service` serves it."""

    def __init__(self, state_dir: Path, **api: Any) -> None:
        self.state_dir = state_dir
        self.url = ""
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


@pytest.fixture
def node_service(tmp_path: Path) -> Iterator[NodeService]:
    """A NodeService served by uvicorn on a loopback port (`url`), its orchestrator started
    in the lifespan; stopped and its store closed after the test. Sets no environment."""
    s = NodeService(tmp_path / "state")
    with ServerThread(s, lifespan="on") as srv:
        s.url = srv.url
        yield s
    s.close_store()
