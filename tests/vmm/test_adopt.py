"""Detaching from a running VM and adopting it again, also from another process (the
host service restarting), on kernel-less QEMU VMs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from host.vmm import QemuDriver, VmmStateError, VmSpec, VmState
from host.vmm.fake import FakeDriver

from .helpers import procs_mentioning

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="qemu-system-x86_64 not installed")
REPO = Path(__file__).resolve().parents[2]


def _bare(name: str = "adopt") -> VmSpec:
    return VmSpec(kernel=None, mem_mib=64, name=name)


async def test_detach_then_adopt_in_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = QemuDriver(run_dir=run_dir)
    vm = await first.start(_bare())
    await vm.pause()
    facts = json.loads(json.dumps(vm.facts()))  # must survive a store round-trip
    pid = vm.pid
    await vm.detach()
    assert vm.state is VmState.DETACHED and first.vms == []
    await vm.kill()  # no-op on a detached handle
    assert pid is not None and Path(f"/proc/{pid}").exists()
    with pytest.raises(VmmStateError):
        await vm.resume()

    second = QemuDriver(run_dir=run_dir)
    again = await second.adopt(_bare(), facts)
    assert again is not None and again.pid == pid
    assert again.state is VmState.PAUSED and second.vms == [again]
    await again.resume()
    assert await again.query_status() == "running"
    assert again.envd_address == vm.envd_address
    await second.aclose()
    assert not Path(f"/proc/{pid}").exists()
    assert procs_mentioning(str(run_dir)) == [] and list(run_dir.iterdir()) == []


async def test_adopting_a_dead_vm_returns_none_and_cleans_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    driver = QemuDriver(run_dir=run_dir)
    vm = await driver.start(_bare())
    facts = vm.facts()
    await vm.detach()
    os.kill(facts["pid"], signal.SIGKILL)
    for _ in range(500):
        if not procs_mentioning(str(run_dir)):
            break
        await asyncio.sleep(0.01)
    assert await QemuDriver(run_dir=run_dir).adopt(_bare(), facts) is None
    assert list(run_dir.iterdir()) == []


async def test_adopt_rejects_a_reused_pid(tmp_path: Path) -> None:
    facts = {"driver": "qemu", "pid": os.getpid(), "pid_start": 1, "work_dir":
             str(tmp_path / "w"), "owns_work_dir": True, "host_port": 1, "argv": []}
    (tmp_path / "w").mkdir()
    assert await QemuDriver().adopt(_bare(), facts) is None
    assert not (tmp_path / "w").exists()


@pytest.fixture
def vm_from_another_process(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Facts of a VM started by a separate Python process that has since exited
    (die_with_parent=False): the situation after a host-service restart."""
    script = textwrap.dedent(f"""
        import asyncio, json, sys
        from pathlib import Path
        from host.vmm import QemuDriver, VmSpec
        async def main():
            d = QemuDriver(run_dir=Path({str(tmp_path / "run")!r}), die_with_parent=False)
            vm = await d.start(VmSpec(kernel=None, mem_mib=64, name="orphan"))
            print(json.dumps(vm.facts()))
            await vm.detach()
        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    facts: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    try:
        yield facts
    finally:
        if procs_mentioning(str(tmp_path / "run")):
            os.killpg(facts["pid"], signal.SIGKILL)


async def test_adopt_a_vm_started_by_another_process(vm_from_another_process: dict[str, Any],
                                                     tmp_path: Path) -> None:
    facts = vm_from_another_process
    run_dir = tmp_path / "run"
    assert procs_mentioning(str(run_dir)) != []  # the starter exited; QEMU lives on
    driver = QemuDriver(run_dir=run_dir)
    vm = await driver.adopt(VmSpec(kernel=None, mem_mib=64, name="orphan"), facts)
    assert vm is not None and vm.state is VmState.RUNNING and vm.pid == facts["pid"]
    await vm.pause()
    await vm.kill()  # not our child: killed and waited for by polling /proc
    assert procs_mentioning(str(run_dir)) == []
    assert list(run_dir.iterdir()) == []


async def test_fake_detach_and_adopt() -> None:
    d = FakeDriver()
    vm = await d.start(VmSpec(kernel=None, name="f"))
    facts = vm.facts()
    await vm.detach()
    again = await d.adopt(VmSpec(kernel=None, name="f"), facts)
    assert again is not None and again.state is VmState.RUNNING
    assert await d.adopt(VmSpec(kernel=None, name="f"), facts) is None
