"""Warm VMs (host/orchestrator/warm.py): a create from a template continues a VM restored
and held before it came, under that VM's sandbox id; the pool refills behind it, serves
only the template creates came from last and the default network policy, and lets go of
its VMs under memory pressure and at shutdown. The fake runtime stands in for VMs (the
real thing: tests/e2e/test_warm_pool.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from host.contract import NetworkConfig
from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import SandboxNotFound
from host.orchestrator.model import CreateRequest, ListFilter
from host.orchestrator.pressure import PressureGuard, PressurePolicy
from host.orchestrator.states import SandboxState as S

on_loop = pytest.mark.asyncio(loop_scope="function")


def make(store, rt, envd, size: int = 1) -> NodeOrchestrator:
    return NodeOrchestrator(store, rt, domain="sbx.test", warm_pool=size,
                            envd=EnvdClient(transport=envd.transport()))


@contextlib.asynccontextmanager
async def one_warm(store, rt, envd) -> AsyncIterator[tuple[NodeOrchestrator, str, str]]:
    """A started orchestrator with `--warm-pool 1` after its first create: (it, the first
    sandbox's id, the warm VM's id restored behind it); closed afterwards."""
    o = make(store, rt, envd)
    await o.start(ttl_interval_s=3600)
    try:
        first = await o.create(CreateRequest())
        await settled(o)
        (warm,) = o.warm.ready
        yield o, first.sandbox_id, warm
    finally:
        await o.aclose()


async def settled(o: NodeOrchestrator) -> None:
    """Until the pool's refill task is done (it is owned by the orchestrator)."""
    for _ in range(1000):
        fill = o.warm._fill
        if fill is None or fill.done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the warm pool never settled")


@on_loop
async def test_a_create_continues_a_warm_vm_and_the_pool_refills(store, rt, envd) -> None:
    o = make(store, rt, envd, size=2)
    await o.start(ttl_interval_s=3600)
    try:
        first = await o.create(CreateRequest())
        assert first.sandbox_id not in rt.warm  # nothing was warm yet: a plain restore
        await settled(o)
        warm = list(o.warm.ready)
        assert len(warm) == 2 and set(warm) == rt.warm
        # warm VMs are no sandboxes: not in the store, not listed
        for w in warm:
            with pytest.raises(SandboxNotFound):
                await o.get(w)
        assert {s.sandbox_id for s in await o.list(ListFilter())} == {first.sandbox_id}

        second = await o.create(CreateRequest(metadata={"n": "2"}))
        assert second.sandbox_id == warm[0]  # the oldest warm VM, under its own id
        assert store.get_sandbox(second.sandbox_id).state is S.RUNNING
        assert envd.inits[-1][0] == rt.vms[second.sandbox_id].envd_host  # envd got /init
        await settled(o)
        assert len(o.warm.ready) == 2 and warm[1] in o.warm.ready  # refilled behind it
        assert second.sandbox_id not in o.warm.ready
    finally:
        await o.aclose()
    assert rt.warm == set()  # shutdown released every warm VM
    assert set(rt.vms) == {first.sandbox_id, second.sandbox_id}


@on_loop
async def test_only_default_network_creates_take_a_warm_vm(store, rt, envd) -> None:
    async with one_warm(store, rt, envd) as (o, _, warm):
        closed = await o.create(CreateRequest(network=NetworkConfig(allow_internet_access=False)))
        assert closed.sandbox_id != warm and o.warm.ready == [warm]
        taken = await o.create(CreateRequest())
        assert taken.sandbox_id == warm


@on_loop
async def test_a_refused_create_does_not_leave_its_warm_vm(store, rt, envd) -> None:
    async with one_warm(store, rt, envd) as (o, _, warm):
        rt.fail["start"] = lambda sid: sid == warm
        with pytest.raises(Exception, match="injected"):
            await o.create(CreateRequest())
        rt.fail.clear()
        assert warm not in rt.vms and warm not in rt.warm
        assert store.get_sandbox(warm).state is S.KILLED


@on_loop
async def test_memory_pressure_releases_warm_vms_before_pausing(store, rt, envd) -> None:
    async with one_warm(store, rt, envd) as (o, running, warm):
        available = {"mib": 900}

        async def released() -> int:  # a warm VM gives its memory back
            n = await type(o).release_spare(o)
            available["mib"] += 700 * n
            return n

        o.release_spare = released  # type: ignore[method-assign]
        guard = PressureGuard(o, PressurePolicy(low_mib=1000, high_mib=1500),
                              available_mib=lambda: available["mib"])
        assert await guard.tick() == []  # the warm VM went; no sandbox had to be paused
        assert warm not in rt.vms and o.warm.ready == []
        assert store.get_sandbox(running).state is S.RUNNING
