"""Kept VMs on a real service (`--keep-paused 5`, issue 13 item 3): a pause keeps its VM
stopped once the snapshot is committed; a resume within the window continues that very
QEMU process (no restore: what the guest had translated and cached is still there), and
after the window the VM is gone and a resume restores the snapshot. Either way the
sandbox has everything it had: a process started before the pause, a file in its memory
(tmpfs) and on its disk. A kill of a paused sandbox takes its kept VM along; /metrics
counts kept VMs (`aenv_spare_vms{kind="kept"}`). Its own
service: the session one keeps no VM after a pause."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.metrics.scrape import scrape_sync

from .conftest import E2EService, private_service, use_sdk

pytestmark = [pytest.mark.vm, pytest.mark.slow]

KEEP_S = 5.0


@pytest.fixture(scope="module")
def kept() -> Iterator[E2EService]:
    with private_service("aekept", prefix="aekept-", pool="10.216.128.0/20",
                         extra=["--keep-paused", str(KEEP_S)]) as s:
        yield s


def vm_pid(s: E2EService, sandbox_id: str) -> int | None:
    return next((p for p, cmd in s.qemu_pids().items() if f"/vms/{sandbox_id}/" in cmd),
                None)


def pause_committed(s: E2EService, sbx) -> None:  # type: ignore[no-untyped-def]
    sbx.pause()
    deadline = time.monotonic() + 300
    while s.db_states().get(sbx.sandbox_id) != "paused":
        assert time.monotonic() < deadline, s.log()
        time.sleep(0.01)


def same_sandbox(sbx, pid: str) -> None:  # type: ignore[no-untyped-def]
    """What the sandbox had before its pause: the process, tmpfs and disk files."""
    assert sbx.commands.run(f"kill -0 {pid} && cat /proc/{pid}/cmdline | tr '\\0' ' '"
                            ).stdout.strip() == "sleep 3600"
    assert sbx.files.read("/tmp/in-memory") == "tmpfs"
    assert sbx.files.read("/home/user/on-disk") == "disk"


def test_a_resume_continues_the_kept_vm_then_restores_once_it_went(
        kept: E2EService, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    use_sdk(kept, monkeypatch)
    sbx = Sandbox.create(timeout=300)
    sid = sbx.sandbox_id
    try:
        pid = sbx.commands.run("sleep 3600", background=True).pid
        sbx.files.write("/tmp/in-memory", "tmpfs")
        sbx.files.write("/home/user/on-disk", "disk")
        qemu = vm_pid(kept, sid)
        assert qemu is not None

        pause_committed(kept, sbx)
        assert vm_pid(kept, sid) == qemu  # committed, and the VM is still there
        t0 = time.perf_counter()
        again = Sandbox.connect(sid, timeout=300)
        again.commands.run("true")
        continued_s = time.perf_counter() - t0
        assert vm_pid(kept, sid) == qemu  # continued, not restored
        assert f"sandbox {sid} continued from" in kept.log(200_000)
        same_sandbox(again, str(pid))
        again.files.write("/home/user/after", "written after the first resume")

        pause_committed(kept, again)
        deadline = time.monotonic() + KEEP_S + 120
        while vm_pid(kept, sid) is not None:  # the window ends: the VM goes
            assert time.monotonic() < deadline, kept.log()
            time.sleep(0.1)
        assert kept.db_states()[sid] == "paused"
        t0 = time.perf_counter()
        third = Sandbox.connect(sid, timeout=300)
        third.commands.run("true")
        restored_s = time.perf_counter() - t0
        assert vm_pid(kept, sid) not in (None, qemu)  # a new VM from the snapshot
        same_sandbox(third, str(pid))
        assert third.files.read("/home/user/after") == "written after the first resume"
        print(f"\nresume + first command: kept VM {continued_s * 1e3:.0f} ms, "
              f"restored {restored_s * 1e3:.0f} ms")
    finally:
        Sandbox.kill(sid)
    assert vm_pid(kept, sid) is None


def test_a_kill_of_a_paused_sandbox_releases_its_kept_vm(
        kept: E2EService, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    use_sdk(kept, monkeypatch)
    namespaces = kept.netns()
    sbx = Sandbox.create(timeout=300)
    pause_committed(kept, sbx)
    assert len(kept.netns()) == len(namespaces) + 1  # kept with its VM
    assert vm_pid(kept, sbx.sandbox_id) is not None
    assert scrape_sync(kept.api_url).value("aenv_spare_vms", kind="kept") == 1
    assert Sandbox.kill(sbx.sandbox_id)
    assert vm_pid(kept, sbx.sandbox_id) is None
    assert scrape_sync(kept.api_url).value("aenv_spare_vms", kind="kept") == 0
    assert kept.db_states()[sbx.sandbox_id] == "killed"
    assert kept.netns() == namespaces  # its network went with it


def test_a_crash_leaves_no_kept_vm_and_loses_no_pause(
        kept: E2EService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service dies (SIGKILL) while a paused sandbox's VM is kept: the restarted
    service's recovery reaps that VM (its sandbox is paused: none is expected), and the
    sandbox resumes from its snapshot with its memory and disk."""
    from e2b import Sandbox

    use_sdk(kept, monkeypatch)
    sbx = Sandbox.create(timeout=300)
    sid = sbx.sandbox_id
    pid = sbx.commands.run("sleep 3600", background=True).pid
    sbx.files.write("/tmp/in-memory", "tmpfs")
    sbx.files.write("/home/user/on-disk", "disk")
    pause_committed(kept, sbx)
    qemu = vm_pid(kept, sid)
    assert qemu is not None
    kept.sigkill()
    assert vm_pid(kept, sid) == qemu  # VMs outlive the service (running ones are adopted)
    kept.start()
    try:
        assert vm_pid(kept, sid) is None  # reaped by recovery
        assert kept.db_states()[sid] == "paused"
        again = Sandbox.connect(sid, timeout=300)
        same_sandbox(again, str(pid))
    finally:
        Sandbox.kill(sid)
