"""Full snapshots through the QEMU driver: save a booted VM, kill it, restore it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from host.vmm import BootTimeouts, MemoryBacking, QemuDriver, VmState
from host.vmm.image import GuestImage

from .conftest import private_root
from .helpers import procs_mentioning

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


def _sdk(url: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from e2b import Sandbox

    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", url)
    return Sandbox.create()


@pytest.mark.parametrize("memory_file", [True, False], ids=["shared-memory-file", "ram"])
async def test_save_kill_restore(guest_image: GuestImage, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch, memory_file: bool) -> None:
    run_dir = tmp_path / "run"
    memory = MemoryBacking(path=tmp_path / "guest.mem", shared=True) if memory_file else None
    spec = guest_image.vm_spec(root=private_root(guest_image, tmp_path), name="test-snap",
                               mem_mib=512, memory=memory)
    driver = QemuDriver(run_dir=run_dir)
    state = tmp_path / "vm.state"
    try:
        vm = await driver.boot(spec, timeouts=BootTimeouts(envd_ready_s=240))
        # /dev/shm is a tmpfs in the guest: the marker lives only in guest RAM
        _sdk(vm.envd_url, monkeypatch).files.write("/dev/shm/marker", "before snapshot")
        await vm.save_state(state)
        assert vm.state is VmState.PAUSED
        size = state.stat().st_size
        if memory_file:
            assert size < 2 * 1024 * 1024  # device state only: RAM is the memory file
        await vm.kill()

        t0 = time.monotonic()
        vm2 = await driver.restore(spec, state)
        assert vm2.state is VmState.RUNNING
        waited = await vm2.wait_for_envd(30)
        print(f"\nstate {size} B; restore -> envd healthy {time.monotonic() - t0:.2f} s "
              f"(health wait {waited:.2f} s)")
        sbx = _sdk(vm2.envd_url, monkeypatch)
        assert sbx.files.read("/dev/shm/marker") == "before snapshot"
        assert sbx.commands.run("echo alive", timeout=60).stdout.strip() == "alive"
        await vm2.kill()
    finally:
        await driver.aclose()
    assert procs_mentioning(str(run_dir)) == []
    assert list(run_dir.iterdir()) == []
