"""EnvdClient's /init body over the fake envd (httpx MockTransport): every init carries
fresh host entropy for the guest's kernel RNG (issue 14 item 17)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from envd import entropy as envd_entropy
from host.contract import Placement
from host.guestio import ENTROPY_BYTES, ENTROPY_FIELD
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from host.orchestrator.model import CreateRequest

from .fakes import FakeEnvd, FakeRuntime


def sent_entropy(body: dict[str, Any]) -> bytes:
    return bytes.fromhex(body[ENTROPY_FIELD])


def test_field_is_the_one_envd_reads() -> None:
    assert ENTROPY_FIELD == envd_entropy.ENTROPY_FIELD == "aenvEntropy"
    assert 0 < ENTROPY_BYTES == 64 <= envd_entropy.MAX_ENTROPY_BYTES


@pytest.mark.asyncio(loop_scope="function")
async def test_every_init_carries_fresh_entropy(envd: FakeEnvd) -> None:
    client = EnvdClient(transport=envd.transport())
    try:
        for sid, host in (("s1", "10.0.0.2"), ("s1", "10.0.0.2"), ("s2", "10.0.0.3")):
            await client.init(Placement(sandbox_id=sid, envd_host=host, envd_port=49983),
                              token=None, current_token=None, env_vars={})
    finally:
        await client.aclose()
    sent = [sent_entropy(body) for _, body, _ in envd.inits]
    assert len(sent) == 3 and all(len(e) == ENTROPY_BYTES for e in sent)
    assert len(set(sent)) == 3


@pytest.mark.asyncio(loop_scope="function")
async def test_forks_and_resumes_get_their_own_entropy(store: Store, rt: FakeRuntime,
                                                      envd: FakeEnvd) -> None:
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    try:
        parent = await o.create(CreateRequest())
        other = await o.create(CreateRequest())  # same template snapshot
        kids = await o.fork(parent.sandbox_id, 2, 60)
        assert all(k.sandbox is not None for k in kids)
        await o.pause(other.sandbox_id)
        await o.connect(other.sandbox_id, 60)
    finally:
        await o.aclose()
    sent = [sent_entropy(body) for _, body, _ in envd.inits]
    # parent, other, two children, other resumed
    assert len(sent) == 5 and all(len(e) == ENTROPY_BYTES for e in sent)
    assert len(set(sent)) == 5


@pytest.mark.asyncio(loop_scope="function")
async def test_memory_snapshots_ask_the_guest_to_drop_its_page_cache_first(
        store: Store, rt: FakeRuntime, envd: FakeEnvd) -> None:
    """A fork, a named snapshot and a pause nobody waits on (to free memory; a TTL's) ask
    envd to drop the guest's clean page cache and pass what it freed to the runtime, which
    waits for it before the cut (issue 30). A pause answered at the stop does not (the
    reclaim would delay its answer), nor a filesystem-only pause (no memory kept)."""
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    try:
        sbx = await o.create(CreateRequest())
        host = envd.inits[-1][0]
        envd.freed[host] = 180
        await o.fork(sbx.sandbox_id, 2, 60)
        await o.snapshot(sbx.sandbox_id, None)
        await o.pause_for_memory(sbx.sandbox_id)
        assert rt.reclaimed == [180, 180, 180]
        assert envd.reclaims == [host] * 3
        await o.connect(sbx.sandbox_id, 60)
        await o.pause(sbx.sandbox_id)
        await o.connect(sbx.sandbox_id, 60)
        await o.pause(sbx.sandbox_id, memory=False)
        assert rt.reclaimed[-2:] == [None, None] and len(envd.reclaims) == 3
    finally:
        await o.aclose()


@pytest.mark.parametrize("answer", [
    httpx.Response(404),  # E2B's envd, or an older aenv envd in a template
    httpx.Response(500, json={"code": 500, "message": "cannot drop the page cache"}),
    httpx.Response(200, json={"freedMiB": "lots"}),
    httpx.Response(200, json={"freedMiB": True}),
    httpx.Response(200, json={"freed": 5}),
    httpx.Response(200, content=b"not json"),
    httpx.Response(200, content=b"x" * (128 * 1024)),  # past the answer limit
], ids=["404", "500", "string", "bool", "no-field", "not-json", "too-large"])
@pytest.mark.asyncio(loop_scope="function")
async def test_a_guest_that_does_not_drop_its_cache_is_snapshotted_anyway(
        store: Store, rt: FakeRuntime, envd: FakeEnvd, answer: httpx.Response,
        caplog: pytest.LogCaptureFixture) -> None:
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    try:
        sbx = await o.create(CreateRequest())
        envd.freed[envd.inits[-1][0]] = answer
        kids = await o.fork(sbx.sandbox_id, 1, 60)
        assert kids[0].sandbox is not None
        assert rt.reclaimed == [0]
    finally:
        await o.aclose()
    if answer.status_code != 404:  # a missing route is expected, the rest is said
        assert "page cache was not dropped" in caplog.text


@pytest.mark.asyncio(loop_scope="function")
async def test_a_negative_amount_counts_as_nothing(envd: FakeEnvd) -> None:
    client = EnvdClient(transport=envd.transport())
    try:
        envd.freed["10.0.0.9"] = -40
        got = await client.reclaim(Placement(sandbox_id="s", envd_host="10.0.0.9",
                                             envd_port=49983), None)
    finally:
        await client.aclose()
    assert got == 0
