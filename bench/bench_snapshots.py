"""Sandbox snapshots through NodeRuntime (host/runtime) on real QEMU VMs, per guest size.

For each guest RAM size (default 256 and 1024 MiB), in one run on one host:

* cold boot of the template (QEMU spawn -> envd /health) and QEMU spawn -> QMP ready
* pause: snapshot(stop=True) wall time (memory diff + disk seal + manifest + teardown)
* resume: start() from the pause snapshot until envd answers /health (and its QMP-ready part)
* incremental snapshot under a guest disk-write load: snapshot(stop=False) wall time and
  the guest's downtime (stop -> cont), p50 of `--snaps`
* fork: snapshot(stop=False) of a parent, then `--forks` concurrent start()s: total time,
  per child, and PSS per child (/proc/PID/smaps_rollup) next to one child's RSS

Prints p50 (and n) per metric; `--out` writes samples as JSON. Needs `make kernel image`,
root (namespaces) and QEMU. Under TCG on 2 cores: keep `--forks` modest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from host.contract import MachineSpec
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime, RuntimeConfig
from host.vmm.accel import detect_accel
from tests.runtime.helpers import background, pss_kib, run, write

NET = NetworkConfig()
WRITER = ("i=0; while :; do printf 'rec %08d 0123456789abcdef\\n' $i >> /home/user/log; "
          "sync /home/user/log; i=$((i+1)); done\n")
BULK = ("while :; do dd if=/dev/urandom of=/home/user/big bs=1M count=8 conv=fsync "
        "2>/dev/null; done\n")


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def bench_size(rt: NodeRuntime, mem_mib: int, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"mem_mib": mem_mib}
    tpl_id = f"b{mem_mib}"
    t0 = time.perf_counter()
    tpl = await rt.build_template(tpl_id, MachineSpec(cpu_count=1, memory_mb=mem_mib))
    t = tpl.facts["timings"]
    res["template_build_s"] = time.perf_counter() - t0
    res["cold_boot_s"] = t["cold_boot_s"]
    res["cold_qmp_ready_s"] = t["vmm_ready_s"]
    snaps: list[str] = []

    # pause / resume cycles
    sid = f"b{mem_mib}-pr"
    p = await rt.start(sid, tpl, NET)
    res["start_from_template_s"] = p.facts["timings"]["total_s"]
    await background(p, "sleep 100000")
    pause, resume, qmp_ready, restore = [], [], [], []
    try:
        for i in range(args.cycles):
            await run(p, f"head -c 4M /dev/urandom > /dev/shm/c{i % 2}")
            t0 = time.perf_counter()
            ref = await rt.snapshot(sid, f"{sid}-{i}", stop=True)
            pause.append(time.perf_counter() - t0)
            snaps.append(ref.snapshot_id)
            t0 = time.perf_counter()
            p = await rt.start(sid, ref, NET)
            resume.append(time.perf_counter() - t0)
            qmp_ready.append(p.facts["timings"]["vmm_ready_s"])
            restore.append(p.facts["timings"]["restore_s"])
    finally:
        await rt.kill(sid)
    res.update(pause_s=pause, resume_s=resume, resume_qmp_ready_s=qmp_ready,
               resume_memrestore_s=restore)

    # incremental snapshots under a guest disk-write load (the VM keeps running)
    sid = f"b{mem_mib}-io"
    p = await rt.start(sid, tpl, NET)
    inc, down, pages = [], [], []
    try:
        await write(p, "/home/user/w.sh", WRITER)
        await write(p, "/home/user/b.sh", BULK)
        await background(p, "bash /home/user/w.sh")
        await background(p, "bash /home/user/b.sh")
        await asyncio.sleep(2)
        for i in range(args.snaps):
            t0 = time.perf_counter()
            ref = await rt.snapshot(sid, f"{sid}-{i}", stop=False)
            inc.append(time.perf_counter() - t0)
            down.append(ref.facts["timings"]["downtime_s"])
            pages.append(ref.facts["timings"]["diff_pages"])
            snaps.append(ref.snapshot_id)
            await asyncio.sleep(1)
    finally:
        await rt.kill(sid)
    res.update(incremental_s=inc, incremental_downtime_s=down, incremental_diff_pages=pages)

    # fork: parent + N concurrent children
    parent = f"b{mem_mib}-fp"
    kids = [f"b{mem_mib}-k{i}" for i in range(args.forks)]
    p = await rt.start(parent, tpl, NET)
    try:
        await write(p, "/home/user/f.txt", "x")
        t0 = time.perf_counter()
        ref = await rt.snapshot(parent, f"{parent}-fork", stop=False)
        res["fork_snapshot_s"] = time.perf_counter() - t0
        snaps.append(ref.snapshot_id)
        t0 = time.perf_counter()
        got = await asyncio.gather(*(rt.start(k, ref, NET) for k in kids),
                                   return_exceptions=True)
        res["fork_total_s"] = time.perf_counter() - t0
        res["fork_children"] = args.forks
        res["fork_failed"] = [repr(g) for g in got if isinstance(g, BaseException)]
        ok = [k for k, g in zip(kids, got, strict=True) if not isinstance(g, BaseException)]
        res["fork_ok"] = len(ok)
        res["fork_per_child_s"] = res["fork_total_s"] / max(1, len(ok))
        await asyncio.sleep(1)
        rp = [pss_kib(rt.vm_pid(k)) for k in ok]
        res["child_rss_kib"] = [r for r, _ in rp]
        res["child_pss_kib"] = [q for _, q in rp]
    finally:
        for s in (parent, *kids):
            await rt.kill(s)
    for s in snaps:
        await rt.delete_snapshot(s)
    await rt.delete_snapshot(tpl_id)
    return res


def report(r: dict[str, Any]) -> None:
    ms = lambda x: f"{x * 1e3:8.0f} ms"
    print(f"\n== guest {r['mem_mib']} MiB ==")
    print(f"cold boot (spawn -> envd)        {ms(r['cold_boot_s'])}")
    print(f"cold QEMU spawn -> QMP ready     {ms(r['cold_qmp_ready_s'])}")
    print(f"start from template              {ms(r['start_from_template_s'])}")
    print(f"pause p50 (n={len(r['pause_s'])})              {ms(p50(r['pause_s']))}")
    print(f"resume -> envd p50               {ms(p50(r['resume_s']))}   "
          f"(QMP ready {ms(p50(r['resume_qmp_ready_s'])).strip()}, memory restore "
          f"{ms(p50(r['resume_memrestore_s'])).strip()})")
    print(f"incremental snap under IO p50    {ms(p50(r['incremental_s']))}   "
          f"(downtime {ms(p50(r['incremental_downtime_s'])).strip()}, diff "
          f"{p50(r['incremental_diff_pages']) * 4 / 1024:.1f} MiB)")
    print(f"fork {r['fork_ok']}/{r['fork_children']} children total        "
          f"{ms(r['fork_total_s'])}   per child {ms(r['fork_per_child_s']).strip()}")
    if r["child_pss_kib"]:
        print(f"PSS per child (mean)             {statistics.mean(r['child_pss_kib']) / 1024:8.1f} MiB"
              f"   (one child's RSS {max(r['child_rss_kib']) / 1024:.1f} MiB)")
    if r["fork_failed"]:
        print(f"fork failures: {r['fork_failed'][:3]}")


async def amain(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="aenv-bsnap-", dir="/var/tmp"))
    cfg = RuntimeConfig(state_dir=work / "state", run_dir=Path(f"/tmp/aenv-bsnap-{work.name[-8:]}"),
                        vms_survive_service=False)
    rt = await NodeRuntime(cfg).open()
    results = []
    try:
        print(f"host: {platform.node()} {platform.machine()}, network {rt.mode}, accel "
              f"{detect_accel().name}, vmm {rt.vmm}")
        for mem in args.mem:
            r = await bench_size(rt, mem, args)
            report(r)
            results.append(r)
    finally:
        await rt.shutdown()
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mem", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--cycles", type=int, default=5, help="pause/resume cycles")
    ap.add_argument("--snaps", type=int, default=5, help="incremental snapshots under IO")
    ap.add_argument("--forks", type=int, default=16)
    ap.add_argument("--out", default=None)
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    main()
