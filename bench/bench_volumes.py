"""Volume throughput: a SIZE_MIB file written and read through a volume mount in a real
sandbox, against the sandbox's own disk in the same sandbox, and the host's disk (the
volume's directory, no guest) as the floor, in one run.

    .venv/bin/python bench/bench_volumes.py [--size-mib 256] [--runs 3] [--json FILE]

Rows (MiB/s, median of --runs): write (dd from a 1 MiB random block repeated, then
fsync) and read (page cache dropped first, as root) for the mount, the own disk and the
host. Ratios: mount / own disk, mount / host. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import E2EService, build_template

MNT = "/mnt/vol"
TIMED = ("set -e; s=$(date +%s%N); {cmd} >/dev/null 2>&1; e=$(date +%s%N); "
         "echo $(( (e - s) / 1000 ))")


def guest_us(sbx, cmd: str) -> float:
    r = sbx.commands.run(TIMED.format(cmd=cmd), user="root", timeout=1800)
    return int(r.stdout.strip()) / 1e6


def host_rates(directory: Path, size_mib: int) -> tuple[float, float]:
    block = os.urandom(1 << 20)
    path = directory / "host-bench"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(block for _ in range(size_mib))
        f.flush()
        os.fsync(f.fileno())
    w = time.perf_counter() - t0
    os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    r = time.perf_counter() - t0
    path.unlink()
    return size_mib / w, size_mib / r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=REPO / "out/bench/volumes.json")
    args = ap.parse_args()
    n = args.size_mib

    root = Path(tempfile.mkdtemp(prefix="aenv-bench-vol-", dir="/var/tmp"))
    svc = E2EService(root, pool="10.216.192.0/20", tag="aevolb")
    svc.memory_mb = 512
    res: dict[str, list[float]] = {k: [] for k in (
        "mount_write", "mount_read", "disk_write", "disk_read", "host_write", "host_read")}
    try:
        svc.start()
        os.environ.update(svc.sdk_env())
        os.environ["E2B_DOMAIN"] = "sbx.localhost"
        from e2b import Sandbox, Volume

        build_template(svc)
        vol = Volume.create("bench")
        sbx = Sandbox.create(timeout=3600, volume_mounts={MNT: vol})
        sbx.commands.run("head -c 1048576 /dev/urandom > /tmp/block", user="root")
        write = (f"for i in $(seq {n}); do cat /tmp/block; done | "
                 "dd of={path} bs=1M iflag=fullblock conv=fsync")
        read = "sync; echo 3 > /proc/sys/vm/drop_caches; dd if={path} of=/dev/null bs=1M"
        data_dir = root / "state" / "volumes" / vol.volume_id / "data"
        for _ in range(args.runs):
            for name, path in (("mount", f"{MNT}/f"), ("disk", "/home/user/f")):
                res[f"{name}_write"].append(n / guest_us(sbx, write.format(path=path)))
                res[f"{name}_read"].append(n / guest_us(sbx, read.format(path=path)))
                sbx.commands.run(f"rm -f {path}", user="root")
            hw, hr = host_rates(data_dir, n)
            res["host_write"].append(hw)
            res["host_read"].append(hr)
        sbx.kill()
        Volume.destroy(vol.volume_id)

        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"\n{n} MiB, median of {args.runs} (MiB/s)")
        print(f"{'':8}{'mount':>10}{'own disk':>10}{'host':>10}   mount/disk  mount/host")
        for op in ("write", "read"):
            m, d, h = med[f"mount_{op}"], med[f"disk_{op}"], med[f"host_{op}"]
            print(f"{op:8}{m:10.1f}{d:10.1f}{h:10.1f}   {m / d:10.2f}  {m / h:10.3f}")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"size_mib": n, "samples": res, "median": med},
                                        indent=1))
        return 0
    finally:
        svc.cleanup()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
