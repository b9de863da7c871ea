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

Per row: the live snapshot (wall, guest downtime, memory pages in its diff), the
children's restores (wall until every child's envd answered), their p50 stages, and the
ratio of the fork (snapshot + children) to the idle row's. Needs `make kernel image`,
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
from tests.runtime.helpers import run

NET = NetworkConfig()
WRITE = "dd if=/dev/urandom of=/home/user/big bs=1M count=200 status=none && sync"


async def fork_row(rt: NodeRuntime, tpl: Any, name: str, children: int,
                   setup: Any, reclaim: bool = False, prehash: bool = True) -> dict[str, Any]:
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
        t1 = time.perf_counter()
        got = await asyncio.gather(*(rt.start(k, ref, NET) for k in kids), return_exceptions=True)
        restore_s = time.perf_counter() - t1
        failed = [repr(g) for g in got if isinstance(g, BaseException)]
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
    print(f"\n{'row':<12} {'freed':>6} {'back':>5} {'wait':>6} {'snapshot':>9} {'down':>6} "
          f"{'pages':>7} {'children':>9} {'fork':>8} {'/ idle':>7}  child p50 stages (ms)")
    for r in rows:
        print(f"{r['row']:<12} {r['freed_mib']:6.0f} {r['returned_mib']:5.0f} "
              f"{r['reclaim_s'] * 1e3:4.0f}ms {r['snapshot_s'] * 1e3:7.0f}ms "
              f"{r['downtime_s'] * 1e3:4.0f}ms "
              f"{r['diff_pages']:7.0f} {r['restore_s']:8.2f}s {r['fork_s']:7.2f}s "
              f"{r['fork_s'] / anchor:6.2f}x  {r['child_p50_ms']}"
              + (f"  FAILED {r['failed']}" if r["failed"] else ""))
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
        for name, setup, reclaim, prehash in (
                ("idle", idle, True, True), ("wrote", wrote, False, True),
                ("reclaimed", wrote, True, True), ("no prehash", wrote, True, False),
                (f"paused x{args.cycles}", cycled(args.cycles), True, True)):
            if args.cycles == 0 and name.startswith("paused"):
                continue
            row = await fork_row(rt, tpl, name.replace(" ", ""), args.children, setup,
                                 reclaim, prehash)
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
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = asyncio.run(amain(args))
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
