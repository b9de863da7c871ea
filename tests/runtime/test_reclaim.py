"""A memory snapshot's `reclaim` (issue 30): the guest drops its page cache and the cut waits
for it to come back, on the real runtime (host/runtime/snapshots.py) over fake VMs whose
private memory a test scripts. What a real guest gives back is checked by
tests/e2e/test_python_sdk.py's fork (its diff holds less than the file the parent wrote)."""

from __future__ import annotations

from pathlib import Path

import pytest

from host.contract import NetworkConfig
from host.runtime import starts
from host.runtime.parts import NodeParts
from host.runtime.snapshots import RECLAIM_MIN_PRIVATE_MIB, snapshot
from host.storage.errors import ControlError
from host.vmm.fake import FakeVm

from .fakenode import FakeBlockClient, GatedDriver, fake_node, publish_template, ref

pytestmark = pytest.mark.asyncio(loop_scope="function")
NET = NetworkConfig()


class Guest:
    """The `reclaim` callback: how often it was asked, and what it says it freed."""

    def __init__(self, freed: int) -> None:
        self.freed, self.asked = freed, 0

    async def __call__(self) -> int:
        self.asked += 1
        return self.freed


async def _running(tmp_path: Path, private: int | list[int] | None) -> tuple[NodeParts, FakeVm]:
    repo = f"posix_fs:{tmp_path / 'repo'}"
    t = await publish_template(tmp_path, repo, "tpl", mib=1)
    p = fake_node(tmp_path / "node", repo, GatedDriver())
    await starts.start(p, "sbx", ref(t), NET, reboot=False)
    vm = p.sandboxes["sbx"].vm
    assert isinstance(vm, FakeVm)
    vm.private_mib = private
    return p, vm


@pytest.mark.parametrize("stop", [False, True], ids=["fork", "pause"])
async def test_the_cut_waits_until_the_guest_gave_back_what_it_freed(tmp_path: Path,
                                                                     stop: bool) -> None:
    p, _ = await _running(tmp_path, [300, 300, 260, 180, 120, 100, 100])
    guest = Guest(200)
    got = await snapshot(p, "sbx", "s1", stop=stop, memory=True, reclaim=guest)
    t = got.facts["timings"]
    assert guest.asked == 1 and t["freed_mib"] == 200
    # 90 % of 200 back at 120 MiB: the wait ends there, before the cut
    assert t["returned_mib"] == 180
    driver = p.machines.driver
    assert isinstance(driver, GatedDriver)
    assert "private_memory_mib" in [op for op, _ in driver.calls]


async def test_a_guest_that_gives_back_less_is_cut_once_it_stops(tmp_path: Path) -> None:
    p, vm = await _running(tmp_path, [300, 280, 250, 250])
    got = await snapshot(p, "sbx", "s1", stop=False, memory=True, reclaim=Guest(200))
    assert got.facts["timings"]["returned_mib"] == 50  # then nothing more: not 2 s of waiting
    assert vm.alive()


async def test_a_guest_with_little_private_memory_is_not_asked(tmp_path: Path) -> None:
    p, _ = await _running(tmp_path, RECLAIM_MIN_PRIVATE_MIB - 1)
    guest = Guest(200)
    got = await snapshot(p, "sbx", "s1", stop=False, memory=True, reclaim=guest)
    assert guest.asked == 0 and "freed_mib" not in got.facts["timings"]


@pytest.mark.parametrize("freed", [0, 5], ids=["nothing", "too-little"])
async def test_nothing_worth_waiting_for_is_not_waited_for(tmp_path: Path, freed: int) -> None:
    p, _ = await _running(tmp_path, 300)
    guest = Guest(freed)
    got = await snapshot(p, "sbx", "s1", stop=False, memory=True, reclaim=guest)
    assert guest.asked == 1 and "returned_mib" not in got.facts["timings"]


async def test_a_vmm_that_cannot_tell_still_asks_the_guest(tmp_path: Path) -> None:
    """Firecracker's VMs cannot say what is private: the guest is asked, nothing awaited."""
    p, _ = await _running(tmp_path, None)
    guest = Guest(200)
    got = await snapshot(p, "sbx", "s1", stop=False, memory=True, reclaim=guest)
    assert guest.asked == 1 and "returned_mib" not in got.facts["timings"]


async def test_a_lying_guest_is_bounded_by_its_ram(tmp_path: Path) -> None:
    p, vm = await _running(tmp_path, [300, 0])
    got = await snapshot(p, "sbx", "s1", stop=False, memory=True, reclaim=Guest(10**9))
    assert got.facts["timings"]["freed_mib"] == vm.spec.mem_mib


@pytest.mark.parametrize("stop", [False, True], ids=["fork", "pause"])
async def test_every_snapshot_asks_the_block_server_to_prehash_first(
        tmp_path: Path, stop: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other preparation before the cut: the disk upper is hashed beside the guest
    (host/storage/appender.py), so the seal does not; a block server that cannot is no
    error (the seal hashes it)."""
    p, _ = await _running(tmp_path, None)
    client = p.block.client
    assert isinstance(client, FakeBlockClient)
    await snapshot(p, "sbx", "s1", stop=False, memory=True)
    assert client.prehashed == [p.sandboxes["sbx"].stack]

    async def refuse(name: str) -> None:
        raise ControlError("unknown op 'prehash'")  # a block server from before it

    monkeypatch.setattr(client, "prehash", refuse)
    sealed = client.sealed
    await snapshot(p, "sbx", "s2", stop=stop, memory=True)
    assert client.sealed == sealed + 1
