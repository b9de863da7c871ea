"""Incremental memory snapshots (memsnap) vs a full `migrate` snapshot of the same guest.

For K MiB written by the guest (default 16 and 64) in a 256 MiB guest, on one host in one run:

* snapshot downtime (stop -> guest running again) and total time (until files are durable):
  memsnap incremental vs full `migrate exec:cat > FILE` (the guest stays stopped throughout)
* restore (QEMU spawn -> guest shell answering): memsnap inject + devstate vs full stream
* QEMU spawn -> QMP ready, as the floor for any restore

Prints n, median and p95 per metric and the incremental/full ratios; samples and parameters
go to JSON (``--out``). Needs the project kernel (``make kernel``) and QEMU; runs under TCG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from host.vmm.memsnap import (
    BaseImage,
    CaptureBuffer,
    MemSnapshot,
    freeze_base,
    load_device_state,
    restore_base_into,
    restore_into,
    snapshot_incremental,
)
from host.vmm.memsnap.devstate import qmp_execute, wait_migration
from tests.vmm.memsnap.memsnap_vm import Vm, VmShape, build_rootfs, find_kernel, make_sparse

MIB = 1 << 20


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class Bench:
    def __init__(self, work: Path, shape: VmShape) -> None:
        self.work, self.shape, self.n = work, shape, 0
        self.samples: dict[str, list[float]] = {}

    def add(self, key: str, ms: float) -> None:
        self.samples.setdefault(key, []).append(ms)

    async def spawn(self, mem_path: Path, *, share: bool = False, incoming: bool = True) -> Vm:
        self.n += 1
        vm = await Vm.start(self.shape, self.work / f"v{self.n}", mem_path=mem_path, share=share,
                            incoming=incoming)
        self.add("qemu_spawn_to_qmp_ms", vm.timings["spawn_to_qmp_ms"])
        return vm


async def incr_sample(b: Bench, src: Vm, base: BaseImage, dest: Path, k: int, cfg: bytes,
                      buf: CaptureBuffer) -> MemSnapshot:
    # one directory per K, overwritten like the full snapshot's file: both then recycle page
    # cache instead of faulting in fresh host memory; one copy buffer per VM, as in the driver
    snap = await snapshot_incremental(src.qmp, src.pid, src.mem_path, base, dest,
                                      config_sha256=cfg, buffer=buf)
    b.add(f"K{k}_incr_snapshot_downtime_ms", snap.stats["downtime_ms"])
    b.add(f"K{k}_incr_snapshot_total_ms", snap.stats["total_ms"])
    b.add(f"K{k}_incr_diff_mib", snap.diff.stat().st_size / MIB)
    for part in ("prepare", "readv"):
        b.add(f"K{k}_incr_part_{part}_ms", snap.stats[f"{part}_ms"])
    b.add(f"K{k}_incr_part_write_ms",
          snap.stats["total_ms"] - snap.stats["prepare_ms"] - snap.stats["downtime_ms"])
    return snap


async def full_sample(b: Bench, src: Vm, full: Path, k: int) -> None:
    t0 = time.perf_counter()
    await qmp_execute(src.qmp, "stop")
    await qmp_execute(src.qmp, "migrate", {"uri": f"exec:cat > {full}"})
    await wait_migration(src.qmp)
    fd = os.open(full, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    t1 = time.perf_counter()
    await qmp_execute(src.qmp, "cont")
    # the guest is stopped until the stream is written: downtime == total
    b.add(f"K{k}_full_snapshot_downtime_ms", (time.perf_counter() - t0) * 1e3)
    b.add(f"K{k}_full_snapshot_total_ms", (t1 - t0) * 1e3)
    b.add(f"K{k}_full_mib", full.stat().st_size / MIB)


async def run(args: argparse.Namespace) -> dict[str, object]:
    kernel = find_kernel()
    if kernel is None:
        raise SystemExit("no project kernel: run `make kernel` first")
    work = Path(tempfile.mkdtemp(prefix="memsnap-bench-", dir=args.workdir))
    try:
        shape = VmShape(kernel, build_rootfs(work), mem_mib=args.mem_mib)
        cfg = shape.config_sha256()
        b = Bench(work, shape)
        scratch = make_sparse(work / "parent.mem", args.mem_mib * MIB)
        parent = await b.spawn(scratch, share=True, incoming=False)
        try:
            boot_s = await parent.wait_shell(timeout_s=120)
            base = await freeze_base(parent.qmp, scratch, work / "base")
        finally:
            await parent.kill()
        scratch.unlink()
        print(f"base frozen (boot to shell {boot_s:.2f} s), id {base.id[:16]}", flush=True)

        for k in args.k:
            src = await b.spawn(base.mem_path)
            buf = CaptureBuffer()
            try:
                await restore_base_into(src.qmp, src.pid, src.mem_path, base)
                await src.wait_shell()
                await src.sh(f"dd if=/dev/urandom of=/data/k bs=1M count={k} 2>/dev/null")
                want = (await src.sh("md5sum /data/k")).split()[0]
                snap = None
                full = work / f"full{k}.mig"

                # A and B interleaved, alternating which goes first, so load drift on a shared
                # host hits both alike
                for i in range(args.n):
                    if i % 2:
                        await full_sample(b, src, full, k)
                        await src.sh("true")
                        snap = await incr_sample(b, src, base, work / f"inc{k}", k, cfg, buf)
                    else:
                        snap = await incr_sample(b, src, base, work / f"inc{k}", k, cfg, buf)
                        await src.sh("true")
                        await full_sample(b, src, full, k)
                    await src.sh("true")
            finally:
                buf.close()
                await src.kill()
            assert snap is not None
            for i in range(args.n):
                vm = await b.spawn(base.mem_path)
                try:
                    st = await restore_into(vm.qmp, vm.pid, vm.mem_path, snap, base,
                                            config_sha256=cfg)
                    b.add(f"K{k}_incr_restore_part_inject_ms", st.inject_ms)
                    b.add(f"K{k}_incr_restore_part_load_ms", st.load_ms)
                    await vm.wait_shell()
                    b.add(f"K{k}_incr_restore_to_shell_ms", (time.perf_counter() - vm.t_spawn) * 1e3)
                    if i == 0 and (await vm.sh("md5sum /data/k")).split()[0] != want:
                        raise SystemExit("incremental restore: guest data differ")
                finally:
                    await vm.kill()
                vm = await b.spawn(base.mem_path)
                try:
                    await load_device_state(vm.qmp, full)
                    await qmp_execute(vm.qmp, "cont")
                    await vm.wait_shell()
                    b.add(f"K{k}_full_restore_to_shell_ms", (time.perf_counter() - vm.t_spawn) * 1e3)
                    if i == 0 and (await vm.sh("md5sum /data/k")).split()[0] != want:
                        raise SystemExit("full restore: guest data differ")
                finally:
                    await vm.kill()
            print(f"K={k} MiB done", flush=True)
        return {
            "params": {"k_mib": args.k, "mem_mib": args.mem_mib, "n": args.n, "accel": "tcg",
                       "vcpus": 1, "kernel": str(kernel), "host": platform.node(),
                       "cpus": os.cpu_count()},
            "samples": b.samples,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(res: dict[str, object]) -> None:
    samples: dict[str, list[float]] = res["samples"]  # type: ignore[assignment]
    print(f"\n{'metric':40s} {'n':>3s} {'median':>10s} {'p95':>10s}")
    for key, xs in samples.items():
        print(f"{key:40s} {len(xs):3d} {statistics.median(xs):10.1f} {pct(xs, 0.95):10.1f}")
    med = {k: statistics.median(v) for k, v in samples.items()}
    print()
    for k in res["params"]["k_mib"]:  # type: ignore[index]
        for what in ("snapshot_downtime", "snapshot_total", "restore_to_shell"):
            a, f = med[f"K{k}_incr_{what}_ms"], med[f"K{k}_full_{what}_ms"]
            print(f"K={k:3d} MiB {what:18s} incremental/full median {a / f:5.2f}x  ({a:.1f} vs {f:.1f} ms)")
        r = med[f"K{k}_incr_restore_to_shell_ms"] / med["qemu_spawn_to_qmp_ms"]
        print(f"K={k:3d} MiB restore_to_shell / qemu spawn->QMP   {r:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[16, 64], help="MiB the guest writes")
    ap.add_argument("--mem-mib", type=int, default=256)
    ap.add_argument("-n", type=int, default=5, help="samples per metric")
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "memsnap.json"))
    args = ap.parse_args()
    res = asyncio.run(run(args))
    report(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nsamples: {out}")


if __name__ == "__main__":
    main()
