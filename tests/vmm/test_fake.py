"""The fake driver follows the interface and the state rules, and injects failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from host.vmm import Vm, VmmDriver, VmmStartError, VmmStateError, VmSpec, VmState
from host.vmm.fake import FakeDriver, FakeVm


def test_fake_implements_protocols() -> None:
    assert isinstance(FakeDriver(), VmmDriver)
    members = {n for n in dir(Vm) if not n.startswith("_")}
    assert [n for n in members if not hasattr(FakeVm, n)] == []


async def test_lifecycle_and_calls(tmp_path: Path) -> None:
    d = FakeDriver(envd_url="http://127.0.0.1:5555")
    vm = await d.boot(VmSpec(kernel=Path("/k"), name="a"))
    assert vm.envd_address == ("127.0.0.1", 5555) and vm.state is VmState.RUNNING
    await vm.pause()
    await vm.save_state(tmp_path / "s")
    await vm.kill()
    with pytest.raises(VmmStateError):
        await vm.resume()
    vm2 = await d.restore(VmSpec(kernel=Path("/k"), name="a"), tmp_path / "s", resume=False)
    assert vm2.state is VmState.PAUSED
    await d.aclose()
    assert d.calls == [("start", "a"), ("wait_for_envd", "a"), ("pause", "a"),
                       ("save_state", "a"), ("kill", "a"), ("restore", "a"), ("kill", "a")]
    assert d.vms == []


async def test_injected_failures() -> None:
    d = FakeDriver(fail={"start": VmmStartError("boom")})
    with pytest.raises(VmmStartError, match="boom"):
        await d.start(VmSpec(kernel=Path("/k")))
    assert d.vms == []
    d = FakeDriver()
    d.fail_once["wait_for_envd"] = TimeoutError()
    with pytest.raises(TimeoutError):
        await d.boot(VmSpec(kernel=Path("/k"), name="b"))
    assert d.vms == [] and d.calls[-1] == ("kill", "b")
    assert (await d.boot(VmSpec(kernel=Path("/k")))).state is VmState.RUNNING
