"""QEMU driver failure paths: errors are clear and nothing is left behind (no guest boots)."""

from __future__ import annotations

import asyncio
import shutil
import stat
import time
from pathlib import Path

import pytest

from host.vmm import (
    BootTimeouts,
    FileDisk,
    QemuDriver,
    UserNet,
    VmmError,
    VmmStartError,
    VmmStateError,
    VmmTimeout,
    VmSpec,
    VmState,
)

from .helpers import procs_mentioning

QEMU = shutil.which("qemu-system-x86_64")


def _script(tmp_path: Path, body: str) -> str:
    p = tmp_path / "fake-qemu"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture
def junk_kernel(tmp_path: Path) -> Path:
    k = tmp_path / "vmlinux"
    k.write_bytes(b"not a kernel" * 100)
    return k


def _assert_clean(run_dir: Path) -> None:
    assert list(run_dir.iterdir()) == []
    assert procs_mentioning(str(run_dir)) == []


async def test_missing_kernel_fails_fast(run_dir: Path, tmp_path: Path) -> None:
    driver = QemuDriver(run_dir=run_dir, accel="tcg")
    t0 = time.monotonic()
    with pytest.raises(VmmStartError, match="kernel not found"):
        await driver.start(VmSpec(kernel=tmp_path / "nope"))
    assert time.monotonic() - t0 < 2
    _assert_clean(run_dir)
    assert driver.vms == []


@pytest.mark.skipif(QEMU is None, reason="qemu-system-x86_64 not installed")
async def test_qemu_exiting_at_startup_is_reported_with_stderr(run_dir: Path,
                                                               junk_kernel: Path) -> None:
    driver = QemuDriver(run_dir=run_dir, accel="tcg")
    spec = VmSpec(kernel=junk_kernel, disks=(FileDisk(path=run_dir.parent / "missing.img"),))
    t0 = time.monotonic()
    with pytest.raises(VmmStartError) as err:
        await driver.start(spec)
    assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert "exited with code" in msg and "VMM stderr" in msg
    assert "missing.img" in msg or "kernel" in msg
    _assert_clean(run_dir)
    assert driver.vms == []


async def test_port_race_retries_then_gives_up(run_dir: Path, tmp_path: Path,
                                               junk_kernel: Path) -> None:
    calls = tmp_path / "calls"
    fake = _script(tmp_path, f"echo x >> {calls}\n"
                   "echo \"qemu: -netdev user: Could not set up host forwarding rule\" >&2\n"
                   "exit 1")
    driver = QemuDriver(qemu=fake, run_dir=run_dir, accel="tcg")
    with pytest.raises(VmmStartError, match="no free host port"):
        await driver.start(VmSpec(kernel=junk_kernel))
    assert len(calls.read_text().split()) == 5
    _assert_clean(run_dir)


async def test_fixed_port_in_use_fails_without_retry(run_dir: Path, tmp_path: Path,
                                                     junk_kernel: Path) -> None:
    calls = tmp_path / "calls"
    fake = _script(tmp_path, f"echo x >> {calls}\n"
                   "echo \"Could not set up host forwarding rule 'tcp:...'\" >&2; exit 1")
    driver = QemuDriver(qemu=fake, run_dir=run_dir, accel="tcg")
    with pytest.raises(VmmStartError, match="port 4999 is in use"):
        await driver.start(VmSpec(kernel=junk_kernel, network=UserNet(host_port=4999)))
    assert len(calls.read_text().split()) == 1
    _assert_clean(run_dir)


async def test_qmp_never_answering_times_out_and_kills(run_dir: Path, tmp_path: Path,
                                                      junk_kernel: Path) -> None:
    fake = _script(tmp_path, "trap '' TERM; exec sleep 60")  # ignores SIGTERM: needs SIGKILL
    driver = QemuDriver(qemu=fake, run_dir=run_dir, accel="tcg")
    t0 = time.monotonic()
    with pytest.raises(VmmTimeout, match="QMP did not answer"):
        await driver.start(VmSpec(kernel=junk_kernel),
                           timeouts=BootTimeouts(vmm_ready_s=0.5, kill_s=0.5))
    assert time.monotonic() - t0 < 5
    assert procs_mentioning(fake) == []
    _assert_clean(run_dir)


async def test_cancelled_start_leaves_nothing(run_dir: Path, tmp_path: Path,
                                             junk_kernel: Path) -> None:
    fake = _script(tmp_path, "exec sleep 60")
    driver = QemuDriver(qemu=fake, run_dir=run_dir, accel="tcg")
    task = asyncio.ensure_future(driver.start(VmSpec(kernel=junk_kernel)))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert procs_mentioning(fake) == []
    _assert_clean(run_dir)


async def test_explicit_work_dir_is_kept_when_asked(tmp_path: Path, junk_kernel: Path) -> None:
    fake = _script(tmp_path, "echo boom >&2; exit 3")
    work = tmp_path / "work"
    driver = QemuDriver(qemu=fake, accel="tcg")
    with pytest.raises(VmmStartError, match="code 3") as err:
        await driver.start(VmSpec(kernel=junk_kernel, work_dir=work, keep_work_dir=True))
    assert "boom" in err.value.stderr_tail
    assert (work / "qemu.stderr").read_text().strip() == "boom"
    assert not (work / "qmp.sock").exists()


async def test_state_errors_before_start(junk_kernel: Path) -> None:
    from host.vmm.qemu.driver import QemuVm

    vm = QemuVm(QemuDriver(accel="tcg"), VmSpec(kernel=junk_kernel), BootTimeouts())
    with pytest.raises(VmmStateError):
        await vm.pause()
    with pytest.raises(VmmError):
        _ = vm.envd_url
    await vm.kill()
    await vm.kill()
    assert vm.state is VmState.KILLED
