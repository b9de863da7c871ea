"""The stop-time drain (host/orchestrator/drain.py) over the fake runtime and a real SQLite
store: every running sandbox is paused with its memory and marked, starts are refused and
/health says why meanwhile; the next orchestrator on the same store resumes exactly those,
a sandbox its user paused stays paused, and one whose resume failed resumes at its first
request through the proxy even without autoResume. The VM-backed drain is in
tests/e2e/test_drain.py."""

from __future__ import annotations

import asyncio

import pytest

from host.api.errors import response_for
from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import CapacityExceeded
from host.orchestrator.model import CreateRequest
from host.orchestrator.records import drained
from host.orchestrator.states import SandboxState as S

on_loop = pytest.mark.asyncio(loop_scope="function")


def _node(store, rt, envd) -> NodeOrchestrator:  # type: ignore[no-untyped-def]
    return NodeOrchestrator(store, rt, domain="sbx.test",
                            envd=EnvdClient(transport=envd.transport()))


async def _settled(o: NodeOrchestrator) -> None:
    """Wait for the orchestrator's own tasks (the start's resume of drained sandboxes)."""
    while o._tasks:
        await asyncio.gather(*list(o._tasks), return_exceptions=True)


@on_loop
async def test_a_drain_pauses_every_running_sandbox_and_the_next_start_resumes_them(
        store, rt, envd):
    o = _node(store, rt, envd)
    await o.start(ttl_interval_s=3600)
    try:
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
    finally:
        await o.aclose()

    again = _node(store, rt, envd)  # the next start, on the same store
    await again.start(ttl_interval_s=3600)
    try:
        await _settled(again)
        for sid in running:
            rec = store.get_sandbox(sid)
            assert rec.state is S.RUNNING and not drained(rec.runtime)
        assert store.get_sandbox(by_user).state is S.PAUSED  # its user paused it
        assert again.health() == []
    finally:
        await again.aclose()


@on_loop
async def test_a_drained_sandbox_whose_resume_failed_resumes_at_its_first_request(
        store, rt, envd):
    o = _node(store, rt, envd)
    await o.start(ttl_interval_s=3600)
    try:
        sid = (await o.create(CreateRequest(auto_resume=False))).sandbox_id
        assert (await o.drain()).paused == [sid]
    finally:
        await o.aclose()
    rt.fail["start"] = lambda s: s == sid  # the next start's resume of it fails
    again = _node(store, rt, envd)
    await again.start(ttl_interval_s=3600)
    try:
        await _settled(again)
        rec = store.get_sandbox(sid)
        assert rec.state is S.PAUSED and drained(rec.runtime)
        del rt.fail["start"]
        route = await again.route(sid, 49983, resume=True)  # the proxy's first request
        assert route.host and store.get_sandbox(sid).state is S.RUNNING
    finally:
        await again.aclose()
