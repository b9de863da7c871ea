"""Fork after real setup against fork of an idle sandbox (issue 30), through NodeRuntime
(host/runtime) on real QEMU VMs, in one run on one host.

Rows, each a parent started from the same template and forked into `--children`:

* idle         the anchor: a parent that ran one command
* wrote        a parent that wrote 200 MiB to its disk and synced (the guest's page cache
               holds what it wrote: the case the issue measured at 4.3x idle), snapshot
               as it is: the previous path
* reclaimed    the same, but the guest drops its clean page cache first (envd's
               /aenv/reclaim, what the orchestrator does before every memory snapshot)
               and the cut waits for its free-page reports (`reclaim`; asked only when
               the guest's private memory is worth it, so the idle row skips it)
* no prehash   `reclaimed` without the block server's prehash (the previous seal: the
               disk upper, whose running digest the guest's in-place rewrites voided, is
               hashed whole while the guest is stopped); every other row prehashes
* paused xN    a parent paused and resumed `--cycles` times first (a long memory chain,
               which compaction keeps short)
* in RAM       a parent whose setup left 200 MiB in guest RAM (a tmpfs file: what no
               reclaim drops, like a loaded dataset or model), its children sharing one
               memory image (runtime/forkimages.py: base + diff flattened once, mapped
               copy-on-write by every child)
* in RAM, copy the same, each child with the diff written into its own RAM (the previous
               path: `fork_share_min_mib` 0)

Every fork starts its children with `fanout` = their count, as the orchestrator does; a row
whose diff is under `fork_share_min_mib` (64 MiB) per child injects it as before.

Per row: the live snapshot (wall, guest downtime, memory pages in its diff), the
children's restores (wall until every child's envd answered), their p50 stages, the ratio
of the fork (snapshot + children) to the idle row's, whether the children shared an image,
and the host memory the children hold: the sum of their QEMUs' PSS, and of their private
guest RAM (pages no other process maps). Needs `make kernel image`,
root and QEMU; under TCG on 2 cores every number is noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from host.orchestrator.envd import EnvdClient
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime, RuntimeConfig
from tests.runtime.helpers import pss_kib, run

NET = NetworkConfig()
WRITE = "dd if=/dev/urandom of=/home/user/big bs=1M count=200 status=none && sync"
IN_RAM = "head -c 200M /dev/urandom > /dev/shm/blob"


async def fork_row(rt: NodeRuntime, tpl: Any, name: str, children: int,
                   setup: Any, reclaim: bool = False, prehash: bool = True,
                   share: bool = True) -> dict[str, Any]:
    parent = f"{name}-p"
    p = await rt.start(parent, tpl, NET)
    kids = [f"{name}-k{i}" for i in range(children)]
    try:
        p = await setup(rt, tpl, parent, p)
        envd = EnvdClient()

        async def ask() -> int:  # what the orchestrator's reclaim does (no token here)
            return await envd.reclaim(p, None)

        client = rt.parts.block.client
        if not prehash:
            client.prehash = _no_prehash  # type: ignore[method-assign]
        t0 = time.perf_counter()
        try:
            ref = await rt.snapshot(parent, f"{name}-fork", stop=False,
                                    reclaim=ask if reclaim else None)
        finally:
            await envd.aclose()
            vars(client).pop("prehash", None)
        snap_s = time.perf_counter() - t0
        forks = rt.parts.forks
        min_mib, forks.min_mib = forks.min_mib, (forks.min_mib if share else 0)
        made = forks.made
        t1 = time.perf_counter()
        try:
            got = await asyncio.gather(*(rt.start(k, ref, NET, fanout=children) for k in kids),
                                       return_exceptions=True)
        finally:
            forks.min_mib = min_mib
        restore_s = time.perf_counter() - t1
        failed = [repr(g) for g in got if isinstance(g, BaseException)]
        up = [k for k, g in zip(kids, got, strict=True) if not isinstance(g, BaseException)]
        pss_mib = sum(pss_kib(rt.vm_pid(k))[1] for k in up) / 1024
        private = [await rt.parts.sandboxes[k].vm.private_memory_mib() for k in up]
        stages: dict[str, list[float]] = {}
        for g in got:
            if not isinstance(g, BaseException):
                for k, v in g.facts["timings"].items():
                    if k.endswith("_s"):
                        stages.setdefault(k, []).append(v)
        t = ref.facts["timings"]
        return {"row": name, "snapshot_s": snap_s, "downtime_s": t.get("downtime_s", 0.0),
                "freed_mib": t.get("freed_mib", 0.0), "returned_mib": t.get("returned_mib", 0.0),
                "reclaim_s": t.get("reclaim_s", 0.0),
                "diff_pages": t.get("diff_pages", 0.0), "restore_s": restore_s,
                "fork_s": snap_s + restore_s, "children_ok": children - len(failed),
                "shared": forks.made > made, "children_pss_mib": pss_mib,
                "children_private_mib": sum(m or 0 for m in private),
                "failed": failed[:3],
                "snapshot_ms": {k[:-2]: round(v * 1e3) for k, v in t.items()
                                if k.endswith("_s") and k != "total_s"},
                "child_p50_ms": {k[:-2]: round(statistics.median(v) * 1e3)
                                 for k, v in stages.items()}}
    finally:
        for k in (parent, *kids):
            await rt.kill(k)


async def _no_prehash(name: str) -> None:
    pass


async def idle(rt: NodeRuntime, tpl: Any, sid: str, p: Any) -> Any:
    await run(p, "true")
    return p


async def wrote(rt: NodeRuntime, tpl: Any, sid: str, p: Any) -> Any:
    await run(p, WRITE)
    return p


async def in_ram(rt: NodeRuntime, tpl: Any, sid: str, p: Any) -> Any:
    await run(p, IN_RAM)
    return p


def cycled(n: int) -> Any:
    async def setup(rt: NodeRuntime, tpl: Any, sid: str, p: Any) -> Any:
        for i in range(n):
            await run(p, f"head -c 1M /dev/urandom > /home/user/c{i % 4}")
            ref = await rt.snapshot(sid, f"{sid}-c{i}", stop=True)
            p = await rt.start(sid, ref, NET)
        return p
    return setup


def report(rows: list[dict[str, Any]]) -> None:
    anchor = rows[0]["fork_s"]
    print(f"\n{'row':<15} {'freed':>6} {'back':>5} {'wait':>6} {'snapshot':>9} {'down':>6} "
          f"{'pages':>7} {'children':>9} {'fork':>8} {'/ idle':>7} {'image':>6} "
          f"{'kids PSS':>9} {'private':>8}")
    for r in rows:
        print(f"{r['row']:<15} {r['freed_mib']:6.0f} {r['returned_mib']:5.0f} "
              f"{r['reclaim_s'] * 1e3:4.0f}ms {r['snapshot_s'] * 1e3:7.0f}ms "
              f"{r['downtime_s'] * 1e3:4.0f}ms "
              f"{r['diff_pages']:7.0f} {r['restore_s']:8.2f}s {r['fork_s']:7.2f}s "
              f"{r['fork_s'] / anchor:6.2f}x {'shared' if r['shared'] else 'copies':>6} "
              f"{r['children_pss_mib']:6.0f}MiB {r['children_private_mib']:5.0f}MiB"
              + (f"  FAILED {r['failed']}" if r["failed"] else ""))
    print("\nchildren's p50 stages (ms):")
    for r in rows:
        print(f"  {r['row']:<15} {r['child_p50_ms']}")
    print("\nsnapshot stages (ms):")
    for r in rows:
        print(f"  {r['row']:<12} {r['snapshot_ms']}")


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="aenv-bfork-", dir="/var/tmp"))
    cfg = RuntimeConfig(state_dir=work / "state",
                        run_dir=Path(f"/tmp/aenv-bfork-{work.name[-8:]}"),
                        vms_survive_service=False)
    rt = await NodeRuntime(cfg).open()
    rows: list[dict[str, Any]] = []
    try:
        tpl = await rt.build_template("bfork", MachineSpec(cpu_count=1, memory_mb=args.mem_mib))
        for name, setup, reclaim, prehash, share in (
                ("idle", idle, True, True, True), ("wrote", wrote, False, True, True),
                ("reclaimed", wrote, True, True, True), ("no prehash", wrote, True, False, True),
                (f"paused x{args.cycles}", cycled(args.cycles), True, True, True),
                ("in RAM", in_ram, True, True, True), ("in RAM, copy", in_ram, True, True, False)):
            if args.cycles == 0 and name.startswith("paused"):
                continue
            if args.rows and name not in args.rows:
                continue
            row = await fork_row(rt, tpl, name.replace(" ", "").replace(",", ""), args.children,
                                 setup, reclaim, prehash, share)
            row["row"] = name
            rows.append(row)
            print(f"  {name}: fork {row['fork_s']:.2f} s", flush=True)
    finally:
        await rt.shutdown()
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--children", type=int, default=16)
    ap.add_argument("--mem-mib", type=int, default=512)
    ap.add_argument("--cycles", type=int, default=100,
                    help="pause/resume cycles of the last row (0: no such row)")
    ap.add_argument("--rows", nargs="*", default=None,
                    help="only these rows (names as printed; the first is the anchor)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = asyncio.run(amain(args))
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
