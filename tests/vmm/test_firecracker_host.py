"""What a Firecracker VM holds on the host: NbdDisks attached as /dev/nbdN, the jailer's
chroot, leftover processes. All against fakes: this machine has no Firecracker binary,
no usable KVM (PVM only), no jailer, no nbd module and no nbd-client, so the driver runs
`fake_firecracker.py` (API checked against the pinned OpenAPI document), started
directly or by `fake_jailer.py` (checks the jailer's documented arguments, builds the
chroot, emulates it with FAKE_FC_ROOT), with disks attached by `fake_nbd_client.py`
over a fake sysfs. Real here: hard links, `mknod` of block device nodes, bind mounts
(this test host runs as root), process spawning, finding and killing.
Unverified: a real jailer (pivot_root, privilege drop, cgroups) and real /dev/nbdN.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from host.vmm import FileDisk, MemoryBacking, NbdDisk, TapNet, VmSpec, VmState
from host.vmm.firecracker.driver import FirecrackerDriver
from host.vmm.firecracker.jailer import JailerConfig, JailRoot, find_jailer, mounts_under
from host.vmm.jail import JailConfig

from .fakefc import FAKE_JAILER, FakeFc, boot_calls, script
from .test_blockdev import FakeNbd

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod/mount/chown need root")


@pytest.fixture
def nbd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNbd:
    return FakeNbd(tmp_path, monkeypatch)


@pytest.fixture
def jailer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[JailerConfig]:
    """The fake jailer; unmounts anything a failed test left mounted under tmp_path."""
    monkeypatch.setenv("FAKE_JAILER_LOG", str(tmp_path / "jailer.jsonl"))
    binary = script(tmp_path / "bin" / "jailer", FAKE_JAILER)
    yield JailerConfig(binary=str(binary), uid=0, gid=0, sys_root=tmp_path / "sys")
    for m in sorted(mounts_under(tmp_path), key=lambda p: len(str(p)), reverse=True):
        subprocess.run(["umount", "-l", str(m)], check=False)


def nbd_spec(spec: VmSpec, nbd: FakeNbd, **kw: object) -> VmSpec:
    disks = (NbdDisk(socket=nbd.socket, export="sbx-root", read_only=True), spec.disks[1])
    fields = {"kernel": spec.kernel, "cmdline": spec.cmdline, "vcpus": 2, "mem_mib": 256,
              "disks": disks, "network": spec.network, "name": "nbd-vm", **kw}
    return VmSpec(**fields)  # type: ignore[arg-type]


def jailer_argvs(tmp: Path) -> list[list[str]]:
    log = tmp / "jailer.jsonl"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


# -- NBD --------------------------------------------------------------------------------


async def test_nbd_disks_are_attached_before_start_and_detached_after_kill(
        fake_fc: FakeFc, spec: VmSpec, nbd: FakeNbd) -> None:
    driver = fake_fc.driver(block=nbd.attacher())
    vm = await driver.start(nbd_spec(spec, nbd))
    try:
        assert vm.devices == [nbd.dev / "nbd0"]
        assert os.readlink(vm.work_dir / "drives/rootfs") == str(nbd.dev / "nbd0")
        assert json.loads((vm.work_dir / "blockdevs.json").read_text()) == [
            str(nbd.dev / "nbd0")]
        assert fake_fc.calls() == boot_calls(spec)
        assert nbd.calls() == [["-unix", str(nbd.socket), "-N", "sbx-root", "-b", "4096",
                                "-readonly", str(nbd.dev / "nbd0")]]
    finally:
        await vm.kill()
    assert nbd.calls()[-1] == ["-d", str(nbd.dev / "nbd0")]
    fake_fc.assert_nothing_left()


async def test_failed_attach_starts_nothing(fake_fc: FakeFc, spec: VmSpec, nbd: FakeNbd
                                            ) -> None:
    nbd.socket.unlink()
    driver = fake_fc.driver(block=nbd.attacher())
    with pytest.raises(Exception, match="cannot attach NBD export 'sbx-root'"):
        await driver.start(nbd_spec(spec, nbd))
    assert fake_fc.calls() == [] and driver.vms == []
    fake_fc.assert_nothing_left()


async def test_a_later_failure_detaches_what_was_attached(
        fake_fc: FakeFc, spec: VmSpec, nbd: FakeNbd, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FC_FAIL", "PUT /boot-source")
    with pytest.raises(Exception, match="injected fault"):
        await fake_fc.driver(block=nbd.attacher()).start(nbd_spec(spec, nbd))
    assert nbd.calls()[-1] == ["-d", str(nbd.dev / "nbd0")]
    fake_fc.assert_nothing_left()


# -- jailer ---------------------------------------------------------------------------------


@needs_root
async def test_jailer_builds_the_chroot_and_firecracker_sees_only_it(
        fake_fc: FakeFc, spec: VmSpec, nbd: FakeNbd, jailer: JailerConfig,
        tmp_path: Path) -> None:
    os.unlink(nbd.dev / "nbd0")
    os.mknod(nbd.dev / "nbd0", stat.S_IFBLK | 0o600, os.makedev(43, 0))
    netns_spec = nbd_spec(spec, nbd, network=TapNet(tap="tap7", guest_ip="10.11.0.2",
                                                    mac="06:00:0a:0b:00:02", netns="sbx-ns"))
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other_fs:
        kernel = Path(other_fs) / "vmlinux"  # another filesystem: no hard link, bind mount
        kernel.write_bytes(b"\x7fELF")
        jspec = VmSpec(**{**{k: getattr(netns_spec, k) for k in (
            "cmdline", "vcpus", "mem_mib", "disks", "network", "name")}, "kernel": kernel})
        driver = fake_fc.driver(block=nbd.attacher(), jailer=jailer)
        vm = await driver.start(jspec)
        try:
            work = vm.work_dir
            root = work / "jail" / "firecracker" / work.name.replace("_", "-") / "root"
            assert vm.root.root == root and root.is_dir()
            assert jailer_argvs(tmp_path) == [[
                "--id", work.name.replace("_", "-"), "--exec-file", str(fake_fc.binary),
                "--uid", "0", "--gid", "0", "--chroot-base-dir", str(work / "jail"),
                "--netns", "/var/run/netns/sbx-ns", "--",
                "--api-sock", "/api.sock", "--log-path", "/firecracker.log"]]
            assert vm.pid is not None and vm.argv[0] == jailer.binary
            assert os.readlink(vm.api_socket) == str(root / "api.sock")
            assert fake_fc.calls() == boot_calls(spec)
            fake_fc.assert_all_accepted()
            dev = (root / "drives/rootfs").stat()
            assert stat.S_ISBLK(dev.st_mode) and dev.st_rdev == os.makedev(43, 0)
            data = spec.disks[1]
            assert isinstance(data, FileDisk)
            assert (root / "drives/data").stat().st_ino == data.path.stat().st_ino  # link
            assert mounts_under(root) == [root / "boot/vmlinux"]  # bind mount
            assert "logger configured" in vm.stderr_tail()
        finally:
            await vm.kill()
        assert mounts_under(tmp_path) == [] and kernel.read_bytes() == b"\x7fELF"
    assert nbd.calls()[-1] == ["-d", str(nbd.dev / "nbd0")]
    fake_fc.assert_nothing_left()


@needs_root
async def test_each_jailed_vm_runs_as_its_own_uid(
        fake_fc: FakeFc, spec: VmSpec, jailer: JailerConfig, tmp_path: Path) -> None:
    """With the VM jail's uid range, the jailer starts every Firecracker as its own uid and
    gid (never root, never one shared by two sandboxes), given back at kill."""
    first = 1879048192
    driver = fake_fc.driver(jailer=jailer, jail=JailConfig(uid_range=(first, 8)))
    vms = [await driver.start(VmSpec(**{**{k: getattr(spec, k) for k in (
        "kernel", "cmdline", "vcpus", "mem_mib", "disks", "network")}, "name": f"vm{i}"}))
        for i in range(2)]
    try:
        uids = [int(a[a.index("--uid") + 1]) for a in jailer_argvs(tmp_path)]
        gids = [int(a[a.index("--gid") + 1]) for a in jailer_argvs(tmp_path)]
        assert uids == gids and len(set(uids)) == 2
        assert all(first <= u < first + 8 for u in uids)
        assert driver.uids is not None and driver.uids.in_use() == set(uids)
    finally:
        for vm in vms:
            await vm.kill()
    assert driver.uids.in_use() == set()
    fake_fc.assert_nothing_left()


@needs_root
async def test_memory_snapshots_through_the_jail(
        fake_fc: FakeFc, spec: VmSpec, jailer: JailerConfig, tmp_path: Path) -> None:
    driver = fake_fc.driver(jailer=jailer)
    small = VmSpec(kernel=spec.kernel, mem_mib=16, disks=spec.disks, network=spec.network)
    async with await driver.start(small) as vm:
        fake_fc.guest_writes({3: 3})
        base = await vm.freeze_memory(tmp_path / "base")
    assert base.mem_path.is_file() and not (tmp_path / "base/.fc-full.mem").exists()
    child = VmSpec(kernel=spec.kernel, mem_mib=16, disks=spec.disks, network=spec.network,
                   memory=MemoryBacking(path=base.mem_path, shared=False))
    async with await driver.restore_memory(child, base=base) as vm2:
        mem = vm2.root.root / "mem/guest.mem"
        assert mem.stat().st_ino == base.mem_path.stat().st_ino  # hard link into the jail
        fake_fc.guest_writes({8: 8})
        s1 = await vm2.snapshot_memory(tmp_path / "s1", base=base, parent=None)
    async with await driver.restore_memory(child, base=base, snapshot=s1) as vm3:
        assert vm3.state is VmState.RUNNING and vm3.restore_stats["pages"] == 1
    fake_fc.assert_all_accepted()
    fake_fc.assert_nothing_left()


@needs_root
async def test_a_non_root_jailer_can_read_private_memory_but_not_own_it(tmp_path: Path) -> None:
    """Guest memory is root's only (0400 frozen, 0600 materialised): a jailer uid other
    than 0 reads it through its gid, and never owns it (an owner could chmod and write
    a frozen base every VM of a template shares)."""
    work = tmp_path / "work"
    work.mkdir()
    frozen, kernel = tmp_path / "base.mem", tmp_path / "vmlinux"
    frozen.write_bytes(b"ram")
    frozen.chmod(0o400)
    kernel.write_bytes(b"\x7fELF")
    kernel.chmod(0o644)
    jail = JailRoot(work, JailerConfig(binary="jailer", uid=123, gid=456), "firecracker")
    await jail.expose(frozen, "mem/guest.mem")
    await jail.expose(kernel, "boot/vmlinux")
    placed = jail.place("mem/private.mem")
    placed.write_bytes(b"ram")
    placed.chmod(0o600)
    jail.let_read(placed)

    def owner(p: Path) -> tuple[int, int, int]:
        st = p.stat()
        return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)

    assert owner(jail.root / "mem/guest.mem") == owner(frozen) == (0, 456, 0o440)
    assert owner(placed) == (0, 456, 0o640)
    assert owner(kernel) == (0, 0, 0o644)                   # readable already: untouched
    as_root = JailRoot(work, JailerConfig(binary="jailer"), "firecracker")
    frozen.chmod(0o400)
    os.chown(frozen, 0, 0)
    await as_root.expose(frozen, "mem/guest.mem")
    assert owner(frozen) == (0, 0, 0o400)


def test_find_jailer_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert find_jailer("off") is None and find_jailer("") is None
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_jailer("auto") is None  # none on PATH
    fake = script(tmp_path / "jailer", FAKE_JAILER)
    found = find_jailer("auto", uid=123, gid=100)
    if os.geteuid() == 0:
        assert found == JailerConfig(binary=str(fake), uid=123, gid=100)
    else:
        assert found is None
    assert find_jailer(str(fake)) == JailerConfig(binary=str(fake))
    with pytest.raises(Exception, match="not found"):
        find_jailer(str(tmp_path / "nope"))


# -- leftovers ------------------------------------------------------------------------------


@pytest.mark.parametrize("jailed", [False, pytest.param(True, marks=needs_root)])
async def test_leftovers_finds_lost_vms_and_kill_pid_cleans_up(
        fake_fc: FakeFc, spec: VmSpec, nbd: FakeNbd, jailer: JailerConfig,
        jailed: bool) -> None:
    driver = fake_fc.driver(block=nbd.attacher(), die_with_parent=False,
                            jailer=jailer if jailed else None)
    vm = await driver.start(nbd_spec(spec, nbd))
    pid, work = vm.pid, vm.work_dir
    assert pid is not None
    await vm.detach()  # the handle is lost; the VM runs on
    assert driver.leftovers(fake_fc.run_dir) == {pid: work.name}
    assert driver.leftovers(fake_fc.run_dir / "elsewhere") == {}
    await driver.kill_pid(pid, work)
    assert not work.exists()
    assert nbd.calls()[-1] == ["-d", str(nbd.dev / "nbd0")]
    assert driver.leftovers(fake_fc.run_dir) == {}
    fake_fc.assert_nothing_left()


async def test_kill_pid_spares_a_process_that_is_not_that_vm(
        fake_fc: FakeFc, tmp_path: Path) -> None:
    work = fake_fc.run_dir / "vm-x"
    work.mkdir(parents=True)
    (work / "pid").write_text("1")
    other = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        await FirecrackerDriver(firecracker=str(fake_fc.binary),
                                run_dir=fake_fc.run_dir).kill_pid(other.pid, work)
        assert other.returncode is None and not work.exists()
    finally:
        other.kill()
        await other.wait()
