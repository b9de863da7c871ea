"""Fixtures for the REST API tests: the API app over the in-memory orchestrator double
(unit tests of the HTTP mapping only), reached through httpx's ASGI transport or a real
uvicorn server on a loopback port (for the e2b SDK)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Self

import httpx
import pytest
import uvicorn

from host.api import ApiKeys, build_api_app

from .double import FakeOrchestrator

API_KEY = "e2b_test_key"


@pytest.fixture
def orch() -> Iterator[FakeOrchestrator]:
    o = FakeOrchestrator()
    yield o
    o.close()


@pytest.fixture
def app(orch: FakeOrchestrator):
    return build_api_app(orch, ApiKeys([API_KEY]), domain="sbx.test")


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://api.sbx.test",
                                 headers={"X-API-Key": API_KEY}) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerThread:
    """A uvicorn server in a thread of this process (stopped and joined on exit)."""

    def __init__(self, app, port: int | None = None, **kwargs) -> None:
        self.port = port or free_port()
        kwargs.setdefault("lifespan", "off")
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                **kwargs)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()),
                                       daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def api_server(app) -> Iterator[ServerThread]:
    with ServerThread(app) as srv:
        yield srv
