"""Failures: the VMM SIGKILLed in the middle of a pause, a corrupted snapshot file,
adoption after a (simulated) host-service restart, and reaping of orphans."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

import host.vmm.qemu.memory as node_mod  # where the QEMU driver calls memsnap
from host.contract import SnapshotRef
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime, NodeRuntimeError, SnapshotCorruptError
from host.vmm.procscan import pid_alive

from .helpers import assert_gone, background, run, write

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

NET = NetworkConfig()


async def test_vmm_killed_during_pause_keeps_previous_snapshot(
        runtime: NodeRuntime, template: SnapshotRef, monkeypatch: pytest.MonkeyPatch) -> None:
    sid = "fault1"
    ids: list[str] = []
    p = await runtime.start(sid, template, NET)
    try:
        pid = await background(p, "sleep 100000")
        await write(p, "/home/user/v.txt", "v1")
        good = await runtime.snapshot(sid, "fault1-good", stop=True)
        ids.append(good.snapshot_id)
        p = await runtime.start(sid, good, NET)
        await write(p, "/home/user/v.txt", "v2")

        real = node_mod.snapshot_incremental

        async def killed_midway(qmp: Any, vm_pid: int, *a: Any, **kw: Any) -> Any:
            os.kill(vm_pid, signal.SIGKILL)  # the VMM dies with its vCPUs stopped
            return await real(qmp, vm_pid, *a, **kw)

        monkeypatch.setattr(node_mod, "snapshot_incremental", killed_midway)
        with pytest.raises(Exception):  # noqa: B017 - any error: the point is what is left
            await runtime.snapshot(sid, "fault1-bad", stop=True)
        monkeypatch.setattr(node_mod, "snapshot_incremental", real)
        # the dead sandbox stays registered with its disk (a disk-only snapshot keeps it:
        # test_snapshot_failures.py); its caller decides, here a kill
        assert sid in runtime.exited()
        await runtime.kill(sid)
        await assert_gone(runtime, sid)
        assert not (runtime.config.memory_dir / "fault1-bad").exists()
        with pytest.raises(NodeRuntimeError):
            await runtime.manifests.get("fault1-bad")

        # the previous snapshot is intact and usable
        p = await runtime.start(sid, good, NET)
        out = await run(p, f"kill -0 {pid} && echo alive; cat /home/user/v.txt")
        assert out.split() == ["alive", "v1"]
    finally:
        await runtime.kill(sid)
        for s in ids:
            await runtime.delete_snapshot(s)
    await assert_gone(runtime, sid)


async def test_corrupted_snapshot_fails_restore_cleanly(runtime: NodeRuntime,
                                                        template: SnapshotRef) -> None:
    sid = "fault2"
    p = await runtime.start(sid, template, NET)
    snap = None
    try:
        await run(p, "head -c 4M /dev/urandom > /dev/shm/x")
        snap = await runtime.snapshot(sid, "fault2-snap", stop=True)
        diff = runtime.config.memory_dir / "fault2-snap" / "mem" / "mem.diff"
        size = diff.stat().st_size
        with open(diff, "r+b") as f:  # noqa: ASYNC230 - flip bytes in the page data
            f.seek(size // 2)
            chunk = f.read(64)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
        with pytest.raises(SnapshotCorruptError) as err:
            await runtime.start(sid, snap, NET)
        print(f"\nrestore refused: {err.value}")
        assert "fault2-snap" in str(err.value)
        await assert_gone(runtime, sid)
    finally:
        await runtime.kill(sid)
        if snap is not None:
            await runtime.delete_snapshot(snap.snapshot_id)
    await assert_gone(runtime, sid)


async def test_adopt_after_restart_and_reap(runtime: NodeRuntime, template: SnapshotRef) -> None:
    sid, orphan = "adopt1", "orphan1"
    p = await runtime.start(sid, template, NET)
    await runtime.start(orphan, template, NET)
    other = NodeRuntime(runtime.config)
    try:
        await write(p, "/home/user/a.txt", "adopted")
        facts = await runtime.detach(sid)  # the old service instance forgets it
        # a pid that is not that QEMU: refused (and its leftovers released)
        assert await other.open() is other
        bogus = dict(facts, pid=os.getpid(), vm=dict(facts["vm"], pid=os.getpid()))
        assert await other.adopt("ghost1", bogus) is None
        placed = await other.adopt(sid, facts)
        assert placed is not None and placed.envd_host == p.envd_host
        assert (await run(placed, "cat /home/user/a.txt")).strip() == "adopted"
        ref = await other.snapshot(sid, "adopt1-snap", stop=False)
        assert ref.parent_id == template.snapshot_id
        await other.delete_snapshot("adopt1-snap")
        await other.kill(sid)
        await assert_gone(other, sid)
        # orphan: known to nobody -> reaped (VM, stack, namespace)
        detached = await runtime.detach(orphan)
        assert detached["pid"]
        # as if the service died before recording the pid: found by its QMP socket path
        (runtime.config.vms_dir / orphan / "pid").unlink()
        reaped = await other.reap_orphans(known=set(runtime.sandboxes))
        assert orphan in reaped
        await assert_gone(other, orphan)
        assert not pid_alive(int(detached["pid"]))
    finally:
        await other.kill(sid)
        await other.kill(orphan)
        await other.aclose()
        await runtime.kill(sid)
        await runtime.kill(orphan)
