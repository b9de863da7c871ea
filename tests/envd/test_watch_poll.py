"""A watcher poll returns the event of every change made before it (issue 31 item 5).

E2B's suite writes a file and polls at once: with envd's loop busy, the poll used to run
before the loop had read the kernel's inotify queue, and the WRITE was missing. These run
the watcher in-process, so "the loop has not read the queue yet" is exact, not a race."""

from __future__ import annotations

import asyncio
import getpass
from pathlib import Path

import pytest

from envd.services.filesystem.pollwatch import PollingWatcher
from envd.services.filesystem.watch import DirWatch
from envd.spec.filesystem.filesystem_pb import EventType
from envd.users import User

pytestmark = pytest.mark.asyncio


async def _watcher(root: Path) -> PollingWatcher:
    watch = await DirWatch.open(str(root), recursive=True, include_entry=True,
                                user=User.lookup(getpass.getuser()),
                                allow_network_mounts=False)
    return PollingWatcher(watch)


def _kinds(events: list) -> list[tuple[str, int]]:
    return [(e.name, e.type) for e in events]


async def test_a_poll_right_after_a_write_has_its_events(tmp_path: Path) -> None:
    watcher = await _watcher(tmp_path)
    try:
        # written with no await between the write and the poll: the loop never ran the
        # inotify reader, so only the poll's own read of the kernel queue can see it
        (tmp_path / "a.txt").write_text("x")
        events = await watcher.drain()
        assert ("a.txt", EventType.CREATE) in _kinds(events)
        assert ("a.txt", EventType.WRITE) in _kinds(events)
        assert events[0].entry.name == "a.txt"  # include_entry still stats it
        assert await watcher.drain() == []  # nothing twice
    finally:
        await watcher.aclose()


async def test_polls_under_load_keep_every_event_in_order(tmp_path: Path) -> None:
    watcher = await _watcher(tmp_path)

    async def busy() -> None:  # other requests keeping the loop busy
        while True:
            await asyncio.sleep(0)

    hog = asyncio.create_task(busy())
    try:
        seen: list[tuple[str, int]] = []
        for i in range(200):
            path = tmp_path / f"f{i}"
            path.write_text(str(i))
            if i % 3 == 0:
                await asyncio.sleep(0)  # sometimes the pump gets there first
            events = _kinds(await watcher.drain())
            assert (f"f{i}", EventType.WRITE) in events, (i, events)
            seen += events
        writes = [name for name, kind in seen if kind == EventType.WRITE]
        assert writes == [f"f{i}" for i in range(200)]  # each once, in order
    finally:
        hog.cancel()
        await watcher.aclose()

