"""Cold boot benchmark for the QEMU driver on this machine's accelerator.

Measures, over N cold boots (p50 / p95):
  floor  QEMU process start -> QMP negotiated (what any VM costs before the guest runs)
  boot   QEMU process start -> envd GET /health answers (cold boot of the built image)
and prints boot/floor. With --restore it also measures
  restore  QEMU start from a full snapshot (device state + shared memory file, restored
           copy-on-write) -> envd answers, and prints boot/restore.
Samples and parameters go to JSON (--json, default out/bench/boot.json).

    .venv/bin/python bench/bench_boot.py [-n 5] [--image NAME]
    .venv/bin/python bench/bench_boot.py --kernel K --rootfs R --cmdline "..."   # any guest
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from host.vmm import FileDisk, MemoryBacking, QemuDriver, VmSpec
from host.vmm.image import find_image


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    return statistics.quantiles(s, n=100, method="inclusive")[int(q) - 1]


async def one_boot(driver: QemuDriver, spec: VmSpec, timeout_s: float) -> tuple[float, float]:
    vm = await driver.start(spec)
    try:
        await vm.wait_for_envd(timeout_s)
        loop = asyncio.get_running_loop()
        assert vm.started_at is not None and vm.qmp_ready_s is not None
        return vm.qmp_ready_s, loop.time() - vm.started_at
    finally:
        await vm.kill()


async def restores(driver: QemuDriver, spec: VmSpec, n: int, scratch: Path,
                   timeout_s: float) -> list[float]:
    """Boot once with RAM in a shared file, snapshot, then restore n times (each with its
    own copy of the disk as it was at save time, RAM mapped copy-on-write)."""
    mem = scratch / "guest.mem"
    parent = dataclasses.replace(spec, memory=MemoryBacking(path=mem, shared=True))
    state = scratch / "vm.state"
    vm = await driver.start(parent)
    try:
        await vm.wait_for_envd(timeout_s)
        await vm.save_state(state)
    finally:
        await vm.kill()
    root = spec.disks[0]
    assert isinstance(root, FileDisk)
    samples = []
    for i in range(n):
        disk = scratch / f"restore-{i}.{root.format}"
        shutil.copyfile(root.path, disk)
        child = dataclasses.replace(spec, disks=(dataclasses.replace(root, path=disk),),
                                    memory=MemoryBacking(path=mem, shared=False))
        child_vm = await driver.restore(child, state)
        try:
            await child_vm.wait_for_envd(timeout_s)
            assert child_vm.started_at is not None
            samples.append(asyncio.get_running_loop().time() - child_vm.started_at)
        finally:
            await child_vm.kill()
        disk.unlink()
        print(f"  restore {i + 1}/{n}: envd {samples[-1]:6.2f} s", flush=True)
    return samples


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--image", default=None, help="image name under $AENV_CACHE/images")
    ap.add_argument("--kernel", type=Path)
    ap.add_argument("--rootfs", type=Path, help="raw ext4 root disk (with --kernel)")
    ap.add_argument("--cmdline", default="root=/dev/vda rw quiet")
    ap.add_argument("--mem-mib", type=int, default=512)
    ap.add_argument("--vcpus", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--restore", action="store_true", help="also measure snapshot restore")
    ap.add_argument("--tcg-tb-mib", type=int, default=None,
                    help="under TCG, the VM's translated-code buffer (default: the driver's)")
    ap.add_argument("--json", type=Path, default=REPO / "out/bench/boot.json")
    args = ap.parse_args()

    scratch: Path | None = None
    if args.kernel:
        disks = (FileDisk(path=args.rootfs),) if args.rootfs else ()
        spec = VmSpec(kernel=args.kernel, cmdline=args.cmdline, disks=disks,
                      mem_mib=args.mem_mib, vcpus=args.vcpus, name="bench-boot")
        guest = {"kernel": str(args.kernel), "rootfs": str(args.rootfs), "cmdline": args.cmdline}
    else:
        image = find_image(args.image)
        # a fresh overlay per run: every boot starts from the same disk state
        scratch = Path(tempfile.mkdtemp(prefix="bench-boot-"))
        root = image.overlay(scratch / "root.qcow2")
        spec = image.vm_spec(root=root, mem_mib=args.mem_mib, vcpus=args.vcpus,
                             name="bench-boot")
        guest = {"image": image.name, "kernel": str(image.kernel.vmlinux),
                 "kernel_release": image.kernel.release, "cmdline": spec.cmdline}

    driver = QemuDriver(tcg_tb_mib=args.tcg_tb_mib)
    accel, tsc_khz = await driver.accel()
    floors: list[float] = []
    boots: list[float] = []
    restored: list[float] = []
    try:
        for i in range(args.n):
            floor, boot = await one_boot(driver, spec, args.timeout)
            floors.append(floor)
            boots.append(boot)
            print(f"  boot {i + 1}/{args.n}: qmp {floor * 1000:7.1f} ms   envd {boot:6.2f} s",
                  flush=True)
        if args.restore:
            if scratch is None:
                scratch = Path(tempfile.mkdtemp(prefix="bench-boot-"))
            restored = await restores(driver, spec, args.n, scratch, args.timeout)
    finally:
        await driver.aclose()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    f50, b50 = statistics.median(floors), statistics.median(boots)
    print(f"driver qemu, accel {accel}, vcpus {args.vcpus}, mem {args.mem_mib} MiB, n={args.n}")
    print(f"  floor (start -> QMP ready)    p50 {f50 * 1000:8.1f} ms   p95 "
          f"{pct(floors, 95) * 1000:8.1f} ms")
    print(f"  cold boot (start -> envd ok)  p50 {b50 * 1000:8.1f} ms   p95 "
          f"{pct(boots, 95) * 1000:8.1f} ms")
    print(f"  cold boot / floor  median {b50 / f50:.1f}x")
    r50 = statistics.median(restored) if restored else None
    if r50 is not None:
        print(f"  restore (start -> envd ok)    p50 {r50 * 1000:8.1f} ms   p95 "
              f"{pct(restored, 95) * 1000:8.1f} ms")
        print(f"  cold boot / restore  median {b50 / r50:.1f}x")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "bench": "boot", "driver": "qemu", "accel": accel, "tsc_khz": tsc_khz,
        "vcpus": args.vcpus, "mem_mib": args.mem_mib, "n": args.n, "guest": guest,
        "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "floor_s": floors, "boot_s": boots,
        "floor_p50_s": f50, "boot_p50_s": b50, "ratio_p50": b50 / f50,
        "restore_s": restored, "restore_p50_s": r50,
    }, indent=2) + "\n")
    print(f"  samples: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
