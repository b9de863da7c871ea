"""Memory snapshots in memsnap's form through the Firecracker driver, against the FAKE
Firecracker (tests/vmm/fake_firecracker.py).

No Firecracker binary and no usable KVM on this machine (PVM only): the fake simulates
guest memory page by page (boot writes pages 0-3, `FakeFc.guest_writes` is what the
guest writes before its next pause), writes Full snapshots as whole files and Diff
snapshots as sparse files of the dirtied pages, and loads memory files. The tests check
the driver's side for real: the requests (against the pinned OpenAPI document), the
conversion into memsnap bases/diffs/chains, the lineage rules, the materialised memory of
a restore (read back through a freeze of the restored VM), and cleanup. Unverified here:
that a real Firecracker's dirty log and Diff files behave as documented and simulated.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from host.vmm import FileDisk, MemoryBacking, TapNet, VmSpec, VmState
from host.vmm.errors import VmmSnapshotError, VmmStateError
from host.vmm.firecracker.driver import FirecrackerDriver, FirecrackerVm
from host.vmm.memsnap import (
    PAGE_SIZE,
    BaseImage,
    DiffFile,
    DiffKind,
    MemSnapshot,
    flatten_base,
)

from .fakefc import FakeFc

BOOT = {p: (b"boot%d" % p).ljust(PAGE_SIZE, b".") for p in range(4)}


def fill(byte: int) -> bytes:
    return bytes([byte]) * PAGE_SIZE


def pages_of(path: Path) -> dict[int, bytes]:
    """The non-zero pages of a memory file."""
    out = {}
    with open(path, "rb") as f:
        i = 0
        while page := f.read(PAGE_SIZE):
            if page.count(0) != len(page):
                out[i] = page
            i += 1
    return out


@pytest.fixture
def mspec(tmp_path: Path) -> VmSpec:
    """A small VM (16 MiB) with one disk; RAM 'in a shared file' as the runtime asks for
    a template (ignored by Firecracker: its fresh RAM is anonymous)."""
    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"\x7fELF")
    root = tmp_path / "root.img"
    root.write_bytes(b"r")
    return VmSpec(kernel=kernel, mem_mib=16, disks=(FileDisk(path=root),),
                  network=TapNet(tap="tap1", guest_ip="10.0.0.2"), name="tmpl",
                  memory=MemoryBacking(path=tmp_path / "scratch.mem", shared=True))


def child_spec(spec: VmSpec, base: BaseImage, tap: str = "tap2") -> VmSpec:
    return VmSpec(kernel=spec.kernel, mem_mib=spec.mem_mib, disks=spec.disks,
                  network=TapNet(tap=tap, guest_ip="10.0.0.3"), name="child",
                  memory=MemoryBacking(path=base.mem_path, shared=False))


async def frozen_base(fake_fc: FakeFc, driver: FirecrackerDriver, spec: VmSpec,
                      dest: Path, writes: dict[int, int] | None = None) -> BaseImage:
    async with await driver.start(spec) as vm:
        fake_fc.guest_writes({5: 0xAA, 9: 0xBB} if writes is None else writes)
        base = await vm.freeze_memory(dest)
        assert vm.state is VmState.PAUSED
    return base


async def chain_of_two(fake_fc: FakeFc, driver: FirecrackerDriver, spec: VmSpec, tmp_path: Path,
                       first: dict[int, int], second: dict[int, int]
                       ) -> tuple[BaseImage, MemSnapshot, MemSnapshot]:
    """A frozen base, then a child of it snapshotted after `first` (s1) and after `second`
    (s2, a delta on s1)."""
    base = await frozen_base(fake_fc, driver, spec, tmp_path / "base")
    async with await driver.restore_memory(child_spec(spec, base), base=base) as vm:
        fake_fc.guest_writes(first)
        s1 = await vm.snapshot_memory(tmp_path / "s1", base=base, parent=None)
        fake_fc.guest_writes(second)
        s2 = await vm.snapshot_memory(tmp_path / "s2", base=base, parent=s1)
    return base, s1, s2


async def memory_of(vm: FirecrackerVm, dest: Path) -> dict[int, bytes]:
    """A restored VM's memory, read back through a Full snapshot."""
    base = await vm.freeze_memory(dest)
    return pages_of(base.mem_path)


