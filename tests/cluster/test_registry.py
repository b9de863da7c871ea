"""The cluster index over a real Redis: heartbeats (full, delta, refused delta after a
flush or a death), the sweep that declares nodes dead, reservations under a node's
limit, conditional bindings, and the key layout the scripts and `Keys` share."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis

from host.cluster.errors import StoreUnavailable
from host.cluster.heartbeat import Heartbeat, NodeReport
from host.cluster.registry import BindingState, NodeState, Registry
from host.cluster.store import ClusterStore, Keys

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest_asyncio.fixture(loop_scope="function")
async def registry(redis_url: str) -> AsyncIterator[Registry]:
    store = ClusterStore.from_url(redis_url, prefix="t:")
    yield Registry(store)
    await store.aclose()


def fields(**over: object) -> dict[str, object]:
    return {"address": "http://127.0.0.1:1", "proxyAddress": "http://127.0.0.1:2",
            "state": "ready", "cpuCount": 4, "memoryMiB": 8192, "availableMiB": 4096,
            "maxSandboxes": 0, "usedSandboxes": 0, **over}


async def test_heartbeat_full_then_delta(registry: Registry) -> None:
    ok = await registry.publish("n1", fields(), alive_ms=2000, full=True, token="a",
                                upserts={"s1": "running", "s2": "paused"})
    assert ok
    node = await registry.node("n1")
    assert node is not None and node.state is NodeState.READY and node.sandboxes == 2
    assert node.memory_mib == 8192 and node.last_heartbeat > 0
    assert (await registry.binding("s2")).state is BindingState.PAUSED  # type: ignore[union-attr]
    ok = await registry.publish("n1", fields(), alive_ms=2000, full=False, token="a",
                                upserts={"s3": "running", "s2": "running"}, removals=["s1"])
    assert ok
    assert await registry.binding("s1") is None
    assert set(await registry.node_sandboxes("n1")) == {"s2", "s3"}
    # a delta with another token (another process, or the index lost the full list)
    assert not await registry.publish("n1", fields(), alive_ms=2000, full=False, token="b",
                                      upserts={})


async def test_a_paused_copy_never_takes_a_sandbox_back(registry: Registry) -> None:
    """A sandbox taken over by n2 while n1 was dead: n1's paused copy is disowned (n1
    forgets it), in a full heartbeat as in a delta; a running claim still moves it."""
    await registry.bind("moved", "n2", BindingState.RUNNING)
    answer = await registry.publish("n1", fields(), alive_ms=2000, full=True, token="a",
                                    upserts={"moved": "paused", "mine": "paused"})
    assert answer and answer.disowned == ("moved",)
    assert (await registry.binding("moved")).node_id == "n2"  # type: ignore[union-attr]
    assert set(await registry.node_sandboxes("n1")) == {"mine"}
    answer = await registry.publish("n1", fields(), alive_ms=2000, full=False, token="a",
                                    upserts={"moved": "paused"})
    assert answer.disowned == ("moved",)
    answer = await registry.publish("n1", fields(), alive_ms=2000, full=False, token="a",
                                    upserts={"moved": "running"})
    assert answer and answer.disowned == ()
    assert (await registry.binding("moved")).node_id == "n1"  # type: ignore[union-attr]
    assert "moved" not in await registry.node_sandboxes("n2")


async def test_full_heartbeat_drops_what_the_node_no_longer_has(registry: Registry) -> None:
    await registry.publish("n1", fields(), alive_ms=2000, full=True, token="a",
                           upserts={"s1": "running", "s2": "running"})
    await registry.bind("s9", "n2", BindingState.RUNNING)   # another node's: left alone
    await registry.publish("n1", fields(), alive_ms=2000, full=True, token="a",
                           upserts={"s2": "running"})
    assert await registry.binding("s1") is None
    assert (await registry.binding("s9")).node_id == "n2"  # type: ignore[union-attr]


async def test_sweep_declares_dead_and_loses_running(registry: Registry) -> None:
    await registry.publish("n1", fields(), alive_ms=150, full=True, token="a",
                           upserts={"r": "running", "p": "paused"})
    await registry.publish("n2", fields(), alive_ms=5000, full=True, token="b", upserts={})
    assert await registry.sweep(retention_ms=60_000) == {}
    await asyncio.sleep(0.3)
    assert (await registry.node("n1")).state is NodeState.DEAD  # type: ignore[union-attr]
    assert await registry.sweep(retention_ms=60_000) == {"n1": 1}
    assert await registry.sweep(retention_ms=60_000) == {}           # once
    lost = await registry.binding("r")
    assert lost is not None and lost.state is BindingState.LOST and lost.lost_at
    assert (await registry.binding("p")).state is BindingState.PAUSED  # type: ignore[union-attr]
    node = await registry.node("n1")
    assert node is not None and node.dead_at and not node.alive
    # the dead node's next heartbeat (a delta) is refused: it sends all, and is back
    assert not await registry.publish("n1", fields(), alive_ms=2000, full=False, token="a",
                                      upserts={})
    await registry.publish("n1", fields(), alive_ms=2000, full=True, token="a",
                           upserts={"p": "paused"})
    node = await registry.node("n1")
    assert node is not None and node.state is NodeState.READY and node.dead_at is None
    assert await registry.binding("r") is None


async def test_reserve_respects_the_limit_and_liveness(registry: Registry) -> None:
    await registry.publish("n1", fields(maxSandboxes=2, usedSandboxes=1), alive_ms=2000,
                           full=True, token="a", upserts={})
    assert await registry.reserve("n1", "p1", ttl_ms=5000)
    assert not await registry.reserve("n1", "p2", ttl_ms=5000)      # 1 used + 1 placing
    assert (await registry.node("n1")).pending == 1  # type: ignore[union-attr]
    await registry.bind("sx", "n1", BindingState.RUNNING, placement_id="p1", used_delta=1)
    node = await registry.node("n1")
    assert node is not None and node.pending == 0 and node.used_sandboxes == 2
    assert not await registry.reserve("ghost", "p3", ttl_ms=5000)    # not alive
    await registry.publish("n1", fields(state="draining"), alive_ms=2000, full=True,
                           token="a", upserts={})
    assert not await registry.reserve("n1", "p4", ttl_ms=5000)       # draining


async def test_expired_reservation_stops_counting(registry: Registry) -> None:
    await registry.publish("n1", fields(maxSandboxes=1), alive_ms=2000, full=True, token="a",
                           upserts={})
    assert await registry.reserve("n1", "p1", ttl_ms=100)
    await asyncio.sleep(0.2)
    assert (await registry.node("n1")).pending == 0  # type: ignore[union-attr]
    assert await registry.reserve("n1", "p2", ttl_ms=100)


async def test_bindings_change_only_for_their_node(registry: Registry) -> None:
    await registry.bind("s", "n1", BindingState.RUNNING)
    assert not await registry.set_state("s", "n2", BindingState.PAUSED)
    await registry.unbind("s", "n2")
    assert (await registry.binding("s")).node_id == "n1"  # type: ignore[union-attr]
    await registry.bind("s", "n2", BindingState.RUNNING)           # moved
    assert "s" not in await registry.node_sandboxes("n1")
    assert await registry.set_state("s", "n2", BindingState.PAUSED)
    await registry.unbind("s", "n2")
    assert await registry.binding("s") is None


async def test_keys_match_the_scripts(registry: Registry, redis_url: str) -> None:
    await registry.publish("n1", fields(), alive_ms=2000, full=True, token="a",
                           upserts={"s1": "running"})
    await registry.reserve("n1", "p", ttl_ms=5000)
    k = Keys("t:")
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert set(r.keys("t:*")) == {k.nodes, k.node("n1"), k.alive("n1"),
                                      k.node_sandboxes("n1"), k.placing("n1"),
                                      k.sandbox("s1")}
    finally:
        r.close()


async def test_heartbeat_task_rebuilds_after_flush(registry: Registry, redis_url: str) -> None:
    sandboxes = {"a": "running"}

    async def report() -> NodeReport:
        return NodeReport(cpu_count=2, memory_mib=1024, available_mib=512,
                          sandboxes=dict(sandboxes))

    beat = Heartbeat(registry, node_id="n1", address="http://x:1", proxy_address="http://x:2",
                     report=report, interval_s=0.1, misses=3)
    await beat.beat()
    sandboxes["b"] = "paused"
    await beat.beat()
    assert set(await registry.node_sandboxes("n1")) == {"a", "b"}
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    r.close()
    await beat.beat()                     # refused delta -> full list at once
    assert set(await registry.node_sandboxes("n1")) == {"a", "b"}
    beat.start()
    await asyncio.sleep(0.25)
    await beat.aclose()
    assert beat.beats >= 4


async def test_unreachable_redis_is_store_unavailable() -> None:
    store = ClusterStore.from_url("redis://127.0.0.1:1/0", timeout_s=0.5)
    try:
        with pytest.raises(StoreUnavailable, match="cluster store"):
            await Registry(store).nodes()
    finally:
        await store.aclose()


async def test_heartbeat_survives_an_unreachable_redis() -> None:
    store = ClusterStore.from_url("redis://127.0.0.1:1/0", timeout_s=0.2)

    async def report() -> NodeReport:
        return NodeReport(cpu_count=1, memory_mib=1, available_mib=1)

    beat = Heartbeat(Registry(store), node_id="n", address="http://x:1",
                     proxy_address="http://x:2", report=report, interval_s=0.05)
    beat.start()
    await asyncio.sleep(0.3)
    await beat.aclose()   # still running (retrying), and stops when asked
    assert beat.beats == 0
    await store.aclose()


async def test_joined_once_and_now_never_raises(registry: Registry) -> None:
    """`joined` runs once, after the first heartbeat Redis took; `now()` sends one at
    once (draining first when asked) and, with Redis away, says so instead of raising:
    a stopping node must not wait on the cluster."""
    calls: list[str] = []

    async def report() -> NodeReport:
        return NodeReport(cpu_count=1, memory_mib=1, available_mib=1, sandboxes={"a": "paused"})

    beat = Heartbeat(registry, node_id="n1", address="http://x:1", proxy_address="http://x:2",
                     report=report, interval_s=10, joined=lambda: calls.append("joined"))
    assert await beat.now(draining=True)
    node = await registry.node("n1")
    assert node is not None and node.state is NodeState.DRAINING
    assert await beat.now() and beat.beats == 2 and calls == ["joined"]

    away = ClusterStore.from_url("redis://127.0.0.1:1/0", timeout_s=0.2)
    lost = Heartbeat(Registry(away), node_id="n", address="http://x:1",
                     proxy_address="http://x:2", report=report, interval_s=0.1,
                     joined=lambda: calls.append("never"))
    try:
        assert not await lost.now(draining=True)
        assert calls == ["joined"] and lost.beats == 0
    finally:
        await away.aclose()
