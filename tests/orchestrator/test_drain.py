"""The stop-time drain (host/orchestrator/drain.py) over the fake runtime and a real SQLite
store: every running sandbox is paused with its memory and marked, starts are refused and
/health says why meanwhile; the next orchestrator on the same store resumes exactly those,
a sandbox its user paused stays paused, and one whose resume failed resumes at its first
request through the proxy even without autoResume. The VM-backed drain is in
tests/e2e/test_drain.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from host.api.errors import response_for
from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import CapacityExceeded
from host.orchestrator.model import CreateRequest
from host.orchestrator.records import drained
from host.orchestrator.states import SandboxState as S

on_loop = pytest.mark.asyncio(loop_scope="function")


@contextlib.asynccontextmanager
async def _node(store, rt, envd) -> AsyncIterator[NodeOrchestrator]:  # type: ignore[no-untyped-def]
    """One start of the node on `store`, until the block ends; what the start spawned
    (the resume of drained sandboxes) is done before the block runs."""
    o = NodeOrchestrator(store, rt, domain="sbx.test",
                         envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)
    try:
        while o._tasks:
            await asyncio.gather(*list(o._tasks), return_exceptions=True)
        yield o
    finally:
        await o.aclose()


@on_loop
async def test_a_drain_pauses_every_running_sandbox_and_the_next_start_resumes_them(
        store, rt, envd):
    async with _node(store, rt, envd) as o:
        running = [(await o.create(CreateRequest())).sandbox_id for _ in range(3)]
        by_user = (await o.create(CreateRequest())).sandbox_id
        await o.pause(by_user)
        report = await o.drain()
        assert sorted(report.paused) == sorted(running) and not report.failed
        for sid in running:
            rec = store.get_sandbox(sid)
            assert rec.state is S.PAUSED and drained(rec.runtime) and rec.ttl_left_s
        assert not drained(store.get_sandbox(by_user).runtime)
        assert all(flag for flag in rt.memory_flags[-3:])  # paused with their memory
        with pytest.raises(CapacityExceeded) as refused:  # no start while it drains
            await o.create(CreateRequest())
        assert response_for(refused.value).status_code == 429
        assert any("draining" in why for why in o.health())
        samples = {(s.name, s.labels.get("state")): s.value
                   for m in o.service_metrics.registry.collect() for s in m.samples}
        assert samples[("aenv_drain_sandboxes", "paused")] == 3

    async with _node(store, rt, envd) as again:  # the next start, on the same store
        for sid in running:
            rec = store.get_sandbox(sid)
            assert rec.state is S.RUNNING and not drained(rec.runtime)
        assert store.get_sandbox(by_user).state is S.PAUSED  # its user paused it
        assert again.health() == []


@on_loop
async def test_a_drained_sandbox_whose_resume_failed_resumes_at_its_first_request(
        store, rt, envd):
    async with _node(store, rt, envd) as o:
        sid = (await o.create(CreateRequest(auto_resume=False))).sandbox_id
        assert (await o.drain()).paused == [sid]
    rt.fail["start"] = lambda s: s == sid  # the next start's resume of it fails
    async with _node(store, rt, envd) as again:
        rec = store.get_sandbox(sid)
        assert rec.state is S.PAUSED and drained(rec.runtime)
        del rt.fail["start"]
        route = await again.route(sid, 49983, resume=True)  # the proxy's first request
        assert route.host and store.get_sandbox(sid).state is S.RUNNING