async def test_freeze_memory_writes_a_memsnap_base(fake_fc: FakeFc, mspec: VmSpec,
                                                   tmp_path: Path) -> None:
    driver = fake_fc.driver()
    base = await frozen_base(fake_fc, driver, mspec, tmp_path / "base")
    assert [c[1] for c in fake_fc.calls()[-3:]] == ["/actions", "/vm", "/snapshot/create"]
    assert fake_fc.calls()[-1][2] == {"snapshot_type": "Full",
                                      "snapshot_path": "out-1/base.vmstate",
                                      "mem_file_path": "out-1/.fc-full.mem"}
    fake_fc.assert_all_accepted()
    assert BaseImage.load(base.dir) == base
    manifest = json.loads((base.dir / "base.json").read_text())
    assert manifest["template"] == "base.vmstate" and manifest["vmm"] == "firecracker"
    assert base.size == 16 << 20 and base.mem_path.stat().st_mode & 0o777 == 0o444
    assert pages_of(base.mem_path) == {**BOOT, 5: fill(0xAA), 9: fill(0xBB)}
    assert base.mem_path.stat().st_blocks * 512 < base.size  # zeros left as holes
    assert sorted(p.name for p in base.dir.iterdir()) == ["base.json", "base.mem",
                                                          "base.vmstate"]
    fake_fc.assert_nothing_left()


async def test_snapshot_chain_then_restore_materialises_base_plus_chain(
        fake_fc: FakeFc, mspec: VmSpec, tmp_path: Path) -> None:
    driver = fake_fc.driver()
    base = await frozen_base(fake_fc, driver, mspec, tmp_path / "base")
    spec = child_spec(mspec, base)
    digest = driver.config_digest(spec)

    fake_fc.clear()
    vm = await driver.restore_memory(spec, base=base)
    async with vm:
        assert fake_fc.calls() == [("PUT", "/snapshot/load", {
            "snapshot_path": "state/vmstate",
            "mem_backend": {"backend_type": "File", "backend_path": "mem/guest.mem"},
            "track_dirty_pages": True, "resume_vm": True,
            "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap2"}]})]
        assert os.readlink(vm.work_dir / "mem/guest.mem") == str(base.mem_path)  # as it is
        assert vm.state is VmState.RUNNING

        stopped: list[VmState] = []

        async def cut_disk() -> None:
            stopped.append(vm.state)

        fake_fc.guest_writes({9: 0xCC, 20: 0xDD})
        s1 = await vm.snapshot_memory(tmp_path / "s1", base=base, parent=None,
                                      while_stopped=cut_disk)
        assert stopped == [VmState.PAUSED] and vm.state is VmState.RUNNING
        assert fake_fc.calls()[-3:] == [
            ("PATCH", "/vm", {"state": "Paused"}),
            ("PUT", "/snapshot/create", {"snapshot_type": "Diff",
                                         "snapshot_path": "out-1/devstate.vmstate",
                                         "mem_file_path": "out-1/.fc-diff.mem"}),
            ("PATCH", "/vm", {"state": "Resumed"})]
        assert MemSnapshot.load(s1.dir) == s1
        assert s1.config_sha256.hex() == digest and s1.base_sha256 == base.sha256
        assert s1.stats["diff_pages"] == 2 and s1.stats["chain_len"] == 1
        assert {"downtime_ms", "total_ms"} <= set(s1.stats)
        with DiffFile.open(s1.diff) as d:
            assert d.header.kind is DiffKind.CUMULATIVE and list(d.indexes) == [9, 20]
            assert d.page(9) == fill(0xCC)
        assert sorted(p.name for p in s1.dir.iterdir()) == ["devstate.vmstate", "mem.diff",
                                                            "snapshot.json"]

        fake_fc.guest_writes({20: 0xEE, 30: 0x11})
        s2 = await vm.snapshot_memory(tmp_path / "s2", base=base, parent=s1)
        assert s2.diffs[:1] == s1.diffs and s2.stats["chain_len"] == 2
        with DiffFile.open(s2.diff) as d:
            assert d.header.kind is DiffKind.DELTA and list(d.indexes) == [20, 30]
        fake_fc.assert_all_accepted()

    fake_fc.clear()
    async with await driver.restore_memory(child_spec(mspec, base, "tap3"), base=base,
                                           snapshot=s2, resume=False) as vm2:
        assert vm2.state is VmState.PAUSED
        body = fake_fc.calls()[0][2]
        assert body["snapshot_path"] == "state/vmstate" and body["resume_vm"] is False
        assert os.readlink(vm2.work_dir / "state/vmstate") == str(s2.devstate)
        private = vm2.work_dir / "mem/guest.mem"
        assert not private.is_symlink() and vm2.restore_stats["pages"] == 3
        expected = {**BOOT, 5: fill(0xAA), 9: fill(0xCC), 20: fill(0xEE), 30: fill(0x11)}
        assert pages_of(private) == expected
        assert await memory_of(vm2, tmp_path / "check") == expected
    fake_fc.assert_nothing_left()


