"""The HTTP side: `ProxyMetrics` around toy ASGI apps (HTTP status classes and bytes both
ways, WebSocket sessions accepted or refused, the app raising, skipped hosts, lifespan
untouched), and `GET /metrics` on the REST API (no key, text format, not in the E2B
document)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import Message, Receive, Scope, Send

from host.api import ApiKeys, build_api_app
from host.metrics import Metrics, ProxyMetrics
from tests.api.double import FakeOrchestrator

from .scrape import Scrape, parse, scrape


async def render(m: Metrics) -> Scrape:
    return parse((await m.render()).decode())


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """HTTP: answers the request body back, with the status in the path (/201)."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    status = int(scope["path"].strip("/") or 200)
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body + b"!", "more_body": True})
    await send({"type": "http.response.body", "body": b"?"})


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
async def client(metrics: Metrics) -> AsyncIterator[httpx.AsyncClient]:
    app = ProxyMetrics(echo, metrics, skip_hosts=frozenset({"api.sbx.test"}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://49983-x.sbx.test") as c:
        yield c


async def test_http_requests_by_status_class_and_bytes(metrics: Metrics,
                                                       client: httpx.AsyncClient) -> None:
    r = await client.post("/201", content=b"hello")
    assert (r.status_code, r.content) == (201, b"hello!?")
    await client.get("/404")
    await client.get("/404")
    await client.get("/503")
    page = await render(metrics)
    assert page.value("aenv_proxy_requests_total", kind="http", status="2xx") == 1
    assert page.value("aenv_proxy_requests_total", kind="http", status="4xx") == 2
    assert page.value("aenv_proxy_requests_total", kind="http", status="5xx") == 1
    assert page.value("aenv_proxy_bytes_total", direction="in") == 5
    assert page.value("aenv_proxy_bytes_total", direction="out") == len(b"hello!?") + 3 * 2


async def test_skipped_hosts_are_not_counted(metrics: Metrics,
                                             client: httpx.AsyncClient) -> None:
    await client.get("http://api.sbx.test:3001/200")
    assert (await render(metrics)).total("aenv_proxy_requests_total") == 0


async def test_an_app_that_raises_counts_as_5xx(metrics: Metrics) -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("bug")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ProxyMetrics(
            broken, metrics)), base_url="http://x") as c:
        with pytest.raises(RuntimeError):
            await c.get("/")
    page = await render(metrics)
    assert page.value("aenv_proxy_requests_total", kind="http", status="5xx") == 1


async def drive(app: Any, scope: Scope, incoming: list[Message]) -> list[Message]:
    """Run an ASGI app on `incoming` messages; returns what it sent."""
    sent: list[Message] = []
    queue = list(incoming)

    async def receive() -> Message:
        return queue.pop(0) if queue else {"type": "websocket.disconnect", "code": 1000}

    async def send(msg: Message) -> None:
        sent.append(msg)

    await app(scope, receive, send)
    return sent


WS_SCOPE: Scope = {"type": "websocket", "path": "/ws", "headers": [(b"host", b"x")]}


async def test_websocket_sessions_and_message_bytes(metrics: Metrics) -> None:
    async def ws_echo(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (msg := await receive())["type"] == "websocket.receive":
            if msg.get("text") is not None:
                await send({"type": "websocket.send", "text": msg["text"] * 2})
            else:
                await send({"type": "websocket.send", "bytes": msg["bytes"]})

    sent = await drive(ProxyMetrics(ws_echo, metrics), WS_SCOPE, [
        {"type": "websocket.connect"},
        {"type": "websocket.receive", "text": "héllo"},          # 6 bytes as UTF-8
        {"type": "websocket.receive", "bytes": b"\x00\x01\x02"},
    ])
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.send"]
    page = await render(metrics)
    assert page.value("aenv_proxy_requests_total", kind="websocket", status="1xx") == 1
    assert page.value("aenv_proxy_bytes_total", direction="in") == 6 + 3
    assert page.value("aenv_proxy_bytes_total", direction="out") == 12 + 3


async def test_websocket_refused_before_the_handshake(metrics: Metrics) -> None:
    async def deny(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "websocket.close", "code": 1008})

    async def deny_with_body(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "websocket.http.response.start", "status": 502, "headers": []})
        await send({"type": "websocket.http.response.body", "body": b"gone"})

    await drive(ProxyMetrics(deny, metrics), WS_SCOPE, [{"type": "websocket.connect"}])
    await drive(ProxyMetrics(deny_with_body, metrics), WS_SCOPE,
                [{"type": "websocket.connect"}])
    page = await render(metrics)
    assert page.value("aenv_proxy_requests_total", kind="websocket", status="4xx") == 1
    assert page.value("aenv_proxy_requests_total", kind="websocket", status="5xx") == 1
    assert page.value("aenv_proxy_bytes_total", direction="out") == 4


async def test_lifespan_passes_through(metrics: Metrics) -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])
        await send({"type": "lifespan.startup.complete"})

    sent = await drive(ProxyMetrics(app, metrics), {"type": "lifespan"}, [])
    assert seen == ["lifespan"]
    assert sent == [{"type": "lifespan.startup.complete"}]
    assert (await render(metrics)).total("aenv_proxy_requests_total") == 0


# ---- GET /metrics on the REST API ------------------------------------------------------

async def test_api_serves_metrics_without_a_key() -> None:
    orch = FakeOrchestrator()
    try:
        app = build_api_app(orch, ApiKeys(["e2b_k"]), metrics=Metrics())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://api") as c:
            page = await scrape(c)  # asserts 200 and the text content type
            assert page.value("aenv_sandbox_operation_seconds_count", operation="create") == 0
            r = await c.get("/metrics")
            assert r.headers["content-type"] == CONTENT_TYPE_LATEST
            assert (await c.post("/metrics")).status_code == 405
            assert (await c.get("/sandboxes")).status_code == 401  # the rest still needs it
            doc = (await c.get("/openapi.json", headers={"x-api-key": "e2b_k"})).json()
            assert "/metrics" not in doc["paths"]
    finally:
        orch.close()


async def test_api_without_metrics_has_no_route() -> None:
    orch = FakeOrchestrator()
    try:
        app = build_api_app(orch, ApiKeys(["e2b_k"]))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://api") as c:
            assert (await c.get("/metrics")).status_code == 404
    finally:
        orch.close()
