"""Where a sandbox's host memory goes (a diagnostic for the density benches, not a bench).

For N sandboxes of one template: each QEMU's smaps summed by kind of mapping (guest RAM,
TCG's translated code, heap, other anonymous, files), then QEMU's private pages of guest
RAM (copy-on-write copies of the template's memory file: what the host holds for this VM
alone) classified by what the guest uses each page for, from the guest's own
`/proc/kpageflags` and its processes' page maps. Measured idle, then after a process in
every guest allocated, touched and freed `--alloc-mib` (bench_balloon.py's hog), then
after `--after-cmd` if given.

    .venv/bin/python bench/memwhere.py [-n 2] [--alloc-mib 300] [--after-cmd 'sync']

Guest page frame = offset in QEMU's RAM mapping / 4 KiB: true for a microvm whose RAM sits
below 4 GiB (our sandboxes). The classifier is a python3 run in the first guest as root: its
own pages show as "anon ?" (no process named) in what follows it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_balloon import hold, release
from bench.bench_density import KINDS, RAM_MIN, smaps_by_kind, vmm_pids
from tests.e2e.conftest import E2EService, build_template

# Runs in the guest as root: /tmp/pfns holds the frames the host holds privately.
CLASSIFY = r'''
import os, struct
pfns = [int(x) for x in open("/tmp/pfns").read().split()]
owner = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    if pid == str(os.getpid()):
        continue
    try:
        comm = open(f"/proc/{pid}/comm").read().strip()
        with open(f"/proc/{pid}/pagemap", "rb") as pm:
            for line in open(f"/proc/{pid}/maps"):
                a, b = (int(x, 16) for x in line.split()[0].split("-"))
                if a >= 1 << 47:
                    continue
                pm.seek((a >> 12) * 8)
                raw = pm.read(((b - a) >> 12) * 8)
                for (e,) in struct.iter_unpack("<Q", raw):
                    if e >> 63 & 1:
                        owner.setdefault(e & ((1 << 55) - 1), comm)
    except OSError:
        pass  # exited meanwhile, or a kernel thread
counts = {}
with open("/proc/kpageflags", "rb") as f:
    for p in pfns:
        f.seek(p * 8)
        (fl,) = struct.unpack("<Q", f.read(8))
        if fl & 1 << 10: c = "free (buddy, below the reporting order)"
        elif fl & 1 << 7: c = "slab"
        elif fl & 1 << 26: c = "page table"
        elif fl & 1 << 12: c = "anon " + owner.get(p, "?")
        elif fl & (1 << 5 | 1 << 3): c = "page cache" + (" (mapped)" if fl & 1 << 11 else "")
        elif fl & 1 << 32: c = "reserved (memmap, kernel)"
        elif fl == 0: c = "no flags (per-cpu free lists, other)"
        else: c = "other"
        counts[c] = counts.get(c, 0) + 1
for c, n in sorted(counts.items(), key=lambda kv: -kv[1]):
    print(f"{n * 4 / 1024:8.1f} MiB  {c}")
'''


def private_frames(pid: int) -> list[int]:
    """Guest frames whose page QEMU holds privately (present, not the file's page)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        a, b = (int(x, 16) for x in line.split()[0].split("-"))
        if b - a >= RAM_MIN:
            break
    else:
        raise RuntimeError(f"QEMU {pid}: no guest RAM mapping found")
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        f.seek((a >> 12) * 8)
        raw = f.read(((b - a) >> 12) * 8)
    # bit 63 present, bit 61 file-page-or-shared-anon: present without 61 is a private copy
    return [i for i, (e,) in enumerate(struct.iter_unpack("<Q", raw))
            if e >> 63 & 1 and not e >> 61 & 1]


def report(label: str, svc: E2EService, boxes: list[Any]) -> None:
    ids = {b.sandbox_id for b in boxes}
    pids = vmm_pids(svc, ids)
    total = {k: {"pss": 0, "private": 0, "anonymous": 0} for k in KINDS}
    for pid in pids:
        for kind, v in smaps_by_kind(pid).items():
            for key in v:
                total[kind][key] += v[key]
    n = len(pids)
    print(f"\n== {label}: per VM, MiB (N={n})")
    for kind in KINDS:
        print(f"   {kind:5} Pss {total[kind]['pss'] / 1024 / n:7.1f}   private "
              f"{total[kind]['private'] / 1024 / n:7.1f}   anonymous (copies) "
              f"{total[kind]['anonymous'] / 1024 / n:7.1f}")
    print(f"   total Pss {sum(v['pss'] for v in total.values()) / 1024 / n:7.1f}")
    first = boxes[0]
    frames = private_frames(vmm_pids(svc, {first.sandbox_id})[0])
    first.files.write("/tmp/pfns", " ".join(map(str, frames)))
    first.files.write("/tmp/classify.py", CLASSIFY)
    res = first.commands.run("python3 /tmp/classify.py", user="root", timeout=300)
    print(f"   {first.sandbox_id}: {len(frames) * 4 / 1024:.1f} MiB of guest RAM private, as "
          "the guest uses it:")
    print("\n".join("     " + line for line in res.stdout.splitlines()), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=2, help="sandboxes")
    ap.add_argument("--mem-mib", type=int, default=512)
    ap.add_argument("--alloc-mib", type=int, default=300, help="the hog's allocation (0: none)")
    ap.add_argument("--settle", type=float, default=15.0, help="seconds before each reading")
    ap.add_argument("--after-cmd", default="", help="then run this in every guest (as root)")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="aenv-memwhere-", dir="/var/tmp"))
    svc = E2EService(root, pool="10.216.176.0/20", tag="amemw")
    svc.memory_mb = args.mem_mib
    svc.warm_pool = 0
    try:
        svc.start()
        build_template(svc)
        os.environ.update(svc.sdk_env())
        os.environ["E2B_DOMAIN"] = "sbx.localhost"
        from e2b import Sandbox

        boxes = [Sandbox.create(timeout=3600) for _ in range(args.n)]
        for b in boxes:
            b.commands.run("true")
        time.sleep(args.settle)
        report("idle", svc, boxes)

        def hog(b: Any) -> None:
            hold(b, args.alloc_mib)
            release(b)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(hog, boxes))
        time.sleep(args.settle)
        report(f"after {args.alloc_mib} MiB allocated, touched and freed", svc, boxes)
        if args.after_cmd:
            for b in boxes:
                b.commands.run(args.after_cmd, user="root", timeout=300)
            time.sleep(args.settle)
            report(f"after {args.after_cmd!r}", svc, boxes)
    finally:
        svc.cleanup()  # its sandboxes with it
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
