"""Boot the real guest image under QEMU and drive envd through the real e2b SDK.

One VM is shared by the module (cold boots are slow under TCG); the last test shuts it
down and checks that no QEMU process or work file is left.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from host.vmm import (
    BootTimeouts,
    QemuDriver,
    QemuVm,
    VmmBootTimeout,
    VmmStartError,
    VmSpec,
    VmState,
)
from host.vmm.image import GuestImage
from host.vmm.qemu.cmdline import QemuRunFiles, build_argv

from .conftest import private_root
from .helpers import procs_mentioning

pytestmark = pytest.mark.vm
# the module's VM (and its QMP connection) lives on the session event loop
session_loop = pytest.mark.asyncio(loop_scope="session")

BOOT_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vms")


@pytest.fixture(scope="module")
async def vm(guest_image: GuestImage, run_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[QemuVm]:
    """One booted VM with envd healthy; killed at module end in any case."""
    root = private_root(guest_image, tmp_path_factory.mktemp("disks"))
    driver = QemuDriver(run_dir=run_dir)
    spec = guest_image.vm_spec(root=root, name="test-boot", mem_mib=1024, vcpus=2)
    t0 = time.monotonic()
    booted = await driver.boot(spec, timeouts=BootTimeouts(envd_ready_s=BOOT_TIMEOUT_S))
    print(f"\ncold boot to envd healthy: {time.monotonic() - t0:.2f} s ({booted.accel})")
    try:
        yield booted
    finally:
        # keep the console for post-mortems (the VM's work dir goes away with it), unless
        # test_shutdown_leaves_nothing already killed the VM
        if booted.serial_log.exists():
            saved = tmp_path_factory.mktemp("results") / "test-boot.serial.log"
            shutil.copyfile(booted.serial_log, saved)
            print(f"\nserial console of the module VM: {saved}")
        await driver.aclose()


@pytest.fixture
def sandbox(vm: QemuVm, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """An e2b SDK Sandbox talking to the VM's envd (debug mode, direct URL)."""
    from e2b import Sandbox

    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", vm.envd_url)
    return Sandbox.create()


@session_loop
async def test_envd_health(vm: QemuVm) -> None:
    assert vm.state is VmState.RUNNING and vm.pid is not None
    async with httpx.AsyncClient(trust_env=False) as client:
        r = await client.get(f"{vm.envd_url}/health", timeout=10)
    assert r.status_code == 204
    assert vm.serial_log.stat().st_size > 0
    # its QMP client made no logger of its own: logging keeps every logger for the
    # process's life, so one per VM ever started grew the service without bound
    assert not [n for n in logging.Logger.manager.loggerDict if n.startswith("qemu.qmp.")
                and n.count(".") > 2]


def test_sdk_commands_run(sandbox, guest_image: GuestImage) -> None:  # type: ignore[no-untyped-def]
    res = sandbox.commands.run("uname -r && id user && cat /etc/os-release", timeout=120)
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    if guest_image.kernel.release:
        assert lines[0] == guest_image.kernel.release
    assert lines[1].startswith("uid=") and "(user)" in lines[1]
    assert "VERSION_CODENAME=bookworm" in res.stdout


def test_sdk_file_roundtrip(sandbox) -> None:  # type: ignore[no-untyped-def]
    content = "hello from the host\n" + "x" * 10_000
    sandbox.files.write("/home/user/roundtrip.txt", content)
    assert sandbox.files.read("/home/user/roundtrip.txt") == content
    res = sandbox.commands.run("wc -c < /home/user/roundtrip.txt", timeout=60)
    assert res.stdout.strip() == str(len(content))


@session_loop
async def test_pause_and_resume(vm: QemuVm) -> None:
    await vm.pause()
    assert vm.state is VmState.PAUSED and await vm.query_status() == "paused"
    async with httpx.AsyncClient(trust_env=False) as client:
        with pytest.raises(httpx.TimeoutException):
            await client.get(f"{vm.envd_url}/health", timeout=1.0)
    await vm.resume()
    assert await vm.query_status() == "running"
    assert await vm.wait_for_envd(30) < 30


