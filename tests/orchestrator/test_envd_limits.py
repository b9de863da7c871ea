"""EnvdClient against a real loopback server posing as a hostile envd (tests/hostile_envd.py):
each call's answer is read at most to its limit (host/guestio.py), fails with a message
naming the limit, and the host's peak memory stays flat when envd answers 1 GiB
(issue 28 item 2). The API answers such a failure with a 502 E2B error body."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import httpx
import pytest

from host.api import ApiKeys, build_api_app
from host.contract import Placement
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import GuestAnswerInvalid, OperationFailed
from host.orchestrator.model import CreateRequest
from host.orchestrator.states import SandboxState
from tests.hostile_envd import (
    GIB,
    MIB,
    HostileEnvd,
    PeakRss,
    claimed_message,
    frame,
    huge,
    plain,
)

from .fakes import FakeRuntime

pytestmark = pytest.mark.asyncio(loop_scope="function")

FLAT = 64 * MIB  # the host may grow by this much at its peak while refusing 1 GiB
START = "/process.Process/Start"


async def call(client: EnvdClient, name: str, placement: Placement) -> Any:
    if name == "init":
        return await client.init(placement, token=None, current_token=None, env_vars={})
    if name == "metrics":
        return await client.metrics(placement, None)
    if name == "sync":
        return await client.sync(placement, None)
    return await client.healthy(placement, attempts=1)


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize(("name", "path", "limit"), [
    ("init", "/init", "64 KiB"),
    ("metrics", "/metrics", "1 MiB"),
    ("sync", START, "64 KiB"),  # an error status: its body is an error's
])
async def test_a_1gib_answer_is_refused_at_the_limit(name: str, path: str, limit: str,
                                                    length: bool) -> None:
    status = 500 if name == "sync" else 200
    client = EnvdClient()
    try:
        async with HostileEnvd({path: huge(GIB, status=status, length=length)}) as envd:
            with PeakRss() as rss, pytest.raises(GuestAnswerInvalid) as err:
                await call(client, name, envd.placement())
    finally:
        await client.aclose()
    assert str(err.value).startswith(f"sandbox 'sbx-hostile': envd answered more than "
                                     f"{limit} for {path}")
    assert ("(it claimed 1 GiB)" in str(err.value)) is length  # refused from the header
    assert rss.grown_bytes < FLAT


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "chunked"])
async def test_a_1gib_health_answer_is_not_healthy(length: bool,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    client = EnvdClient()
    try:
        async with HostileEnvd({"/health": huge(GIB, length=length)}) as envd:
            with PeakRss() as rss, caplog.at_level(logging.WARNING):
                assert await client.healthy(envd.placement(), attempts=3) is False
            assert envd.asked == ["/health"]  # refused once, not asked again
    finally:
        await client.aclose()
    assert "envd answered more than 64 KiB for /health" in caplog.text
    assert rss.grown_bytes < FLAT


async def test_a_sync_message_claiming_1gib_is_refused_from_its_header() -> None:
    client = EnvdClient()
    try:
        async with HostileEnvd({START: claimed_message(GIB)}) as envd:
            with PeakRss() as rss, pytest.raises(GuestAnswerInvalid) as err:
                await client.sync(envd.placement(), None)
    finally:
        await client.aclose()
    assert str(err.value) == ("sandbox 'sbx-hostile': envd answered more than 1 MiB for one "
                              f"message of {START} (it claimed 1 GiB)")
    assert rss.grown_bytes < FLAT


async def test_a_sync_stream_of_1gib_in_small_messages_is_refused_at_1mib() -> None:
    # 1 GiB of zeros is a stream of empty envelopes: each is fine, the stream is not
    client = EnvdClient()
    try:
        async with HostileEnvd({START: huge(GIB, length=False,
                                            content_type="application/connect+json")}) as envd:
            with PeakRss() as rss, pytest.raises(GuestAnswerInvalid) as err:
                await client.sync(envd.placement(), None)
    finally:
        await client.aclose()
    assert str(err.value) == f"sandbox 'sbx-hostile': envd answered more than 1 MiB for {START}"
    assert rss.grown_bytes < FLAT


async def test_answers_within_the_limits_still_work() -> None:
    ok = frame({"event": {"start": {"pid": 3}}}) + frame(
        {"event": {"end": {"exitCode": 0, "exited": True}}}) + frame({}, flags=2)
    metrics = b'{"ts": 5, "cpu_count": 2, "mem_total": 10, "mem_used": 4}'
    client = EnvdClient()
    try:
        async with HostileEnvd({"/init": plain(204), "/health": plain(204),
                                "/metrics": plain(200, metrics),
                                START: plain(200, ok, content_type="application/connect+json")
                                }) as envd:
            p = envd.placement()
            await client.init(p, token=None, current_token=None, env_vars={})
            assert await client.healthy(p)
            await client.sync(p, None)
            m = await client.metrics(p, None)
    finally:
        await client.aclose()
    assert (m.timestamp, m.cpu_count, m.mem_total, m.mem_used) == (5.0, 2, 10, 4)


@pytest.mark.parametrize("body", [b"[1, 2]", b'{"ts": "soon"}', b'{"cpu_count": {}}', b"nope"])
async def test_metrics_that_are_not_metrics_are_a_clear_error(body: bytes) -> None:
    client = EnvdClient()
    try:
        async with HostileEnvd({"/metrics": plain(200, body)}) as envd:
            with pytest.raises(GuestAnswerInvalid, match="answered /metrics with something "
                                                         "else than metrics"):
                await client.metrics(envd.placement(), None)
    finally:
        await client.aclose()


async def test_a_compressed_answer_is_refused_not_inflated() -> None:
    client = EnvdClient()
    try:
        async with HostileEnvd({"/metrics": huge(MIB // 2, headers={
                "Content-Encoding": "gzip"})}) as envd:
            with pytest.raises(GuestAnswerInvalid, match="Content-Encoding 'gzip'"):
                await client.metrics(envd.placement(), None)
    finally:
        await client.aclose()


async def test_an_error_status_of_metrics_stays_operation_failed() -> None:
    client = EnvdClient()
    try:
        async with HostileEnvd({"/metrics": plain(503, b'{"message": "busy"}')}) as envd:
            with pytest.raises(OperationFailed, match="answered 503") as err:
                await client.metrics(envd.placement(), None)
    finally:
        await client.aclose()
    assert not isinstance(err.value, GuestAnswerInvalid)


# -- at the API --------------------------------------------------------------------------

class LoopbackRuntime(FakeRuntime):
    """FakeRuntime whose VMs' envd is the hostile server."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    async def start(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Placement:
        p = await super().start(sandbox_id, *args, **kwargs)
        p = dataclasses.replace(p, envd_host="127.0.0.1", envd_port=self.port, facts={
            **p.facts, "port_forwards": {"49983": self.port}})
        self.vms[sandbox_id] = p
        return p


