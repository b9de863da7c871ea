"""Unit tests of the per-process output multiplexer (no processes, no server)."""

from __future__ import annotations

import asyncio

import pytest

from envd.services.process.fanout import Fanout, SubscriberDropped


async def collect(sub):
    return [item async for item in sub]


async def test_every_subscriber_gets_items_then_end():
    fan: Fanout[str, str] = Fanout()
    a, b = fan.subscribe(), fan.subscribe()
    for item in ("x", "y"):
        await fan.publish(item)
    fan.close("END")
    assert await collect(a) == ["x", "y", "END"]
    assert await collect(b) == ["x", "y", "END"]
    assert fan.subscriber_count == 0
    late = fan.subscribe()
    assert await collect(late) == ["END"]


async def test_no_subscribers_never_blocks():
    fan: Fanout[int, None] = Fanout(queue_items=1)
    for i in range(1000):
        await asyncio.wait_for(fan.publish(i), 1)


async def test_full_queue_applies_backpressure_then_drops():
    fan: Fanout[int, str] = Fanout(queue_items=2, stall_timeout_s=0.3)
    slow = fan.subscribe()
    await fan.publish(1)
    await fan.publish(2)
    publishing = asyncio.ensure_future(fan.publish(3))
    await asyncio.sleep(0.1)
    assert not publishing.done()  # waits for the reader...
    assert await slow.get() == 1  # ...and continues once there is room
    await asyncio.wait_for(publishing, 1)
    # A reader that never reads again is cut off after the stall timeout.
    await asyncio.wait_for(fan.publish(4), 2)
    assert fan.subscriber_count == 0
    with pytest.raises(SubscriberDropped):
        await collect(slow)


async def test_closed_subscriber_releases_publisher():
    fan: Fanout[int, str] = Fanout(queue_items=1, stall_timeout_s=30)
    sub = fan.subscribe()
    await fan.publish(1)
    blocked = asyncio.ensure_future(fan.publish(2))
    await asyncio.sleep(0.05)
    sub.close()  # the client went away
    await asyncio.wait_for(blocked, 1)
    assert fan.subscriber_count == 0


async def test_get_is_cancel_safe():
    fan: Fanout[int, str] = Fanout()
    sub = fan.subscribe()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(sub.get(), 0.05)
    await fan.publish(7)
    assert await sub.get() == 7
