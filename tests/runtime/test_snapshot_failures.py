"""A VM that dies in the middle of a pause (real QEMU, SIGKILLed once the guest is
stopped): the snapshot fails, but the sandbox keeps its disk stack, so a disk-only
snapshot right after keeps everything the guest had synced, and a boot from it reads it
(before: the failure released the stack, and the writes since the last snapshot were
lost with a "running" record and no VM)."""

from __future__ import annotations

import os
import signal

import pytest

from host.contract import SnapshotRef
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime

from .helpers import read, run, write

NET = NetworkConfig()


async def test_a_vm_killed_during_a_pause_keeps_its_disk(
        runtime: NodeRuntime, template: SnapshotRef) -> None:
    sid = "snapdie"
    p = await runtime.start(sid, template, NET)
    try:
        await write(p, "/home/user/work.txt", "written before the crash")
        await run(p, "sync")
        pid = runtime.vm_pid(sid)
        assert pid is not None

        def die() -> None:  # the guest is stopped: now its VMM goes
            os.kill(pid, signal.SIGKILL)

        with pytest.raises(Exception):  # noqa: B017 - whatever the memory capture raises
            await runtime.snapshot(sid, "snapdie-mem", stop=True, stopped=die)
        assert await runtime.find_snapshot("snapdie-mem") is None
        assert sid in runtime.exited()  # registered, VM gone: the watchdog's to settle
        disk = await runtime.snapshot(sid, "snapdie-disk", stop=True, memory=False)
        assert disk.facts["memory"] is None
        q = await runtime.start(sid, disk, NET)  # a disk-only snapshot boots
        assert await read(q, "/home/user/work.txt") == "written before the crash"
    finally:
        await runtime.kill(sid)
        for snap in ("snapdie-mem", "snapdie-disk"):
            await runtime.delete_snapshot(snap)
