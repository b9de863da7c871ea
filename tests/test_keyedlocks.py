"""KeyedLocks: one task at a time per key, other keys free, and nothing kept for a key
nobody holds or waits for (a cancelled waiter included)."""

from __future__ import annotations

import asyncio

import pytest

from host.keyedlocks import KeyedLocks

pytestmark = pytest.mark.asyncio


async def test_one_holder_per_key_and_nothing_kept_after() -> None:
    locks = KeyedLocks()
    order: list[str] = []
    entered = asyncio.Event()
    release = asyncio.Event()

    async def first() -> None:
        async with locks.hold("tpl-a"):
            order.append("first in")
            entered.set()
            await release.wait()
            order.append("first out")

    async def second() -> None:
        async with locks.hold("tpl-a"):
            order.append("second in")

    async def other_key() -> None:
        async with locks.hold("tpl-b"):
            order.append("other key")

    t1 = asyncio.create_task(first())
    await entered.wait()
    t2 = asyncio.create_task(second())
    await asyncio.wait_for(other_key(), 5)   # another key is not held up
    await asyncio.sleep(0.01)
    assert order == ["first in", "other key"]
    assert locks.busy("tpl-a") and not locks.busy("tpl-b")
    release.set()
    await asyncio.gather(t1, t2)
    assert order == ["first in", "other key", "first out", "second in"]
    assert len(locks) == 0 and not locks.busy("tpl-a")


async def test_a_cancelled_waiter_and_a_failing_holder_leave_nothing() -> None:
    locks = KeyedLocks()
    held = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> None:
        async with locks.hold("k"):
            held.set()
            await release.wait()
            raise RuntimeError("the build failed")

    async def waiter() -> None:
        async with locks.hold("k"):
            raise AssertionError("a cancelled waiter never gets the lock")

    t1 = asyncio.create_task(holder())
    await held.wait()
    t2 = asyncio.create_task(waiter())
    await asyncio.sleep(0.01)
    t2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t2
    assert len(locks) == 1            # the holder still has it
    release.set()
    with pytest.raises(RuntimeError):
        await t1
    assert len(locks) == 0
    async with locks.hold("k"):       # and the key is usable again
        assert locks.busy("k")
    assert len(locks) == 0