async def test_children_of_a_flattened_snapshot_share_one_memory_file(
        fake_fc: FakeFc, mspec: VmSpec, tmp_path: Path) -> None:
    """A fork's shared image (the runtime's forkimages.py) under Firecracker: base + chain
    flattened once; every child loads the bare flat base, its memory file the flat file
    itself (copy-on-write, no private copy per child), its vmstate the snapshot's."""
    driver = fake_fc.driver()
    base, _, s2 = await chain_of_two(fake_fc, driver, mspec, tmp_path,
                                     {9: 0xCC, 20: 0xDD}, {20: 0xEE, 30: 0x11})
    flat = flatten_base(s2, base, tmp_path / "flat")
    assert flat.template_path.read_bytes() == s2.devstate.read_bytes()
    expected = {**BOOT, 5: fill(0xAA), 9: fill(0xCC), 20: fill(0xEE), 30: fill(0x11)}
    for i, tap in enumerate(("tap3", "tap4")):
        fake_fc.clear()
        async with await driver.restore_memory(child_spec(mspec, flat, tap), base=flat) as kid:
            assert os.readlink(kid.work_dir / "mem/guest.mem") == str(flat.mem_path)
            assert os.readlink(kid.work_dir / "state/vmstate") == str(flat.template_path)
            fake_fc.assert_all_accepted()
            assert await memory_of(kid, tmp_path / f"check{i}") == expected
    fake_fc.assert_nothing_left()


async def test_guest_memory_and_work_dirs_are_root_only(fake_fc: FakeFc, mspec: VmSpec,
                                                        tmp_path: Path) -> None:
    """Whatever the umask (the usual 0022 here): frozen base 0400, snapshot and VM work
    dirs 0700, a VM's materialised private memory 0600."""
    old = os.umask(0o022)
    try:
        driver = fake_fc.driver()
        base = await frozen_base(fake_fc, driver, mspec, tmp_path / "base")
        assert stat.S_IMODE(base.mem_path.stat().st_mode) == 0o444
        async with await driver.restore_memory(child_spec(mspec, base), base=base) as vm:
            assert stat.S_IMODE(vm.work_dir.stat().st_mode) == 0o700
            fake_fc.guest_writes({9: 0xCC})
            snap = await vm.snapshot_memory(tmp_path / "s1", base=base, parent=None)
        assert stat.S_IMODE(snap.dir.stat().st_mode) == 0o700
        async with await driver.restore_memory(child_spec(mspec, base, "tap3"), base=base,
                                               snapshot=snap) as vm2:
            private = vm2.work_dir / "mem/guest.mem"
            assert stat.S_IMODE(private.stat().st_mode) == 0o600
            assert stat.S_IMODE(vm2.work_dir.stat().st_mode) == 0o700
    finally:
        os.umask(old)
    fake_fc.assert_nothing_left()


async def test_chain_is_compacted_past_max_chain_and_lineage_moves_parent(
        fake_fc: FakeFc, mspec: VmSpec, tmp_path: Path) -> None:
    driver = fake_fc.driver()
    base = await frozen_base(fake_fc, driver, mspec, tmp_path / "base")
    async with await driver.restore_memory(child_spec(mspec, base), base=base) as vm:
        fake_fc.guest_writes({40: 1})
        s1 = await vm.snapshot_memory(tmp_path / "s1", base=base, parent=None)
        fake_fc.guest_writes({41: 2})
        s2 = await vm.snapshot_memory(tmp_path / "s2", base=base, parent=s1, max_chain=1)
        assert len(s2.diffs) == 1
        with DiffFile.open(s2.diff) as d:
            assert d.header.kind is DiffKind.CUMULATIVE and list(d.indexes) == [40, 41]
        # Expressed on the bare base although the VM's dirty log runs from s2.
        fake_fc.guest_writes({42: 3})
        s3 = await vm.snapshot_memory(tmp_path / "s3", base=base, parent=None)
        with DiffFile.open(s3.diff) as d:
            assert list(d.indexes) == [40, 41, 42]
        # s1 is an ancestor of s3's lineage: a delta on it carries 41 and 42.
        fake_fc.guest_writes({43: 4})
        s4 = await vm.snapshot_memory(tmp_path / "s4", base=base, parent=s1)
        with DiffFile.open(s4.diff) as d:
            assert d.header.kind is DiffKind.DELTA and list(d.indexes) == [41, 42, 43]


