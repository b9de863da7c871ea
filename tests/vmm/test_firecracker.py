"""FirecrackerDriver against a FAKE Firecracker (tests/vmm/fake_firecracker.py).

Firecracker cannot run on the development host (no binary; KVM there is PVM-only), so
none of these tests boots a guest. The driver's real process management runs against a
fake `firecracker` executable whose API server validates every request against
Firecracker's own published OpenAPI document (v1.16.1, kept verbatim in
tests/vmm/data/) and simulates its documented state rules. What the tests show: the
exact requests the driver sends, in order, their bodies, error mapping, and
process/file cleanup. What they cannot show: that a real Firecracker boots our kernel and
image with them, or that its snapshots restore.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from host.vmm import (
    BootTimeouts,
    FileDisk,
    MemoryBacking,
    TapNet,
    UserNet,
    Vm,
    VmmBootTimeout,
    VmmDriver,
    VmmError,
    VmmStartError,
    VmmStateError,
    VmmTimeout,
    VmSpec,
    VmState,
    pick_driver,
)
from host.vmm.firecracker import config as fcconfig
from host.vmm.firecracker.driver import (
    BalloonConfig,
    FirecrackerDriver,
    FirecrackerVm,
    firecracker_usable,
    snapshot_mem_path,
)

from .fakefc import FakeFc, boot_calls
from .firecracker_openapi import OpenApi, RequestRejected

# -- boot ---------------------------------------------------------------------------------


async def test_boot_sends_exact_request_sequence_to_fake_firecracker(
        fake_fc: FakeFc, spec: VmSpec) -> None:
    driver = fake_fc.driver()
    vm = await driver.start(spec)
    try:
        assert isinstance(vm, Vm) and isinstance(driver, VmmDriver)
        assert vm.state is VmState.RUNNING and vm.pid is not None and vm.alive()
        assert vm.argv[1:] == ["--api-sock", str(vm.api_socket),
                               "--log-path", str(vm.work_dir / "firecracker.log")]
        assert "logger configured" in vm.stderr_tail()
        assert fake_fc.calls() == boot_calls(spec)
        fake_fc.assert_all_accepted()
        # Firecracker runs in the work dir and opens its files through relative paths.
        assert os.readlink(vm.work_dir / "drives/rootfs") == str(spec.disks[0].path)  # type: ignore[union-attr]
        assert os.readlink(vm.work_dir / "boot/vmlinux") == str(spec.kernel)
        assert (vm.work_dir / "pid").read_text() == str(vm.pid)
        assert await vm.instance_state() == "Running"
        assert "fake guest booted: reboot=k panic=1 pci=off console=ttyS0" in vm.serial_tail()
        assert vm.envd_url == "http://10.11.0.2:49983"
        assert driver.vms == [vm]
    finally:
        await vm.kill()
    assert not vm.alive()
    fake_fc.assert_nothing_left()
    assert driver.vms == []


async def test_boot_cmdline_with_root_leaves_no_root_drive_and_passes_initrd(
        fake_fc: FakeFc, spec: VmSpec, tmp_path: Path) -> None:
    initrd = tmp_path / "initrd"
    initrd.write_bytes(b"x")
    spec2 = VmSpec(kernel=spec.kernel, cmdline="root=/dev/vdb", initrd=initrd,
                   disks=spec.disks, network=None)
    async with await fake_fc.driver().start(spec2):
        calls = fake_fc.calls()
    assert calls[1][2] == {"kernel_image_path": "boot/vmlinux",
                           "boot_args": "console=ttyS0 reboot=k panic=1 pci=off root=/dev/vdb "
                                         "page_reporting.page_reporting_order=7 "
                                         "page_reporting.page_reporting_delay_ms=20 "
                                         "sysctl.vm.percpu_pagelist_high_fraction=512",
                           "initrd_path": "boot/initrd"}
    assert [c[2]["is_root_device"] for c in calls if c[1].startswith("/drives/")] == [
        False, False]
    assert not any(c[1].startswith("/network-interfaces") for c in calls)
    fake_fc.assert_all_accepted()


async def test_balloon_configured_before_start_then_stats_and_update(
        fake_fc: FakeFc, spec: VmSpec) -> None:
    balloon = BalloonConfig(amount_mib=64, deflate_on_oom=True, stats_polling_interval_s=2,
                            free_page_reporting=True)
    async with await fake_fc.driver(balloon=balloon).start(spec) as vm:
        assert fake_fc.calls()[-2:] == [
            ("PUT", "/balloon", {"amount_mib": 64, "deflate_on_oom": True,
                                 "stats_polling_interval_s": 2, "free_page_reporting": True}),
            ("PUT", "/actions", {"action_type": "InstanceStart"}),
        ]
        fake_fc.clear()
        stats = await vm.balloon_stats()
        assert stats.target_mib == 64 and stats.size_mib == 64 and stats.free_mib == 1
        assert stats.available_mib is None  # not reported
        await vm.set_balloon(128)
        assert (await vm.balloon_stats()).target_mib == 128
        assert fake_fc.calls() == [("GET", "/balloon/statistics", None),
                                   ("PATCH", "/balloon", {"amount_mib": 128}),
                                   ("GET", "/balloon/statistics", None)]
        with pytest.raises(VmmError, match="too large"):
            await vm.set_balloon(10_000)


async def test_balloon_calls_without_a_balloon_report_firecrackers_fault(
        fake_fc: FakeFc, spec: VmSpec) -> None:
    async with await fake_fc.driver().start(replace(spec, balloon=False)) as vm:
        with pytest.raises(VmmError, match=r"PATCH /balloon failed \(400\): Balloon device "
                                           "not configured"):
            await vm.set_balloon(8)


# -- pause / resume / snapshots -----------------------------------------------------------


async def test_pause_resume_are_patch_vm_and_idempotent(fake_fc: FakeFc, spec: VmSpec) -> None:
    async with await fake_fc.driver().start(spec) as vm:
        fake_fc.clear()
        await vm.pause()
        await vm.pause()
        assert vm.state is VmState.PAUSED and await vm.instance_state() == "Paused"
        await vm.resume()
        await vm.resume()
        state: VmState = vm.state  # (mypy narrowed vm.state to PAUSED above)
        assert state is VmState.RUNNING
        assert fake_fc.calls() == [("PATCH", "/vm", {"state": "Paused"}),
                                   ("PATCH", "/vm", {"state": "Resumed"})]


async def test_full_snapshot_then_restore_opens_the_restored_vms_own_disks(
        fake_fc: FakeFc, spec: VmSpec, tmp_path: Path) -> None:
    """The snapshot records the relative drive paths; the restored VM's work dir points
    them at its own disk copies, so no drive needs re-pointing after the load."""
    dest = tmp_path / "snap" / "vm.state"
    dest.parent.mkdir()
    driver = fake_fc.driver()
    async with await driver.start(spec) as vm:
        fake_fc.clear()
        await vm.save_state(dest)
        assert vm.state is VmState.PAUSED
        assert fake_fc.calls() == [
            ("PATCH", "/vm", {"state": "Paused"}),
            ("PUT", "/snapshot/create", {"snapshot_type": "Full",
                                         "snapshot_path": "out-1/vm.state",
                                         "mem_file_path": "out-1/vm.state.mem"}),
        ]
        assert not (vm.work_dir / "out-1").exists()
    assert dest.is_file() and snapshot_mem_path(dest).is_file()
    saved = json.loads(dest.read_text())["drives"]
    assert saved["rootfs"]["path_on_host"] == "drives/rootfs"

    # The restored VM gets its own disk copies and TAP.
    copies = []
    for disk in spec.disks:
        assert isinstance(disk, FileDisk)
        copy = disk.path.with_name("copy-" + disk.path.name)
        copy.write_bytes(disk.path.read_bytes())
        copies.append(FileDisk(path=copy, read_only=disk.read_only, serial=disk.serial))
    child = VmSpec(kernel=spec.kernel, cmdline=spec.cmdline, vcpus=2, mem_mib=256,
                   disks=tuple(copies), network=TapNet(tap="tap8", guest_ip="10.11.0.6"),
                   name="child")
    fake_fc.clear()
    async with await driver.restore(child, dest) as vm2:
        assert vm2.state is VmState.RUNNING
        assert await vm2.instance_state() == "Running"
        assert fake_fc.calls() == [
            ("PUT", "/snapshot/load", {
                "snapshot_path": "state/vmstate",
                "mem_backend": {"backend_type": "File", "backend_path": "mem/guest.mem"},
                "track_dirty_pages": True, "resume_vm": True,
                "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap8"}]}),
        ]
        fake_fc.assert_all_accepted()
        assert os.readlink(vm2.work_dir / "drives/rootfs") == str(copies[0].path)
        assert os.readlink(vm2.work_dir / "mem/guest.mem") == str(snapshot_mem_path(dest))


async def test_restore_resume_false_leaves_the_vm_paused(
        fake_fc: FakeFc, spec: VmSpec, tmp_path: Path) -> None:
    bare = VmSpec(kernel=spec.kernel, network=None, name="bare")
    dest = tmp_path / "bare.state"
    driver = fake_fc.driver(track_dirty_pages=False)
    async with await driver.start(bare) as vm:
        await vm.save_state(dest)
    fake_fc.clear()
    async with await driver.restore(bare, dest, resume=False) as vm3:
        assert vm3.state is VmState.PAUSED and await vm3.instance_state() == "Paused"
        assert fake_fc.calls() == [("PUT", "/snapshot/load", {
            "snapshot_path": "state/vmstate",
            "mem_backend": {"backend_type": "File", "backend_path": "mem/guest.mem"},
            "track_dirty_pages": False, "resume_vm": False})]
        await vm3.resume()
        assert await vm3.instance_state() == "Running"


async def test_diff_save_state_sends_diff_type(
        fake_fc: FakeFc, spec: VmSpec, tmp_path: Path) -> None:
    driver = fake_fc.driver()
    async with await driver.start(spec) as vm:
        await vm.save_state(tmp_path / "base")
        fake_fc.clear()
        await vm.save_state(tmp_path / "layer1", diff=True)  # already paused: no PATCH
        assert fake_fc.calls() == [("PUT", "/snapshot/create", {
            "snapshot_type": "Diff", "snapshot_path": "out-2/layer1",
            "mem_file_path": "out-2/layer1.mem"})]
    assert (tmp_path / "layer1").is_file() and (tmp_path / "layer1.mem").is_file()


async def test_restore_from_a_private_memory_file(fake_fc: FakeFc, spec: VmSpec,
                                                  tmp_path: Path) -> None:
    bare = VmSpec(kernel=spec.kernel, network=None, name="m")
    dest = tmp_path / "m.state"
    driver = fake_fc.driver()
    async with await driver.start(bare) as vm:
        await vm.save_state(dest)
    base = tmp_path / "base.mem"
    snapshot_mem_path(dest).rename(base)
    fake_fc.clear()
    child = VmSpec(kernel=spec.kernel, network=None, name="m",
                   memory=MemoryBacking(path=base, shared=False))
    async with await driver.restore(child, dest) as vm2:
        assert os.readlink(vm2.work_dir / "mem/guest.mem") == str(base)
        fake_fc.assert_all_accepted()
    shared = VmSpec(kernel=spec.kernel, network=None, memory=MemoryBacking(path=base))
    with pytest.raises(VmmError, match="copy-on-write"):
        await driver.restore(shared, dest)


async def test_restore_with_missing_memory_file_starts_nothing(
        fake_fc: FakeFc, spec: VmSpec, tmp_path: Path) -> None:
    state = tmp_path / "lonely.state"
    state.write_text("{}")
    with pytest.raises(VmmStartError, match="snapshot file not found.*lonely.state.mem"):
        await fake_fc.driver().restore(spec, state)
    assert fake_fc.calls() == []
    fake_fc.assert_nothing_left()


# -- errors --------------------------------------------------------------------------------


async def test_api_fault_message_becomes_vmm_error_and_nothing_is_left(
        fake_fc: FakeFc, spec: VmSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FC_FAIL", "PUT /boot-source")
    driver = fake_fc.driver()
    with pytest.raises(VmmError, match=r"PUT /boot-source failed \(400\): injected fault"):
        await driver.start(spec)
    assert [c[1] for c in fake_fc.calls()] == ["/machine-config", "/boot-source"]
    assert driver.vms == []
    fake_fc.assert_nothing_left()


async def test_vmm_dying_during_a_request_is_a_start_error(
        fake_fc: FakeFc, spec: VmSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FC_CRASH", "PUT /actions")
    with pytest.raises(VmmStartError, match=r"exited with code 9 \(during PUT /actions\)") \
            as info:
        await fake_fc.driver().start(spec)
    assert "crashing on PUT /actions" in info.value.stderr_tail
    fake_fc.assert_nothing_left()


async def test_api_request_that_never_answers_is_a_timeout(
        fake_fc: FakeFc, spec: VmSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FC_HANG", "PATCH /vm")
    async with await fake_fc.driver().start(spec) as vm:
        with pytest.raises(VmmTimeout, match=r"PATCH /vm took over 0.3s"):
            await vm.api("PATCH", "/vm", {"state": "Paused"}, timeout_s=0.3)
    fake_fc.assert_nothing_left()


async def test_fake_enforces_firecracker_state_rules_and_schema(
        fake_fc: FakeFc, spec: VmSpec) -> None:
    """The fake answers what Firecracker documents; the driver reports it verbatim."""
    async with await fake_fc.driver().start(spec) as vm:
        with pytest.raises(VmmError, match="not supported after starting the microVM"):
            await vm.api("PUT", "/machine-config", {"vcpu_count": 1, "mem_size_mib": 128})
        with pytest.raises(VmmError, match="not paused"):
            await vm.api("PUT", "/snapshot/create", {"snapshot_path": "/x", "mem_file_path": "/y"})
        with pytest.raises(VmmError, match="schema: Additional properties"):
            await vm.api("PATCH", "/vm", {"state": "Paused", "extra": 1})
        with pytest.raises(VmmError, match="schema: 'Running' is not one of"):
            await vm.api("PATCH", "/vm", {"state": "Running"})
        with pytest.raises(VmmError, match="does not match the id from the body"):
            await vm.api("PATCH", "/drives/rootfs", {"drive_id": "other"})
        with pytest.raises(VmmError, match="Invalid request method and/or path"):
            await vm.api("DELETE", "/vm")
        assert vm.state is VmState.RUNNING  # failed calls change nothing


async def test_vmm_that_never_opens_its_socket_times_out_and_is_reaped(
        fake_fc: FakeFc, spec: VmSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FC_MODE", "never-listen")
    driver = fake_fc.driver()
    with pytest.raises(VmmTimeout, match="API did not answer within 1.0s") as info:
        await driver.start(spec, timeouts=BootTimeouts(vmm_ready_s=1.0, kill_s=2.0))
    assert "not opening the API socket" in info.value.stderr_tail
    assert driver.vms == []
    fake_fc.assert_nothing_left()


async def test_vmm_exiting_at_startup_is_a_start_error_with_stderr(
        fake_fc: FakeFc, spec: VmSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FC_MODE", "exit")
    with pytest.raises(VmmStartError, match="exited with code 3 during startup") as info:
        await fake_fc.driver().start(spec)
    assert "told to exit" in info.value.stderr_tail
    fake_fc.assert_nothing_left()


async def test_missing_binary_is_a_start_error(fake_fc: FakeFc, spec: VmSpec) -> None:
    driver = FirecrackerDriver(firecracker=str(fake_fc.tmp / "nope"), run_dir=fake_fc.run_dir)
    with pytest.raises(VmmStartError, match="cannot run"):
        await driver.start(spec)
    fake_fc.assert_nothing_left()


@pytest.mark.parametrize(("change", "message"), [
    ({"network": UserNet()}, "supports only TAP networking"),
    ({"disks": (FileDisk(path=Path("/x.qcow2"), format="qcow2"),)}, "raw images only"),
    ({"disks": (FileDisk(path=Path("/x"), serial="bad-id"),)}, "alphanumeric"),
    ({"kernel": None}, "needs a kernel"),
    ({"disks": (FileDisk(path=Path("/a"), serial="x"), FileDisk(path=Path("/b"), serial="x"))},
     "duplicate drive ids"),
])
async def test_unsupported_specs_are_rejected_before_spawning(
        fake_fc: FakeFc, spec: VmSpec, change: dict[str, Any], message: str) -> None:
    fields = {k: getattr(spec, k) for k in ("kernel", "cmdline", "disks", "network", "memory")}
    with pytest.raises(VmmError, match=message):
        await fake_fc.driver().start(VmSpec(**{**fields, **change}))
    assert fake_fc.calls() == [] and not fake_fc.run_dir.exists()


# -- teardown / adopt -----------------------------------------------------------------------


async def test_kill_is_idempotent_and_removes_socket_and_work_dir(
        fake_fc: FakeFc, spec: VmSpec) -> None:
    vm = await fake_fc.driver().start(spec)
    sock, work, pid = vm.api_socket, vm.work_dir, vm.pid
    assert sock.exists() and pid is not None
    await vm.kill()
    await vm.kill()
    await vm.aclose()
    assert vm.state is VmState.KILLED and vm.pid is None
    assert not sock.exists() and not work.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(VmmStateError):
        await vm.pause()


async def test_kill_with_caller_work_dir_keeps_the_dir_removes_our_files(
        fake_fc: FakeFc, spec: VmSpec, tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    (work / "mine.txt").write_text("keep")
    vm = await fake_fc.driver().start(VmSpec(kernel=spec.kernel, network=None, work_dir=work))
    await vm.kill()
    assert sorted(p.name for p in work.iterdir()) == ["mine.txt"]


async def test_detach_then_adopt_reads_state_from_the_api(fake_fc: FakeFc, spec: VmSpec) -> None:
    driver = FirecrackerDriver(firecracker=str(fake_fc.binary), run_dir=fake_fc.run_dir,
                               die_with_parent=False)
    vm = await driver.start(spec)
    await vm.pause()
    facts = json.loads(json.dumps(vm.facts()))
    await vm.detach()
    assert vm.state is VmState.DETACHED
    vm2 = await driver.adopt(spec, facts)
    assert vm2 is not None and vm2.state is VmState.PAUSED and vm2.pid == facts["pid"]
    await vm2.kill()
    assert await driver.adopt(spec, facts) is None
    fake_fc.assert_nothing_left()


async def test_boot_kills_the_vm_when_envd_never_answers(fake_fc: FakeFc, spec: VmSpec) -> None:
    """The fake boots no guest: envd (at an unroutable TEST-NET address) never answers."""
    quiet = VmSpec(kernel=spec.kernel, network=TapNet(tap="tap7", guest_ip="192.0.2.1"))
    driver = fake_fc.driver()
    with pytest.raises(VmmBootTimeout, match=r"192.0.2.1:49983/health within 0.3s") as info:
        await driver.boot(quiet, timeouts=BootTimeouts(envd_ready_s=0.3))
    assert "fake guest booted" in info.value.serial_tail
    assert driver.vms == []
    fake_fc.assert_nothing_left()


def test_vm_class_has_the_whole_vm_protocol_surface(fake_fc: FakeFc, spec: VmSpec) -> None:
    members = {n for n in dir(Vm) if not n.startswith("_")} | {"__aenter__", "__aexit__"}
    assert [n for n in members if not hasattr(FirecrackerVm, n)] == []
    vm = FirecrackerVm(fake_fc.driver(), spec, BootTimeouts())
    assert vm.pid is None and vm.state is VmState.CREATED and vm.serial_tail() == ""


@pytest.mark.parametrize(("base", "expected"), [
    ("", "console=ttyS0 reboot=k panic=1 pci=off"),
    ("console=hvc0 panic=-1 init=/x", "reboot=k pci=off console=hvc0 panic=-1 init=/x"),
])
def test_boot_args_add_only_what_is_missing(base: str, expected: str) -> None:
    assert fcconfig.boot_args(base) == expected


# -- picking and the schema itself ------------------------------------------------------------


def test_firecracker_usable_needs_binary_and_a_standard_kvm(
        monkeypatch: pytest.MonkeyPatch, fake_fc: FakeFc) -> None:
    assert firecracker_usable(str(fake_fc.tmp / "nope"))[0] is False
    monkeypatch.setattr(fcconfig, "_kvm_openable", lambda: True)
    monkeypatch.setattr(fcconfig, "_pvm_loaded", lambda: True)
    ok, why = firecracker_usable(str(fake_fc.binary))
    assert not ok and "kvm-pvm" in why
    monkeypatch.setattr(fcconfig, "_pvm_loaded", lambda: False)
    assert firecracker_usable(str(fake_fc.binary))[0] is True
    monkeypatch.setattr(fcconfig, "_kvm_openable", lambda: False)
    assert "/dev/kvm" in firecracker_usable(str(fake_fc.binary))[1]


def test_pick_driver_by_name_returns_the_firecracker_driver() -> None:
    driver = pick_driver("firecracker", firecracker="/opt/fc")
    assert isinstance(driver, FirecrackerDriver) and driver.firecracker == "/opt/fc"


@pytest.mark.parametrize(("method", "path", "body"), [
    ("PUT", "/machine-config", {"vcpu_count": 0, "mem_size_mib": 128}),
    ("PUT", "/machine-config", {"mem_size_mib": 128}),
    ("PUT", "/boot-source", {"boot_args": "x"}),
    ("PUT", "/drives/a", {"drive_id": "a", "path_on_host": "/x"}),
    ("PUT", "/network-interfaces/eth0", {"iface_id": "eth0", "tap": "tap0"}),
    ("PUT", "/actions", {"action_type": "Start"}),
    ("PUT", "/snapshot/create", {"snapshot_path": "/s", "mem_file_path": "/m",
                                 "snapshot_type": "Incremental"}),
    ("PUT", "/snapshot/load", {"snapshot_path": "/s",
                               "mem_backend": {"backend_type": "Shm", "backend_path": "/m"}}),
    ("PUT", "/snapshot/load", {"snapshot_path": "/s", "mem_backend": {"backend_type": "File"}}),
    ("PATCH", "/balloon", {"amount_mib": 1, "deflate_on_oom": True}),
    ("PATCH", "/drives/a", {"drive_id": "b"}),
    ("PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": 128, "huge_pages": "1G"}),
    ("PUT", "/vm", {"state": "Paused"}),
    ("GET", "/snapshot/create", None),
    ("PUT", "/actions", None),
    ("GET", "/", {"x": 1}),
])
def test_schema_rejects_what_firecracker_rejects(method: str, path: str, body: Any) -> None:
    """Checked against the pinned upstream document, not a transcription of it."""
    with pytest.raises(RequestRejected):
        OpenApi.load().check(method, path, body)


def test_pinned_openapi_document_is_verbatim_and_names_its_source() -> None:
    from .firecracker_openapi import SCHEMA_FILE

    readme = (SCHEMA_FILE.parent / "README.md").read_text()
    digest = hashlib.sha256(SCHEMA_FILE.read_bytes()).hexdigest()
    assert digest in readme and "2038188f145fb81b8d098147a10e9d9f392fd22f" in readme
    api = OpenApi.load()
    assert api.version == "1.16.1"
    assert {("PUT", "/snapshot/load"), ("PUT", "/snapshot/create"), ("PATCH", "/vm"),
            ("PUT", "/drives/{drive_id}")} <= {(e.method, e.template) for e in api.endpoints}


@pytest.mark.parametrize("body", [
    {"snapshot_path": "s"},
    {"snapshot_path": "s", "mem_file_path": "m",
     "mem_backend": {"backend_type": "File", "backend_path": "m"}},
])
def test_fake_needs_exactly_one_memory_field_on_load(body: dict[str, Any]) -> None:
    """The document states this rule in prose (SnapshotLoadParams); the fake applies it."""
    from .fake_firecracker import FakeFirecracker

    status, reply = FakeFirecracker().handle("PUT", "/snapshot/load", body)
    assert status == 400 and "Exactly one" in reply["fault_message"]


def test_config_digest_keys_on_the_machine_not_the_instance(
        fake_fc: FakeFc, spec: VmSpec, tmp_path: Path) -> None:
    from dataclasses import replace

    driver = fake_fc.driver()
    digest = driver.config_digest(spec)
    assert len(digest) == 64 and fcconfig.firecracker_version(str(fake_fc.binary)) == \
        "Firecracker v1.16.1"
    other_disks = tuple(replace(d, path=tmp_path / f"other{i}")  # type: ignore[call-arg]
                        for i, d in enumerate(spec.disks))
    same = [
        replace(spec, disks=other_disks, name="x", work_dir=tmp_path / "w",
                network=TapNet(tap="tap99", guest_ip="10.9.9.9", netns="ns9",
                               mac="06:00:0a:0b:00:02"),
                memory=MemoryBacking(path=tmp_path / "m", shared=False)),
    ]
    assert {driver.config_digest(s) for s in same} == {digest}
    different = [
        replace(spec, vcpus=4), replace(spec, mem_mib=512), replace(spec, cmdline="quiet"),
        replace(spec, kernel=tmp_path / "other-vmlinux"), replace(spec, disks=spec.disks[:1]),
        replace(spec, network=TapNet(tap="tap7", guest_ip="10.11.0.2", mac="06:00:00:00:00:09")),
    ]
    assert len({driver.config_digest(s) for s in different} | {digest}) == len(different) + 1
    other = fake_fc.tmp / "bin" / "firecracker-next"
    other.write_text('#!/bin/sh\necho "Firecracker v1.17.0"\n')
    other.chmod(0o755)
    assert fake_fc.driver(firecracker=str(other)).config_digest(spec) != digest
    with pytest.raises(VmmError, match="version"):
        fake_fc.driver(firecracker=str(tmp_path / "missing")).config_digest(spec)


async def test_boot_ignores_a_shared_memory_file(fake_fc: FakeFc, spec: VmSpec,
                                                 tmp_path: Path) -> None:
    """The runtime asks for RAM in a shared file for templates (QEMU's freeze needs it);
    a fresh Firecracker VM's RAM is anonymous and freeze_memory writes it out instead."""
    from dataclasses import replace

    async with await fake_fc.driver().start(
            replace(spec, memory=MemoryBacking(path=tmp_path / "scratch.mem"))) as vm:
        assert vm.state is VmState.RUNNING
    assert not (tmp_path / "scratch.mem").exists()
