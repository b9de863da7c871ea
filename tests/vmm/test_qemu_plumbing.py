"""The QEMU driver's process/QMP/snapshot plumbing on a VM without a guest kernel.

Real QEMU, no kernel or image needed (firmware only), so these run wherever QEMU is
installed and take about a second each.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from host.vmm import (
    BootTimeouts,
    FileDisk,
    MemoryBacking,
    NbdDisk,
    QemuDriver,
    TapNet,
    UserNet,
    VmmBootTimeout,
    VmmStartError,
    VmmStateError,
    VmSpec,
    VmState,
)

from .helpers import procs_mentioning

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="qemu-system-x86_64 not installed")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def _bare(**kw: object) -> VmSpec:
    return VmSpec(kernel=None, mem_mib=64, name="bare", **kw)  # type: ignore[arg-type]


def _assert_clean(run_dir: Path) -> None:
    assert procs_mentioning(str(run_dir)) == []
    assert not run_dir.exists() or list(run_dir.iterdir()) == []


async def test_start_pause_resume_kill(run_dir: Path) -> None:
    driver = QemuDriver(run_dir=run_dir)
    vm = await driver.start(_bare())
    try:
        assert vm.state is VmState.RUNNING and driver.vms == [vm]
        assert vm.qmp_ready_s is not None and vm.qmp_ready_s < 10
        pid, work = vm.pid, vm.work_dir
        assert pid is not None and (work / "qmp.sock").exists()
        assert os.getpgid(pid) == pid  # own session: the group is killable as one
        # no huge pages: QEMU's TCG code buffer would keep 2 MiB per page it touched
        assert "THP_enabled:\t0" in Path(f"/proc/{pid}/status").read_text()
        host, port = vm.envd_address
        assert host == "127.0.0.1" and port > 0
        assert f"hostfwd=tcp:127.0.0.1:{port}-:49983" in " ".join(vm.argv)
        await vm.pause()
        await vm.pause()  # idempotent
        assert await vm.query_status() == "paused"
        await vm.resume()
        assert await vm.query_status() == "running"
    finally:
        await vm.kill()
    assert vm.state.value == "killed" and vm.pid is None
    assert not Path(f"/proc/{pid}").exists() and not work.exists()
    assert driver.vms == []
    with pytest.raises(VmmStateError):
        await vm.pause()
    _assert_clean(run_dir)


async def test_envd_wait_times_out_with_tails(run_dir: Path) -> None:
    driver = QemuDriver(run_dir=run_dir)
    async with await driver.start(_bare()) as vm:
        t0 = time.monotonic()
        with pytest.raises(VmmBootTimeout, match="did not answer") as err:
            await vm.wait_for_envd(1.5)
        assert 1.4 < time.monotonic() - t0 < 5
        assert "within 1.5s" in str(err.value)
    _assert_clean(run_dir)


async def test_qemu_dying_is_noticed_while_waiting(run_dir: Path) -> None:
    driver = QemuDriver(run_dir=run_dir)
    vm = await driver.start(_bare())
    try:
        assert vm.pid is not None
        os.kill(vm.pid, signal.SIGKILL)
        with pytest.raises(VmmStartError, match="exited with code -9"):
            await vm.wait_for_envd(30)
    finally:
        await vm.kill()
    _assert_clean(run_dir)


async def test_port_in_use_is_retried_with_a_new_port(run_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Occupy the port QEMU would get: a fixed port fails clearly; a picked one is retried."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        driver = QemuDriver(run_dir=run_dir)
        with pytest.raises(VmmStartError, match=f"port {taken} is in use"):
            await driver.start(_bare(network=UserNet(host_port=taken)))
        _assert_clean(run_dir)
        from host.vmm import proc as procs

        picks = iter([taken])
        real = procs.free_port
        monkeypatch.setattr(procs, "free_port", lambda host="127.0.0.1": next(picks, 0)
                            or real(host))
        vm = await driver.start(_bare())
        async with vm:
            assert vm.envd_address[1] != taken
    _assert_clean(run_dir)


@pytest.mark.parametrize("memory", ["ram", "shared-file"])
async def test_save_state_and_restore(run_dir: Path, tmp_path: Path, memory: str) -> None:
    backing = (MemoryBacking(path=tmp_path / "guest.mem", shared=True)
               if memory == "shared-file" else None)
    spec = _bare(memory=backing)
    driver = QemuDriver(run_dir=run_dir)
    state = tmp_path / "vm.state"
    async with await driver.start(spec) as vm:
        await vm.save_state(state)
        assert vm.state is VmState.PAUSED and await vm.query_status() == "postmigrate"
    assert state.is_file() and not Path(f"{state}.part").exists()
    assert state.stat().st_size < 2 * 1024 * 1024  # zero pages cost nothing either way
    vm2 = await driver.restore(spec, state)
    async with vm2:
        assert vm2.state is VmState.RUNNING
        assert await vm2.query_status() == "running"
        assert "-incoming" in vm2.argv
    vm3 = await driver.restore(spec, state, resume=False)
    async with vm3:
        assert vm3.state is VmState.PAUSED
        await vm3.resume()
    _assert_clean(run_dir)


async def test_restore_of_garbage_fails_cleanly(run_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "garbage.state"
    state.write_bytes(os.urandom(4096))
    driver = QemuDriver(run_dir=run_dir)
    with pytest.raises(VmmStartError) as err:
        await driver.restore(_bare(), state)
    assert "exited" in str(err.value)
    assert driver.vms == []
    _assert_clean(run_dir)


async def test_driver_aclose_kills_everything(run_dir: Path) -> None:
    driver = QemuDriver(run_dir=run_dir)
    vms = await asyncio.gather(*(driver.start(_bare()) for _ in range(3)))
    assert len({vm.envd_address[1] for vm in vms}) == 3
    await driver.aclose()
    assert all(vm.state is VmState.KILLED for vm in vms) and driver.vms == []
    _assert_clean(run_dir)


async def test_start_cancelled_while_running_kills(run_dir: Path) -> None:
    driver = QemuDriver(run_dir=run_dir)
    vm = await driver.start(_bare(), timeouts=BootTimeouts(kill_s=1))
    task = asyncio.ensure_future(vm.kill())
    task.cancel()  # the kill is shielded: it completes anyway
    with pytest.raises(asyncio.CancelledError):
        await task
    await vm.kill()
    assert vm.state is VmState.KILLED
    _assert_clean(run_dir)


async def test_shared_snapshot_restores_copy_on_write(run_dir: Path, tmp_path: Path) -> None:
    """Saved with share=on (device state only); restored twice with share=off over the
    same frozen memory file: the file is not modified by the children."""
    import dataclasses

    mem = tmp_path / "guest.mem"
    spec = _bare(memory=MemoryBacking(path=mem, shared=True))
    driver = QemuDriver(run_dir=run_dir)
    state = tmp_path / "vm.state"
    async with await driver.start(spec) as vm:
        await vm.save_state(state)
    before = mem.stat().st_mtime_ns
    child = dataclasses.replace(spec, memory=MemoryBacking(path=mem, shared=False))
    a, b = await driver.restore(child, state), await driver.restore(child, state)
    async with a, b:
        assert a.state is VmState.RUNNING and b.state is VmState.RUNNING
        assert f"mem-path={mem},share=off" in " ".join(a.argv)
    assert mem.stat().st_mtime_ns == before
    _assert_clean(run_dir)



@pytest.fixture
def nbd_export(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(read-only image, NBD unix socket of a writable export "upper") via qemu-nbd."""
    if shutil.which("qemu-nbd") is None:
        pytest.skip("qemu-nbd not installed")
    ro, rw = tmp_path / "ro.img", tmp_path / "rw.img"
    for p in (ro, rw):
        with open(p, "wb") as f:
            f.truncate(16 * 1024 * 1024)
    sock = tmp_path / "nbd.sock"
    nbd = subprocess.Popen(["qemu-nbd", "--persistent", "--shared=4", "-f", "raw",
                            f"--socket={sock}", "--export-name=upper", str(rw)],
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        yield ro, sock
    finally:
        nbd.terminate()
        nbd.wait(10)


async def test_disks_file_and_nbd_attach_with_flags(run_dir: Path,
                                                   nbd_export: tuple[Path, Path]) -> None:
    """The drive options are accepted by real QEMU: a read-only file disk and a
    writable NBD export over a unix socket."""
    ro, sock = nbd_export
    spec = _bare(disks=(FileDisk(path=ro, read_only=True, serial="base"),
                        NbdDisk(socket=sock, export="upper")), network=None)
    async with await QemuDriver(run_dir=run_dir).start(spec) as vm:
        blocks = {b["device"]: b for b in await vm.qmp("query-block")}
        assert blocks["disk0"]["inserted"]["ro"] is True
        assert blocks["disk1"]["inserted"]["ro"] is False
        assert "nbd" in blocks["disk1"]["inserted"]["file"]
        with pytest.raises(VmmStateError):
            _ = vm.envd_address  # no network
    _assert_clean(run_dir)


@pytest.fixture
def netns_with_tap() -> Iterator[str]:
    """A fresh network namespace holding a TAP device `tap0`; deleted afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    ns = f"aenv-vmmtest-{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        subprocess.run(["ip", "-n", ns, "tuntap", "add", "tap0", "mode", "tap"], check=True,
                       capture_output=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        pytest.skip(f"cannot create a netns with a tap here: {exc}")
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


async def test_tap_in_network_namespace(run_dir: Path, netns_with_tap: str) -> None:
    """TapNet: QEMU runs inside the namespace (`ip netns exec`) on a TAP made there;
    the pid is QEMU's own and killing it leaves nothing."""
    ns = netns_with_tap
    spec = _bare(network=TapNet(tap="tap0", guest_ip="10.200.0.2", netns=ns))
    async with await QemuDriver(run_dir=run_dir).start(spec) as vm:
        assert vm.argv[:4] == ["ip", "netns", "exec", ns]
        assert vm.pid is not None
        assert Path(f"/proc/{vm.pid}/exe").resolve().name.startswith("qemu-system")
        assert os.readlink(f"/proc/{vm.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert vm.envd_url == "http://10.200.0.2:49983"
    _assert_clean(run_dir)
