"""Warm VMs on a real service (`--warm-pool 1`, issue 13 item 3): after a create from
the template, the service restores one more VM and holds it stopped; the next create
continues that VM under its sandbox id instead of restoring one. The sandbox it becomes
is a full sandbox (its own disk, envd token, env vars, network), the held VM is no
sandbox (not listed), and nothing is left once the sandboxes are killed and the
service stops. Its own service (the session one keeps no warm VMs), started with
`--ksm` too: its VMs' memory is marked for ksmd, which it starts and stops again."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import E2EService, private_service, use_sdk

pytestmark = [pytest.mark.vm, pytest.mark.slow]

KSM_RUN = Path("/sys/kernel/mm/ksm/run")
HELD = re.compile(r"sandbox (\w+) restored \(held\) from")  # one line per held VM


@pytest.fixture(scope="module")
def warm() -> Iterator[E2EService]:
    ksm_run = KSM_RUN.read_text() if KSM_RUN.exists() else None
    with private_service("aewarm", prefix="aewarm-", pool="10.216.112.0/20",
                         extra=["--warm-pool", "1", "--ksm"]) as s:
        yield s
    if ksm_run is not None:  # the service put ksmd back as it found it
        assert KSM_RUN.read_text() == ksm_run


def held_ids(s: E2EService) -> list[str]:
    return HELD.findall(s.log(200_000))


def wait_held(s: E2EService, n: int) -> list[str]:
    """Until the service has restored `n` held VMs in all (polling its log)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ids = held_ids(s)
        if len(ids) >= n:
            return ids
        time.sleep(0.2)
    raise AssertionError(f"no {n}th held VM: {s.log()}")


def test_ksm_may_merge_vm_memory(warm: E2EService) -> None:
    if not KSM_RUN.exists():
        pytest.skip("this kernel has no KSM (/sys/kernel/mm/ksm)")
    assert KSM_RUN.read_text().strip() == "1"  # ksmd runs
    (held,) = wait_held(warm, 1)[:1]
    pid = next(p for p, cmd in warm.qemu_pids().items() if f"/vms/{held}/" in cmd)
    stat = Path(f"/proc/{pid}/ksm_stat")
    if stat.exists():  # Linux 6.x: the whole process (heap, libraries' pages) may merge
        assert "ksm_merge_any: yes" in stat.read_text()
    # and its guest RAM, which QEMU marks itself (merge=on): VmFlags "mg"
    ram = Path(f"/proc/{pid}/smaps").read_text().split("base.mem")[1].split("VmFlags:")[1]
    assert " mg" in ram.splitlines()[0]


def test_a_create_continues_the_held_vm(warm: E2EService,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    use_sdk(warm, monkeypatch)
    # the template build's own first create made the pool restore one VM
    (held,) = wait_held(warm, 1)
    assert held in warm.vm_sandbox_ids()  # a real, stopped QEMU
    assert list(Sandbox.list().next_items()) == []  # no sandbox: nothing listed
    first = Sandbox.create(timeout=120, envs={"WHO": "first"})
    try:
        assert first.sandbox_id == held  # the held VM, under its id
        assert f"sandbox {held} continued from" in warm.log(200_000)
        held = wait_held(warm, 2)[1]  # restored behind the first create
        assert {s.sandbox_id for s in Sandbox.list().next_items()} == {first.sandbox_id}

        second = Sandbox.create(timeout=120, envs={"WHO": "second"}, secure=True)
        assert second.sandbox_id == held
        # a sandbox like any other: its env, its own disk, an envd token of its own
        assert second.commands.run("echo $WHO").stdout == "second\n"
        second.files.write("/home/user/mine.txt", "second's")
        assert second.files.read("/home/user/mine.txt") == "second's"
        assert not first.files.exists("/home/user/mine.txt")
        assert first.commands.run("echo $WHO").stdout == "first\n"
        listed = {s.sandbox_id for s in Sandbox.list().next_items()}
        assert listed == {first.sandbox_id, second.sandbox_id}
        # its pause and resume work as for a restored sandbox
        second.pause()
        again = Sandbox.connect(second.sandbox_id, timeout=120)
        assert again.files.read("/home/user/mine.txt") == "second's"

        ids = wait_held(warm, 3)  # the pool refilled behind the second create
        assert ids[2] not in (first.sandbox_id, second.sandbox_id)
        again.kill()
    finally:
        first.kill()
    # only the refilled warm VM is left, and the service's stop releases it
    assert warm.vm_sandbox_ids() == {held_ids(warm)[-1]}
    warm.stop()
    assert warm.qemu_pids() == {}
    assert not any(n.startswith("aewarm-") for n in warm.netns())
