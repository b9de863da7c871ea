"""Fork: snapshot(stop=False) of a running parent, then 4 concurrent children from it.
Children see the parent's files and processes, their writes stay private, the parent's
death does not affect them, and they share guest RAM with each other (PSS)."""

from __future__ import annotations

import asyncio
import time

import pytest

from host.contract import SnapshotRef
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime

from .helpers import assert_gone, background, pss_kib, run, write

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

NET = NetworkConfig()
N = 4


async def test_fork_four_children(runtime: NodeRuntime, template: SnapshotRef) -> None:
    parent = "forkp"
    kids = [f"forkc{i}" for i in range(N)]
    snap = None
    p = await runtime.start(parent, template, NET)
    try:
        pid = await background(p, "sleep 100000")
        await write(p, "/home/user/from-parent.txt", "parent data")
        t0 = time.perf_counter()
        snap = await runtime.snapshot(parent, "fork-snap", stop=False)
        print(f"\nfork snapshot {time.perf_counter() - t0:.2f}s: {snap.facts['timings']}")
        # the parent keeps running after the snapshot
        assert (await run(p, f"kill -0 {pid} && echo ok")).strip() == "ok"

        t0 = time.perf_counter()
        places = await asyncio.gather(*(runtime.start(k, snap, NET) for k in kids))
        total = time.perf_counter() - t0
        print(f"{N} children in {total:.2f}s ({total / N:.2f}s per child)")
        for c in places:
            out = await run(c, f"kill -0 {pid} && echo alive; cat /home/user/from-parent.txt")
            assert out.split() == ["alive", "parent", "data"], out

        # memory sharing: the children map the same frozen base copy-on-write
        rss_pss = [pss_kib(runtime.vm_pid(k)) for k in kids]
        one_rss = max(r for r, _ in rss_pss)
        pss_sum = sum(p_ for _, p_ in rss_pss)
        print(f"children RSS/PSS KiB: {rss_pss}; PSS sum {pss_sum} vs 4x RSS {4 * one_rss}")
        assert pss_sum < 0.75 * N * one_rss

        # a write in one child is invisible to the parent and its siblings
        await write(places[0], "/home/user/only-in-c0.txt", "c0")
        check = "test -e /home/user/only-in-c0.txt && echo yes || echo no"
        assert (await run(places[0], check)).strip() == "yes"
        assert (await run(p, check)).strip() == "no"
        for c in places[1:]:
            assert (await run(c, check)).strip() == "no"

        # killing the parent does not affect the children
        await runtime.kill(parent)
        await assert_gone(runtime, parent)
        for c in places:
            assert (await run(c, "echo still-here")).strip() == "still-here"
    finally:
        for sid in (parent, *kids):
            await runtime.kill(sid)
        if snap is not None:
            await runtime.delete_snapshot(snap.snapshot_id)
    for sid in (parent, *kids):
        await assert_gone(runtime, sid)


async def test_children_of_a_fork_share_one_memory_image(runtime: NodeRuntime,
                                                         template: SnapshotRef) -> None:
    """A parent whose setup left 80 MiB in guest RAM (a tmpfs file: no reclaim drops it)
    forks 4 children at once (fanout 4): its base + diff are made once into one image
    (memory/<snapshot>/flat/) that every child maps copy-on-write, so no child holds a
    private copy of the parent's diff (each would hold >= 80 MiB with the chain written
    into it). The children see the parent's data and process; one paused and resumed
    comes back from a snapshot whose base is that image; all of it is collected after."""
    parts = runtime.parts
    parent = "sharep"
    kids = [f"sharec{i}" for i in range(N)]
    snaps: list[str] = []
    made = parts.forks.made
    p = await runtime.start(parent, template, NET)
    try:
        pid = await background(p, "sleep 100000")
        digest = (await run(p, "head -c 80M /dev/urandom > /dev/shm/blob && "
                               "sha256sum /dev/shm/blob")).split()[0]
        snap = await runtime.snapshot(parent, "share-snap", stop=False)
        snaps.append(snap.snapshot_id)
        places = await asyncio.gather(*(runtime.start(k, snap, NET, fanout=N) for k in kids))
        flat = parts.memory.dir / snap.snapshot_id / "flat"
        assert parts.forks.made == made + 1  # made once, by whichever child came first
        assert sum("flatten_s" in parts.sandboxes[k].timings for k in kids) == 1
        for k, c in zip(kids, places, strict=True):
            sb = parts.sandboxes[k]
            assert sb.base_dir == flat and sb.memsnap_dir is None
            private = await sb.vm.private_memory_mib()
            out = await run(c, f"kill -0 {pid} && echo alive; sha256sum /dev/shm/blob")
            assert out.split()[:2] == ["alive", digest], out
            print(f"{k}: private guest RAM {private} MiB")
            assert private is not None and private < 40, private

        # a child's pause names the shared image as its base; its resume maps it again
        paused = await runtime.snapshot(kids[0], "share-kid-pause", stop=True)
        snaps.append(paused.snapshot_id)
        m = await parts.manifests.get(paused.snapshot_id)
        assert m["memory"]["base_dir"] == f"{snap.snapshot_id}/flat"
        assert snap.snapshot_id in m["depends_on"]
        back = await runtime.start(kids[0], paused, NET)
        out = await run(back, f"kill -0 {pid} && echo alive; sha256sum /dev/shm/blob")
        assert out.split()[:2] == ["alive", digest], out
    finally:
        for sid in (parent, *kids):
            await runtime.kill(sid)
        for s in reversed(snaps):
            await runtime.delete_snapshot(s)
    for sid in (parent, *kids):
        await assert_gone(runtime, sid)
    assert not (parts.memory.dir / "share-snap").exists()  # the image went with its snapshot
