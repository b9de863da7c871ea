"""memsnap with real QEMU microVMs (TCG): freeze a base, snapshot children incrementally,
restore them, chain two levels, reject corrupted snapshots, share memory between children.

Guest: the project kernel (``kernel/build.sh``) with a busybox root; guest data lives on a
tmpfs, so it is in guest RAM. Without the kernel, only the kernel-less test runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import re
import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from host.vmm.memsnap import (
    BaseImage,
    CorruptSnapshotError,
    MemSnapError,
    MemSnapshot,
    SnapshotMismatchError,
    capture_private,
    find_vma,
    flatten_base,
    freeze_base,
    restore_base_into,
    restore_into,
    snapshot_incremental,
)
from host.vmm.memsnap.devstate import qmp_execute
from host.vmm.memsnap.procmem import buffer_address, transfer
from tests.vmassets import require_vm_assets

from .memsnap_vm import Vm, VmShape, build_rootfs, find_kernel, make_sparse, smaps_rollup

pytestmark = [pytest.mark.vm]
MIB = 1 << 20
_vm_ids = itertools.count(1)  # short work dirs: unix socket paths are limited to 107 bytes


@dataclasses.dataclass
class Family:
    shape: VmShape
    base: BaseImage
    base_md5: str
    work: Path

    @property
    def cfg(self) -> bytes:
        return self.shape.config_sha256()


class Pool:
    """Spawns children of one family; ``close()`` kills every VM it made."""

    def __init__(self, fam: Family) -> None:
        self.fam = fam
        self.vms: list[Vm] = []

    async def spawn(self) -> Vm:
        vm = await Vm.start(self.fam.shape, self.fam.work / f"vm{next(_vm_ids)}",
                            mem_path=self.fam.base.mem_path, share=False, incoming=True)
        self.vms.append(vm)
        return vm

    async def from_base(self) -> Vm:
        vm = await self.spawn()
        await restore_base_into(vm.qmp, vm.pid, vm.mem_path, self.fam.base)
        await vm.wait_shell()
        return vm

    async def restored(self, snap: MemSnapshot) -> Vm:
        """Spawn + restore; on failure the VM is killed before the error propagates."""
        vm = await self.spawn()
        try:
            await restore_into(vm.qmp, vm.pid, vm.mem_path, snap, self.fam.base,
                               config_sha256=self.fam.cfg)
        except BaseException:
            await vm.kill()
            raise
        await vm.wait_shell()
        return vm

    async def close(self) -> None:
        for vm in self.vms:
            await vm.kill()


@asynccontextmanager
async def pool(fam: Family) -> AsyncIterator[Pool]:
    p = Pool(fam)
    try:
        yield p
    finally:
        await p.close()


def md5s(out: str) -> dict[str, str]:
    return {m.group(2): m.group(1) for m in re.finditer(r"([0-9a-f]{32})\s+(\S+)", out)}


async def _make_family(work: Path) -> Family:
    kernel = find_kernel()
    assert kernel is not None
    shape = VmShape(kernel, build_rootfs(work), mem_mib=256)
    scratch = make_sparse(work / "parent.mem", 256 * MIB)
    parent = await Vm.start(shape, work / "parent", mem_path=scratch, share=True, incoming=False)
    try:
        await parent.wait_shell(timeout_s=120)
        await parent.sh("dd if=/dev/urandom of=/data/base bs=1M count=4 2>/dev/null")
        base_md5 = md5s(await parent.sh("md5sum /data/base"))["/data/base"]
        base = await freeze_base(parent.qmp, scratch, work / "base")
    finally:
        await parent.kill()
    scratch.unlink()
    return Family(shape, base, base_md5, work)


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """A frozen 256 MiB base (booted busybox guest, 4 MiB in /data/base); parent VM gone."""
    require_vm_assets()
    if find_kernel() is None:
        pytest.fail("no project kernel: run `make kernel` (kernel/build.sh)", pytrace=False)
    if shutil.which("busybox") is None or shutil.which("mkfs.ext4") is None:
        pytest.fail("busybox-static and e2fsprogs are needed for the guest root (make setup)",
                    pytrace=False)
    work = tmp_path_factory.mktemp("memsnap-vm")
    yield asyncio.run(_make_family(work))
    shutil.rmtree(work, ignore_errors=True)


async def test_incremental_snapshot_restore_and_two_level_chain(family: Family, tmp_path: Path) -> None:
    k = 16
    async with pool(family) as p:
        a = await p.from_base()
        await a.sh(f"dd if=/dev/urandom of=/data/k bs=1M count={k} 2>/dev/null")
        sums_a = md5s(await a.sh("md5sum /data/k /data/base"))
        assert sums_a["/data/base"] == family.base_md5
        s1 = await snapshot_incremental(a.qmp, a.pid, a.mem_path, family.base, tmp_path / "s1",
                                        config_sha256=family.cfg)
        diff_mib = s1.diff.stat().st_size / MIB
        # ~K MiB (+ guest noise: page cache, slab, hot kernel pages), not the 256 MiB of RAM
        assert k <= diff_mib <= k + 12, s1.stats
        assert s1.stats["downtime_ms"] < s1.stats["total_ms"]
        assert (await qmp_execute(a.qmp, "query-status"))["status"] == "running"
        await a.sh("true")  # the source keeps running after the snapshot
        await a.kill()

        b = await p.restored(s1)
        assert md5s(await b.sh("md5sum /data/k /data/base")) == sums_a
        # level 2: new data and a few changed pages of the old file
        await b.sh("dd if=/dev/urandom of=/data/k2 bs=1M count=4 2>/dev/null")
        await b.sh("dd if=/dev/urandom of=/data/k bs=4k count=64 seek=100 conv=notrunc 2>/dev/null")
        sums_b = md5s(await b.sh("md5sum /data/k /data/k2 /data/base"))
        assert sums_b["/data/k"] != sums_a["/data/k"]
        # a pause: the guest stays stopped and the copy goes through page cache (an
        # unlinked file), not an anonymous buffer; nothing of it is left
        s2 = await snapshot_incremental(b.qmp, b.pid, b.mem_path, family.base, tmp_path / "s2",
                                        config_sha256=family.cfg, parent=s1, resume=False,
                                        spill_over=0)
        assert (await qmp_execute(b.qmp, "query-status"))["status"] == "paused"
        assert s2.stats["spilled"] == 1.0
        assert sorted(f.name for f in (tmp_path / "s2").iterdir()) == [
            "devstate.bin", "mem.diff", "snapshot.json"]
        assert len(s2.diffs) == 2 and s2.diffs[0] == s1.diff
        delta_mib = s2.stats["diff_pages"] * 4096 / MIB
        assert 4 <= delta_mib <= 4 + 8, s2.stats  # the content delta, not the cumulative set
        assert s2.stats["captured_pages"] > s1.stats["captured_pages"]
        await b.kill()

        c = await p.restored(MemSnapshot.load(tmp_path / "s2"))
        assert md5s(await c.sh("md5sum /data/k /data/k2 /data/base")) == sums_b
        await c.sh("echo alive > /data/x && cat /data/x")


async def test_corrupted_or_foreign_snapshot_fails_restore_and_leaves_no_process(
    family: Family, tmp_path: Path
) -> None:
    async with pool(family) as p:
        a = await p.from_base()
        await a.sh("dd if=/dev/urandom of=/data/k bs=1M count=1 2>/dev/null")
        snap = await snapshot_incremental(a.qmp, a.pid, a.mem_path, family.base, tmp_path / "s",
                                          config_sha256=family.cfg)
        await a.kill()
        bad = tmp_path / "bad.diff"
        raw = bytearray(snap.diff.read_bytes())
        raw[-100] ^= 0xFF
        bad.write_bytes(bytes(raw))
        cases = [
            (dataclasses.replace(snap, diffs=(bad,)), CorruptSnapshotError, "checksum"),
            (dataclasses.replace(snap, base_sha256=bytes(32)), SnapshotMismatchError, "base"),
            (dataclasses.replace(snap, config_sha256=bytes(32)), SnapshotMismatchError, "configuration"),
        ]
        truncated = tmp_path / "trunc.diff"
        truncated.write_bytes(snap.diff.read_bytes()[:-4096])
        cases.append((dataclasses.replace(snap, diffs=(truncated,)), CorruptSnapshotError, "truncated"))
        dev = tmp_path / "dev.bin"
        dev.write_bytes(snap.devstate.read_bytes()[:-10])
        cases.append((dataclasses.replace(snap, devstate=dev), CorruptSnapshotError, "device state"))
        for bad_snap, exc, match in cases:
            with pytest.raises(exc, match=match):
                await p.restored(bad_snap)
            vm = p.vms[-1]
            assert vm.proc is not None and vm.proc.poll() is not None
            assert not os.path.exists(f"/proc/{vm.pid}")
        # the good snapshot still restores
        b = await p.restored(snap)
        await b.sh("md5sum /data/k")


async def test_children_share_the_base(family: Family) -> None:
    async with pool(family) as p:
        kids = [await p.from_base() for _ in range(4)]
        for vm in kids:
            await vm.sh("md5sum /data/base")
        stats = [smaps_rollup(vm.pid) for vm in kids]
        pss = sum(s["Pss"] for s in stats)
        rss = max(s["Rss"] for s in stats)
        private = [capture_private(vm.pid, find_vma(vm.pid, vm.mem_path)).count for vm in kids]
        print(f"\n4 children: PSS sum {pss / 1024:.1f} MiB, one child's RSS {rss / 1024:.1f} MiB, "
              f"private guest pages {private}")
        assert pss < 0.7 * 4 * rss, stats  # measured ~0.5: base pages are shared
        assert all(n * 4096 < 8 * MIB for n in private)


async def test_qemu_streams_without_a_guest_kernel(tmp_path: Path) -> None:
    """The QMP/stream side alone (no kernel needed): freeze, start from base, host-written
    pages -> snapshot -> restore into a new QEMU, RAM equal; a share=on child is refused.
    The children's vCPUs never run: with no kernel the firmware's path ends in a reset,
    which under -no-reboot made a child exit at a moment the host's load decided."""
    kernel = find_kernel() or Path("/nonexistent")

    class Bare(VmShape):
        def argv(self, **kw):  # type: ignore[no-untyped-def]
            a = super().argv(**kw)
            for opt in ("-kernel", "-append", "-drive", "-device"):
                i = a.index(opt)
                del a[i : i + 2]
            return a

    shape = Bare(kernel, tmp_path / "unused", mem_mib=64)
    scratch = make_sparse(tmp_path / "p.mem", 64 * MIB)
    parent = await Vm.start(shape, tmp_path / "p", mem_path=scratch, share=True, incoming=False)
    try:
        base = await freeze_base(parent.qmp, scratch, tmp_path / "base")
        with pytest.raises(MemSnapError, match="shared"):
            capture_private(parent.pid, find_vma(parent.pid, scratch))
    finally:
        await parent.kill()
    assert oct(base.mem_path.stat().st_mode & 0o777) == "0o444"
    fam = Family(shape, base, "", tmp_path)
    async with pool(fam) as p:
        a = await p.spawn()
        await restore_base_into(a.qmp, a.pid, a.mem_path, base, resume=False)
        pages = bytearray(os.urandom(50 * 4096))
        vma = find_vma(a.pid, a.mem_path)
        addr, pin = buffer_address(pages)
        transfer(a.pid, [(addr + i * 4096, vma.start + (2000 + 5 * i) * 4096, 4096) for i in range(50)],
                 write=True)
        del pin
        snap = await snapshot_incremental(a.qmp, a.pid, a.mem_path, base, tmp_path / "s",
                                          config_sha256=fam.cfg)
        b = await p.spawn()
        st = await restore_into(b.qmp, b.pid, b.mem_path, snap, base, config_sha256=fam.cfg,
                                resume=False)
        assert st.pages == snap.stats["diff_pages"] >= 50
        ca = capture_private(a.pid, find_vma(a.pid, a.mem_path))
        cb = capture_private(b.pid, find_vma(b.pid, b.mem_path))
        ia, ib = list(ca.indexes), list(cb.indexes)
        for i in range(50):
            pg = 2000 + 5 * i
            want = pages[i * 4096 : (i + 1) * 4096]
            assert ca.data[ia.index(pg) * 4096 :][:4096] == want
            assert cb.data[ib.index(pg) * 4096 :][:4096] == want
        assert (await qmp_execute(b.qmp, "query-status"))["status"] == "paused"