async def test_snapshot_memory_refuses_what_it_cannot_express(
        fake_fc: FakeFc, mspec: VmSpec, tmp_path: Path) -> None:
    driver = fake_fc.driver()
    base = await frozen_base(fake_fc, driver, mspec, tmp_path / "base")
    other = await frozen_base(fake_fc, driver, mspec, tmp_path / "other", {1: 1})
    async with await driver.start(mspec) as fresh:
        with pytest.raises(VmmStateError, match="no memory lineage"):
            await fresh.snapshot_memory(tmp_path / "x", base=base, parent=None)
    async with await driver.restore_memory(child_spec(mspec, base), base=base) as vm:
        s1 = await vm.snapshot_memory(tmp_path / "s1", base=base, parent=None)
        fake_fc.clear()
        with pytest.raises(VmmSnapshotError, match="do not match the manifest"):
            await vm.snapshot_memory(tmp_path / "y", base=base,
                                     parent=_unrelated(s1, tmp_path / "fake-parent"))
        with pytest.raises(VmmSnapshotError, match="runs on base"):
            await vm.snapshot_memory(tmp_path / "z", base=other, parent=None)
        assert fake_fc.calls() == []  # refused before pausing: the dirty log is intact
        await vm.save_state(tmp_path / "whole.state")  # resets the dirty log
        with pytest.raises(VmmStateError, match="no memory lineage"):
            await vm.snapshot_memory(tmp_path / "w", base=base, parent=s1)
    untracked = fake_fc.driver(track_dirty_pages=False)
    async with await untracked.restore_memory(child_spec(mspec, base), base=base) as vm2:
        with pytest.raises(VmmStateError, match="dirty-page tracking"):
            await vm2.snapshot_memory(tmp_path / "v", base=base, parent=None)


def flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x55")


def _unrelated(snap: MemSnapshot, d: Path) -> MemSnapshot:
    d.mkdir()
    return MemSnapshot(d, snap.base_sha256, snap.config_sha256, snap.diffs,
                       (b"\1" * 32,), snap.devstate, snap.devstate_sha256)


async def test_restore_memory_checks_every_file_before_starting(
        fake_fc: FakeFc, mspec: VmSpec, tmp_path: Path) -> None:
    driver = fake_fc.driver()
    base = await frozen_base(fake_fc, driver, mspec, tmp_path / "base")
    async with await driver.restore_memory(child_spec(mspec, base), base=base) as vm:
        fake_fc.guest_writes({7: 7})
        s1 = await vm.snapshot_memory(tmp_path / "s1", base=base, parent=None)
    fake_fc.clear()
    bigger = VmSpec(kernel=mspec.kernel, mem_mib=32, disks=mspec.disks,
                    network=TapNet(tap="tap2", guest_ip="10.0.0.3"))
    with pytest.raises(VmmSnapshotError, match="another Firecracker configuration"):
        await driver.restore_memory(bigger, base=base, snapshot=s1)
    flip_last_byte(s1.diff)
    with pytest.raises(VmmSnapshotError, match="checksum mismatch"):
        await driver.restore_memory(child_spec(mspec, base), base=base, snapshot=s1)
    shared = VmSpec(kernel=mspec.kernel, mem_mib=16, network=None,
                    memory=MemoryBacking(path=base.mem_path, shared=True))
    with pytest.raises(Exception, match="copy-on-write"):
        await driver.restore_memory(shared, base=base)
    assert fake_fc.calls() == []
    fake_fc.assert_nothing_left()


async def test_adopted_vm_keeps_its_memory_lineage(fake_fc: FakeFc, mspec: VmSpec,
                                                  tmp_path: Path) -> None:
    driver = fake_fc.driver(die_with_parent=False)
    base = await frozen_base(fake_fc, driver, mspec, tmp_path / "base")
    spec = child_spec(mspec, base)
    vm = await driver.restore_memory(spec, base=base)
    fake_fc.guest_writes({11: 1})
    s1 = await vm.snapshot_memory(tmp_path / "s1", base=base, parent=None)
    facts = json.loads(json.dumps(vm.facts()))
    await vm.detach()
    vm2 = await driver.adopt(spec, facts)
    assert vm2 is not None
    try:
        fake_fc.guest_writes({12: 2})
        s2 = await vm2.snapshot_memory(tmp_path / "s2", base=base, parent=s1)
        with DiffFile.open(s2.diff) as d:
            assert list(d.indexes) == [12]
    finally:
        await vm2.kill()
    fake_fc.assert_nothing_left()


