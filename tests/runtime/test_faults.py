"""Failures: the VMM SIGKILLed in the middle of a pause, a corrupted snapshot file,
adoption after a (simulated) host-service restart, and reaping of orphans."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import pytest

import host.vmm.qemu.memory as node_mod  # where the QEMU driver calls memsnap
from host.contract import SnapshotRef
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime, NodeRuntimeError, SnapshotCorruptError
from host.vmm.jail.cgroup import Cgroup
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


async def test_a_vm_dead_while_unwatched_is_reaped_whole_and_its_id_starts_again(
        runtime: NodeRuntime, template: SnapshotRef, tmp_path: Any) -> None:
    """A VM that died while no service watched it (a container's VMs die with it) and left
    no pid to kill: reaping removes its cgroup, work dir and serial log (the log was kept
    and a later VM of that id, under another uid, could not reopen it: QEMU "Permission
    denied"). A start over a crash's leftover log of another uid clears it, following
    none of its links."""
    sid = "dead1"
    await runtime.start(sid, template, NET)
    work, logs = runtime.config.vms_dir / sid, runtime.config.vm_logs_dir / sid
    try:
        facts = await runtime.detach(sid)
        version, parent, name = json.loads((work / "jail.json").read_text())["cgroup"]
        cgroup = Cgroup(parent, name, version=int(version))
        assert any(d.exists() for d in cgroup.dirs().values())
        pid = int(facts["pid"])
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            await asyncio.sleep(0.05)
        (work / "pid").unlink()  # the service died before recording it
        assert (logs / "serial.log").exists()
        reaped = await runtime.reap_orphans(known=set(runtime.sandboxes))
        assert sid in reaped
        assert not work.exists() and not logs.exists()
        assert not any(d.exists() for d in cgroup.dirs().values())

        # a crash's leftover: a log of another uid, and a link a hostile VMM planted
        target = tmp_path / "hosts"
        target.write_text("keep me")
        logs.mkdir(parents=True, mode=0o700)
        (logs / "serial.log").write_text("an earlier VM\n")
        os.chown(logs / "serial.log", 65533, 65533)
        (logs / "serial.log.1").symlink_to(target)
        p = await runtime.start(sid, template, NET)
        assert (await run(p, "echo up")).strip() == "up"
        assert (logs / "serial.log").stat().st_uid != 65533
        assert "an earlier VM" not in (logs / "serial.log").read_text(errors="replace")
        assert target.read_text() == "keep me" and target.stat().st_uid == 0
    finally:
        await runtime.kill(sid)
    await assert_gone(runtime, sid)