@session_loop
async def test_shutdown_leaves_nothing(vm: QemuVm, run_dir: Path) -> None:
    pid, work = vm.pid, vm.work_dir
    assert pid is not None and work.is_dir()
    t0 = time.monotonic()
    await vm.kill()
    assert time.monotonic() - t0 < 10
    await vm.kill()  # idempotent
    assert vm.state is VmState.KILLED and vm.pid is None
    assert not Path(f"/proc/{pid}").exists()
    assert not work.exists()
    assert procs_mentioning(str(run_dir)) == []
    assert list(run_dir.iterdir()) == []


# -- guests whose envd never answers -------------------------------------------------


async def _boot_failing(image: GuestImage, tmp_path: Path, extra: str,
                        timeout_s: float) -> BaseException:
    run_dir = tmp_path / "run"
    driver = QemuDriver(run_dir=run_dir)
    spec = image.vm_spec(root=private_root(image, tmp_path), name="test-fail",
                         cmdline=extra)
    t0 = time.monotonic()
    with pytest.raises((VmmBootTimeout, VmmStartError)) as err:
        await driver.boot(spec, timeouts=BootTimeouts(envd_ready_s=timeout_s))
    assert time.monotonic() - t0 < timeout_s + 15
    assert driver.vms == []
    assert procs_mentioning(str(run_dir)) == []
    assert list(run_dir.iterdir()) == []
    return err.value


@session_loop
async def test_missing_init_fails_fast_with_serial_tail(guest_image: GuestImage,
                                                        tmp_path: Path) -> None:
    """No init: the guest panics, QEMU exits (panic=-1, -no-reboot), reported at once."""
    exc = await _boot_failing(guest_image, tmp_path, "init=/nonexistent", 60)
    assert isinstance(exc, VmmStartError)  # QEMU's exit, not the 60 s boot deadline
    assert "Kernel panic" in exc.serial_tail
    assert "guest serial log" in str(exc)


@session_loop
async def test_cold_boots_reach_the_kernel_every_time(guest_image: GuestImage,
                                                      tmp_path: Path) -> None:
    """With the legacy PIC and PIT (plain `-M microvm`), a PVH cold boot here triple-faulted
    at random before the kernel printed a line (10-13 runs in 16 under TCG): a PIT tick
    through the unprogrammed PIC came as vector 0. Each run boots the real kernel with no
    root disk, so every one must get as far as its panic (and QEMU then exits)."""
    driver = QemuDriver(run_dir=tmp_path / "run")
    accel, tsc_khz = await driver.accel()
    spec = VmSpec(kernel=guest_image.kernel.vmlinux, cmdline="quiet root=/dev/vda", mem_mib=128,
                  network=None)
    for run in range(16):
        files = QemuRunFiles.in_dir(tmp_path / f"boot{run}")
        files.serial_log.parent.mkdir()
        argv = build_argv(spec, files=files, accel=accel, tsc_khz=tsc_khz)
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 120)
        serial = files.serial_log.read_text(errors="replace")
        assert "Kernel panic" in serial, (run, proc.returncode, serial[-400:], err[-400:])


@session_loop
async def test_envd_never_answering_times_out_with_serial_tail(guest_image: GuestImage,
                                                               tmp_path: Path) -> None:
    """init is a sleep: the kernel boots but nothing listens; bounded by the boot timeout."""
    # loglevel=6 after the image's `quiet` so the kernel says which init it ran
    exc = await _boot_failing(guest_image, tmp_path, "loglevel=6 init=/bin/sleep 3600", 20)
    assert isinstance(exc, VmmBootTimeout)
    assert isinstance(exc, TimeoutError)
    assert "within 20s" in str(exc)
    assert "/bin/sleep" in exc.serial_tail


@session_loop
async def test_cancel_during_boot_leaves_nothing(guest_image: GuestImage,
                                                 tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    driver = QemuDriver(run_dir=run_dir)
    spec = guest_image.vm_spec(root=private_root(guest_image, tmp_path), name="test-cancel")
    task = asyncio.ensure_future(driver.boot(spec))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert procs_mentioning(str(run_dir)) == []
    assert list(run_dir.iterdir()) == []
