"""A SIGKILLed host service leaves its VMs and the block server running; a new runtime
instance adopts the VM from the persisted facts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from host.contract import SnapshotRef
from host.runtime import NodeRuntime
from host.vmm.procscan import pid_alive

from .helpers import assert_gone, run, write

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

ROOT = Path(__file__).resolve().parents[2]


async def test_vm_survives_service_sigkill_and_is_adopted(runtime: NodeRuntime,
                                                          template: SnapshotRef) -> None:
    sid = "svc1"
    cfg = runtime.config
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.runtime.service_proc", str(cfg.state_dir), str(cfg.run_dir),
        runtime.mode if runtime.mode == "user" else "netns", sid, template.snapshot_id,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, start_new_session=True)
    facts = None
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        facts = json.loads(line)["facts"]
        os.killpg(proc.pid, signal.SIGKILL)   # the "host service" dies hard
        await proc.wait()
        assert pid_alive(int(facts["pid"]))   # its VM does not
        assert await runtime.block.ping()     # nor does the block server
        placed = await runtime.adopt(sid, facts)
        assert placed is not None
        await write(placed, "/home/user/x.txt", "after restart")
        assert (await run(placed, "cat /home/user/x.txt")).strip() == "after restart"
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        await runtime.kill(sid)
    await assert_gone(runtime, sid)
    if facts is not None:
        assert not pid_alive(int(facts["pid"]))