async def test_snapshot_on_another_branch_is_a_content_delta(
        fake_fc: FakeFc, mspec: VmSpec, tmp_path: Path) -> None:
    """A VM restored from s1 snapshotted onto s2 (a sibling line on the same base): the
    diff takes s2's view to this VM's memory, page content compared."""
    driver = fake_fc.driver()
    base, s1, s2 = await chain_of_two(fake_fc, driver, mspec, tmp_path,
                                      {20: 1, 21: 2}, {22: 3, 23: 4})
    async with await driver.restore_memory(child_spec(mspec, base), base=base,
                                           snapshot=s1) as b:
        fake_fc.guest_writes({23: 4, 24: 5})  # 23: same content as in s2
        s3 = await b.snapshot_memory(tmp_path / "s3", base=base, parent=s2)
        with DiffFile.open(s3.diff) as d:
            # 22 is back to the base's (zero) content, 24 is new; 20, 21, 23 agree.
            assert d.header.kind is DiffKind.DELTA and list(d.indexes) == [22, 24]
            assert d.page(22) == bytes(PAGE_SIZE)
        mine = await memory_of(b, tmp_path / "b-now")
    async with await driver.restore_memory(child_spec(mspec, base), base=base,
                                           snapshot=s3) as c:
        assert await memory_of(c, tmp_path / "c-now") == mine


def test_dirty_page_of_zeros_is_kept_and_holes_are_not_pages(tmp_path: Path) -> None:
    from host.vmm.firecracker import memory as fcmem

    f = tmp_path / "diff.mem"
    with open(f, "wb") as out:
        out.truncate(64 * PAGE_SIZE)
        out.seek(3 * PAGE_SIZE)
        out.write(fill(9))
        out.seek(7 * PAGE_SIZE)
        out.write(bytes(PAGE_SIZE))  # the guest zeroed this page: still dirty
    idx, data = fcmem.read_dirty_pages(f, 64 * PAGE_SIZE)
    assert list(idx) == [3, 7]
    assert bytes(data[:PAGE_SIZE]) == fill(9) and bytes(data[PAGE_SIZE:]) == bytes(PAGE_SIZE)


def test_filesystem_without_hole_reporting_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from host.vmm.firecracker import memory as fcmem
    from host.vmm.memsnap import MemSnapError

    f = tmp_path / "diff.mem"
    with open(f, "wb") as out:
        out.truncate(256 * PAGE_SIZE)
        out.seek(5 * PAGE_SIZE)
        out.write(fill(1))
    monkeypatch.setattr(fcmem, "data_extents", lambda fd, size: [(0, size)])
    with pytest.raises(MemSnapError, match="does not report holes"):
        fcmem.read_dirty_pages(f, 256 * PAGE_SIZE)


async def test_failing_while_stopped_resumes_and_leaves_no_snapshot(
        fake_fc: FakeFc, mspec: VmSpec, tmp_path: Path) -> None:
    driver = fake_fc.driver()
    base = await frozen_base(fake_fc, driver, mspec, tmp_path / "base")
    async with await driver.restore_memory(child_spec(mspec, base), base=base) as vm:

        async def cut_fails() -> None:
            raise RuntimeError("disk cut failed")

        with pytest.raises(RuntimeError, match="disk cut failed"):
            await vm.snapshot_memory(tmp_path / "s1", base=base, parent=None,
                                     while_stopped=cut_fails)
        assert vm.state is VmState.RUNNING
        assert list((tmp_path / "s1").iterdir()) == []
        assert not any(p.name.startswith("out-") for p in vm.work_dir.iterdir())
        # Firecracker's dirty log was reset by the snapshot that was then dropped.
        with pytest.raises(VmmStateError, match="no memory lineage"):
            await vm.snapshot_memory(tmp_path / "s2", base=base, parent=None)


async def test_start_timings_name_the_stages(fake_fc: FakeFc, mspec: VmSpec,
                                             tmp_path: Path) -> None:
    driver = fake_fc.driver()
    async with await driver.start(mspec) as fresh:
        assert set(fresh.start_timings) == {"vmm_ready_s"}
        base = await fresh.freeze_memory(tmp_path / "base")
    async with await driver.restore_memory(child_spec(mspec, base), base=base) as vm:
        t = vm.start_timings
        assert set(t) == {"vmm_ready_s", "restore_s"} and all(v > 0 for v in t.values())
