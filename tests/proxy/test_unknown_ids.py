"""The proxy keeps no state for ids that are not sandboxes of this node: anyone may name
any id (traffic needs no API key), so what an unknown id leaves behind would grow without
bound. Against the REAL orchestrator (SQLite store, the fake runtime for VMs): its
activity record (pressure.py's coldness) and per-run events stay empty, and the process'
resident memory stays flat over 20,000 requests naming random ids."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import string
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.types import Message

from host.contract import Placement
from host.ids import new_sandbox_id
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from host.orchestrator.model import CreateRequest
from host.proxy import ProxyApp, build_proxy_app
from tests.api.conftest import ServerThread
from tests.orchestrator.fakes import FakeEnvd, FakeRuntime

from .conftest import DOMAIN

REQUESTS = 20_000
WARM_UP = 2_000
# Retained memory allowed over all REQUESTS (0 measured here; ~50 bytes a request of
# allocator noise allowed). Remembering each well-formed id as the activity record did
# grew it by 2.3 MiB; the emptiness checks catch that exactly, this bound any other
# per-id state.
RSS_SLACK = 1024 * 1024


async def ok(scope: Any, receive: Any, send: Any) -> None:
    """The one sandbox's server (every port of it)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


class LoopbackRuntime(FakeRuntime):
    """Its VMs' ports all lead to one loopback server."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    async def start(self, sandbox_id: str, snapshot: Any, network: Any, *,
                    reboot: bool = False, **kwargs: Any) -> Placement:
        await super().start(sandbox_id, snapshot, network, reboot=reboot, **kwargs)
        here = Placement(sandbox_id, "127.0.0.1", self.port,
                         {"port_forwards": {"49983": self.port, "8000": self.port}})
        self.vms[sandbox_id] = here
        return here


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[NodeOrchestrator, ProxyApp]]:
    with ServerThread(ok) as upstream:
        envd = FakeEnvd()
        rt = LoopbackRuntime(upstream.port)
        rt.envd = envd
        store = Store(tmp_path / "state.db")
        orch = NodeOrchestrator(store, rt, domain=DOMAIN,
                                envd=EnvdClient(transport=envd.transport()))
        await orch.start(ttl_interval_s=3600)
        proxy = build_proxy_app(orch, DOMAIN)
        try:
            yield orch, proxy
        finally:
            await proxy.aclose()
            await orch.aclose(grace_s=5)
            store.close()


async def request(app: ProxyApp, headers: list[tuple[bytes, bytes]]) -> int:
    """One GET through the proxy's ASGI interface (no sockets: 20,000 of them in seconds);
    the client stays connected until the answer is sent."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": "/health", "raw_path": b"/health",
             "query_string": b"", "headers": headers, "client": ("192.0.2.1", 40000),
             "server": ("127.0.0.1", 3001)}
    sent: list[Message] = []
    asked = False

    async def receive() -> Message:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()   # cancelled by the proxy once it answered
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return int(sent[0]["status"])


def random_request(rng: random.Random) -> tuple[list[tuple[bytes, bytes]], int]:
    """(headers, the status they must get) naming an id no sandbox has."""
    kind = rng.random()
    if kind < 0.8:        # well-formed: looked up, not found
        sid, status = new_sandbox_id(), 502
    elif kind < 0.95:     # routable, never issued: not found without a look-up
        sid = "".join(rng.choices(string.ascii_lowercase + string.digits,
                                  k=rng.randint(1, 40)))
        status = 502
    else:                 # malformed
        sid, status = "Bad_" + new_sandbox_id(), 400
    port = rng.choice((49983, 8000, 3000))
    if rng.random() < 0.5:
        return [(b"host", f"{port}-{sid}.{DOMAIN}".encode())], status
    return [(b"host", b"localhost:3001"), (b"e2b-sandbox-id", sid.encode()),
            (b"e2b-sandbox-port", str(port).encode())], status


def rss_bytes() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_random_ids_leave_nothing_behind(node) -> None:
    orch, proxy = node
    ctx = orch._ctx   # the per-id records a request could grow (white box on purpose)
    rng = random.Random(28)
    for _ in range(WARM_UP):   # thread pool, SQLite cache, allocator arenas settle first
        headers, status = random_request(rng)
        assert await request(proxy, headers) == status
    before = rss_bytes()
    for _ in range(REQUESTS):
        headers, status = random_request(rng)
        assert await request(proxy, headers) == status
    grown = rss_bytes() - before
    assert ctx.activity == {} and ctx.runs == {} and ctx.locks == {}
    assert grown < RSS_SLACK, f"RSS grew {grown} bytes over {REQUESTS} requests"

    # a sandbox of this node is recorded when a request reaches it
    sid = (await orch.create(CreateRequest())).sandbox_id
    assert await request(proxy, [(b"host", f"8000-{sid}.{DOMAIN}".encode())]) == 200
    assert set(ctx.activity) == {sid}
