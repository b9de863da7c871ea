"""Filesystem-only pause (`snapshot(memory=False)`): the disk alone is kept; resuming
cold-boots it (files kept, processes and RAM not); a cold-booted sandbox then takes full
snapshots (a new memory base frozen from its RAM) that restore with processes; and a full
pause can be resumed as a reboot (`start(reboot=True)`)."""

from __future__ import annotations

import pytest

from host.contract import SnapshotRef
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime
from host.runtime.errors import NodeRuntimeError

from .helpers import assert_gone, background, read, run, write

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

NET = NetworkConfig()


async def _running(p, cmd: str) -> bool:  # type: ignore[no-untyped-def]
    """A process with exactly this command line runs (by command line, not pid: after a
    reboot an old pid may belong to another process)."""
    out = await run(p, "for d in /proc/[0-9]*; do tr '\\0' ' ' < $d/cmdline; echo; done "
                       "2>/dev/null || true")
    return f"{cmd} " in out.splitlines()


async def test_filesystem_only_pause_then_full_snapshots(runtime: NodeRuntime,
                                                         template: SnapshotRef) -> None:
    sid = "fsp1"
    p = await runtime.start(sid, template, NET)
    try:
        with pytest.raises(NodeRuntimeError, match="stop=True"):
            await runtime.snapshot(sid, "fsp1-bad", stop=False, memory=False)
        await background(p, "sleep 100000")
        await write(p, "/home/user/kept.txt", "on disk")
        await run(p, "echo inram > /dev/shm/ram; sync")  # the orchestrator syncs via envd
        ref = await runtime.snapshot(sid, "fsp1-disk", stop=True, memory=False)
        assert ref.facts["memory"] is None and ref.facts["kind"] == "disk"
        assert not (runtime.config.memory_dir / "fsp1-disk").exists()
        await assert_gone(runtime, sid)
        assert await runtime.find_snapshot("fsp1-disk") is not None

        p = await runtime.start(sid, ref, NET)  # a cold boot of the sealed disk
        print(f"\nfilesystem-only resume (cold boot): {p.facts['timings']}")
        assert "cold_boot_s" in p.facts["timings"] and p.facts["scratch"]
        assert await read(p, "/home/user/kept.txt") == "on disk"
        assert not await _running(p, "sleep 100000")
        assert (await run(p, "cat /dev/shm/ram 2>/dev/null || echo gone")).strip() == "gone"

        # full snapshots of a cold-booted sandbox: a base frozen from its RAM, twice
        await background(p, "sleep 100001")
        first = await runtime.snapshot(sid, "fsp1-full1", stop=False)
        assert first.facts["memory"]["snapshot_dir"] is None  # a base, not a diff
        await write(p, "/home/user/second.txt", "after first")
        full = await runtime.snapshot(sid, "fsp1-full2", stop=True)
        p = await runtime.start(sid, full, NET)  # a memory restore again
        assert "restore_s" in p.facts["timings"]
        assert await _running(p, "sleep 100001")
        assert await read(p, "/home/user/second.txt") == "after first"

        # a full pause resumed as a reboot: files yes, processes no
        await background(p, "sleep 100002")
        await run(p, "sync")
        full3 = await runtime.snapshot(sid, "fsp1-full3", stop=True)
        p = await runtime.start(sid, full3, NET, reboot=True)
        assert "cold_boot_s" in p.facts["timings"]
        assert await read(p, "/home/user/kept.txt") == "on disk"
        assert not await _running(p, "sleep 100002")
    finally:
        await runtime.kill(sid)
        for snap in ("fsp1-disk", "fsp1-full1", "fsp1-full2", "fsp1-full3"):
            await runtime.delete_snapshot(snap)
    await assert_gone(runtime, sid)
    assert not [d for d in runtime.config.memory_dir.iterdir() if d.name.startswith("fsp1-")]