async def test_flattened_base_resumes_the_snapshot_and_takes_new_diffs(
    family: Family, tmp_path: Path
) -> None:
    async with pool(family) as p:
        a = await p.from_base()
        await a.sh("dd if=/dev/urandom of=/data/k bs=1M count=8 2>/dev/null")
        sums = md5s(await a.sh("md5sum /data/k /data/base"))
        snap = await snapshot_incremental(a.qmp, a.pid, a.mem_path, family.base, tmp_path / "s",
                                          config_sha256=family.cfg)
        await a.kill()
        new = await asyncio.to_thread(flatten_base, snap, family.base, tmp_path / "base2")
        fam2 = Family(family.shape, new, family.base_md5, family.work)
        async with pool(fam2) as p2:
            b = await p2.from_base()
            assert md5s(await b.sh("md5sum /data/k /data/base")) == sums
            await b.sh("dd if=/dev/urandom of=/data/k2 bs=1M count=2 2>/dev/null")
            sums2 = md5s(await b.sh("md5sum /data/k /data/k2"))
            s2 = await snapshot_incremental(b.qmp, b.pid, b.mem_path, new, tmp_path / "s2",
                                            config_sha256=family.cfg)
            print(f"\ndiff on the flattened base: {s2.diff.stat().st_size / MIB:.1f} MiB")
            assert s2.diff.stat().st_size < (2 + 6) * MIB, s2.stats  # 2 MiB + noise, not 8 again
            await b.kill()
            c = await p2.restored(s2)
            assert md5s(await c.sh("md5sum /data/k /data/k2")) == sums2
