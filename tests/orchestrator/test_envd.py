"""EnvdClient's /init body over the fake envd (httpx MockTransport): every init carries
fresh host entropy for the guest's kernel RNG (issue 14 item 17)."""

from __future__ import annotations

from typing import Any

import pytest

from envd import entropy as envd_entropy
from host.contract import Placement
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import ENTROPY_BYTES, ENTROPY_FIELD, EnvdClient
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
