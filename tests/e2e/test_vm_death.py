"""A sandbox whose VM dies (SIGKILL of its QEMU: a crash, the OOM killer) keeps its disk
(issue 14 item 18): the watchdog pauses it on a filesystem-only snapshot of the disk as
the VM left it, and a connect() cold-boots it with everything the guest had synced. It
was killed before (never paused) or reverted to its last pause."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import E2EService, use_sdk

pytestmark = [pytest.mark.vm, pytest.mark.slow]


def test_vm_death_keeps_the_disk(service: E2EService, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    use_sdk(service, monkeypatch)
    sbx = Sandbox.create(timeout=300)
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/kept.txt", "written before the crash")
        assert sbx.commands.run("sync").exit_code == 0
        pids = [pid for pid, cmd in service.qemu_pids().items() if sid in cmd]
        assert len(pids) == 1, service.qemu_pids()
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 300           # a guard against a hang only
        while True:
            with service.client() as c:
                r = c.get(f"/sandboxes/{sid}")
            state = r.json().get("state") if r.status_code == 200 else f"gone ({r.status_code})"
            if state != "running" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert state == "paused"
        again = Sandbox.connect(sid, timeout=300)
        assert again.files.read("/home/user/kept.txt") == "written before the crash"
        assert again.commands.run("echo up").stdout == "up\n"
    finally:
        Sandbox.kill(sid)
