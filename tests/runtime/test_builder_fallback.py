"""A builder only saves a build time (host/runtime/builder.py): whatever goes wrong in making
or using one, the build goes on by cold-booting its VM, and says why in its log. No VM
here: the failures are the ones real VMs are not needed to cause (test_builder.py has the
restore and switch that fail inside one)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from host.contract import BuildSpec, MachineSpec
from host.network.errors import AddressPoolExhaustedError
from host.runtime.builder import BuilderUse
from host.runtime.builderstore import Builder, Builders
from host.vmm.driver import MemoryBacking, VmSpec

pytestmark = pytest.mark.asyncio

M = {"machine": {"memory_mb": 256}, "cmdline": "init=/aenv-init", "kernel": "/k/vmlinux"}


class NoRestore:
    """A VMM that must not be reached."""

    async def restore(self, *_a: Any, **_k: Any) -> Any:
        raise AssertionError("a VM was restored from a builder whose memory was gone")


def _use(tmp_path: Path) -> tuple[BuilderUse, list[tuple[str, str]]]:
    said: list[tuple[str, str]] = []
    p = SimpleNamespace(builders=Builders(tmp_path / "builders"),
                        machines=SimpleNamespace(vmm=NoRestore()))
    use = BuilderUse(p, BuildSpec(snapshot_id="tpl-x", machine=MachineSpec(memory_mb=256)),  # type: ignore[arg-type]
                     "bld-x", lambda level, msg, step: said.append((level, msg)))
    use.m, use.size, use.key = dict(M), 1 << 30, "k1"
    return use, said


async def test_a_builder_that_could_not_be_made_for_any_reason_means_a_cold_boot(
        tmp_path: Path) -> None:
    # an error of a kind the build VM's own start would not meet (the address pool
    # exhausted by the builder's network while it was made): before, it failed the build
    use, said = _use(tmp_path)

    async def failing() -> Builder:
        raise AddressPoolExhaustedError("no free /30 block")

    use.task = asyncio.create_task(failing())
    assert await use.take(dict(M), 1 << 30) is None
    assert said == [("warn", "no builder (no free /30 block): cold-booting the build VM")]
    assert use.task is None

    use.task = asyncio.create_task(_raises(RuntimeError()))  # no message: its type
    assert await use.take(dict(M), 1 << 30) is None
    assert "no builder (RuntimeError)" in said[-1][1]


async def _raises(exc: BaseException) -> Builder:
    raise exc


async def test_a_builder_dropped_by_another_build_meanwhile_means_a_cold_boot(
        tmp_path: Path) -> None:
    # another build's switch failed and dropped the builder this build had taken: its
    # memory file is gone before this build copies it
    use, said = _use(tmp_path)
    gone = Builder(tmp_path / "builders" / "k1")
    spec = VmSpec(kernel=None, memory=MemoryBacking(path=tmp_path / "build" / "ram", shared=True))
    got = await use.restore(gone, spec, shell=None, grow=False,  # type: ignore[arg-type]
                            on_output=None)
    assert got is None
    assert said[-1][0] == "warn"
    assert said[-1][1].startswith("the builder failed (copying the builder's memory: ")
    assert said[-1][1].endswith("dropped, cold-booting")
    assert not (tmp_path / "build" / "ram").exists()  # no partial copy left


async def test_a_take_cancelled_with_its_build_is_not_swallowed(tmp_path: Path) -> None:
    # cancelling the build must still cancel it: only errors fall back to a cold boot
    use, _said = _use(tmp_path)
    use.task = asyncio.create_task(asyncio.sleep(3600))  # type: ignore[arg-type]
    taking = asyncio.create_task(use.take(dict(M), 1 << 30))
    await asyncio.sleep(0)
    taking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taking