def api_of(store: Store, envd: HostileEnvd) -> tuple[NodeOrchestrator, Any]:
    o = NodeOrchestrator(store, LoopbackRuntime(envd.port), envd=EnvdClient())
    return o, build_api_app(o, ApiKeys(["e2b_k"]), domain="sbx.test")


async def test_the_api_answers_502_for_1gib_of_metrics(store: Store) -> None:
    async with HostileEnvd({"/init": plain(204), "/metrics": huge(GIB, length=False)}) as envd:
        o, app = api_of(store, envd)
        try:
            sandbox = await o.create(CreateRequest())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://api.sbx.test",
                                         headers={"X-API-Key": "e2b_k"}) as api:
                with PeakRss() as rss:
                    resp = await api.get(f"/sandboxes/{sandbox.sandbox_id}/metrics")
        finally:
            await o.aclose()
    assert resp.status_code == 502
    assert resp.json() == {"code": 502, "message": f"sandbox '{sandbox.sandbox_id}': envd "
                                                   "answered more than 1 MiB for /metrics"}
    assert resp.headers["Should-Retry"] == "false"  # the same guest answers the same
    assert rss.grown_bytes < FLAT


async def test_the_api_answers_502_when_init_answers_1gib(store: Store) -> None:
    async with HostileEnvd({"/init": huge(GIB)}) as envd:
        o, app = api_of(store, envd)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://api.sbx.test",
                                         headers={"X-API-Key": "e2b_k"}) as api:
                resp = await api.post("/sandboxes", json={"templateID": "base"})
            records = store.list_sandboxes()
        finally:
            await o.aclose()
    assert resp.status_code == 502, resp.text
    body = resp.json()
    assert body["code"] == 502
    assert body["message"].endswith("envd answered more than 64 KiB for /init (it claimed "
                                    "1 GiB)")
    assert [r.state for r in records] == [SandboxState.KILLED]  # rolled back
