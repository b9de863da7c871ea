"""Admission control over the fake runtime (host/orchestrator/admission.py, issue 14
item 14): VM starts bounded in number at once; a start beyond the node's sandbox limit or
its memory is refused with E2B's capacity error, leaving nothing half-made (a refused
create is killed, a refused resume stays paused); the API answers 429 with
`sandbox_capacity_unavailable` and Retry-After, which the SDK maps to RateLimitException."""

from __future__ import annotations

import asyncio

import pytest

from host.api.errors import response_for
from host.orchestrator import NodeOrchestrator
from host.orchestrator.admission import AdmissionPolicy
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import CapacityExceeded
from host.orchestrator.model import CreateRequest
from host.orchestrator.states import SandboxState as S

on_loop = pytest.mark.asyncio(loop_scope="function")


def make(store, rt, envd, policy: AdmissionPolicy, available_mib: int = 1 << 20):
    o = NodeOrchestrator(store, rt, domain="sbx.test", admission=policy,
                         envd=EnvdClient(transport=envd.transport()))
    o._ctx.admission._available_mib = lambda: available_mib  # the host's MemAvailable
    return o


@on_loop
async def test_sandbox_limit_refuses_then_admits_after_a_kill(store, rt, envd):
    o = make(store, rt, envd, AdmissionPolicy(max_sandboxes=2))
    await o.start(ttl_interval_s=3600)
    try:
        a = await o.create(CreateRequest())
        await o.create(CreateRequest())
        with pytest.raises(CapacityExceeded, match="maximum of 2 sandboxes") as err:
            await o.create(CreateRequest())
        resp = response_for(err.value)
        assert resp.status_code == 429 and resp.headers["Retry-After"] == "5"
        assert b'"error_code":"sandbox_capacity_unavailable"' in resp.body
        # the refused create left no sandbox behind, and started no VM
        states = [r.state for r in store.list_sandboxes()]
        assert states.count(S.RUNNING) == 2 and states.count(S.KILLED) == 1
        assert len(rt.vms) == 2
        await o.kill(a.sandbox_id)
        await o.create(CreateRequest())
    finally:
        await o.aclose()


@on_loop
async def test_a_create_right_after_a_pause_answer_waits_for_its_commit(store, rt, envd):
    """A pause is answered before it is committed, while its VM still counts: a create
    that would be refused for it waits for the commit instead."""
    o = make(store, rt, envd, AdmissionPolicy(max_sandboxes=1))
    await o.start(ttl_interval_s=3600)
    try:
        rt.answer_on_stop = True
        a = await o.create(CreateRequest())
        gate = rt.gates["snapshot"] = asyncio.Event()
        await asyncio.wait_for(o.pause(a.sandbox_id), 5)  # answered, not committed
        b = asyncio.create_task(o.create(CreateRequest()))
        await asyncio.sleep(0.05)
        assert not b.done()  # neither refused nor started: waits for the commit
        gate.set()
        created = await asyncio.wait_for(b, 5)
        assert store.get_sandbox(created.sandbox_id).state is S.RUNNING
        assert store.get_sandbox(a.sandbox_id).state is S.PAUSED
        with pytest.raises(CapacityExceeded):  # nothing pending: refused at once
            await o.create(CreateRequest())
    finally:
        await o.aclose()


@on_loop
async def test_a_refused_resume_stays_paused(store, rt, envd):
    o = make(store, rt, envd, AdmissionPolicy(max_sandboxes=1))
    await o.start(ttl_interval_s=3600)
    try:
        a = await o.create(CreateRequest())
        await o.pause(a.sandbox_id)
        b = await o.create(CreateRequest())
        with pytest.raises(CapacityExceeded):
            await o.connect(a.sandbox_id, 60)
        assert store.get_sandbox(a.sandbox_id).state is S.PAUSED
        await o.kill(b.sandbox_id)
        await o.connect(a.sandbox_id, 60)
        assert store.get_sandbox(a.sandbox_id).state is S.RUNNING
    finally:
        await o.aclose()


@on_loop
async def test_low_host_memory_refuses(store, rt, envd):
    o = make(store, rt, envd, AdmissionPolicy(reserve_mib=1024), available_mib=1000)
    await o.start(ttl_interval_s=3600)
    try:
        with pytest.raises(CapacityExceeded, match="out of memory.*1000 MiB available"):
            await o.create(CreateRequest())
        assert rt.vms == {}
        o._ctx.admission._available_mib = lambda: 8192
        await o.create(CreateRequest())
    finally:
        await o.aclose()


@on_loop
async def test_starts_at_once_are_bounded(store, rt, envd):
    o = make(store, rt, envd, AdmissionPolicy(max_starts=2))
    await o.start(ttl_interval_s=3600)
    try:
        await o.create(CreateRequest())            # the template is built first
        gate = rt.gates["start"] = asyncio.Event()
        creates = [asyncio.create_task(o.create(CreateRequest())) for _ in range(6)]
        # wait (no wall-clock bound) until two starts hold the slots, then give the other
        # four every chance to pass: they must still be waiting
        while o._ctx.admission.in_flight < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert o._ctx.admission.in_flight == 2     # the others wait for a slot
        gate.set()
        infos = await asyncio.gather(*creates)
        assert len({i.sandbox_id for i in infos}) == 6
        assert o._ctx.admission.peak_in_flight == 2
    finally:
        await o.aclose()
