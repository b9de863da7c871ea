"""Run every benchmark under bench/ in turn (`make bench`).

Each bench prints its own table of numbers and ratios against anchors measured in the
same run; this runner only sequences them and reports which failed. Benchmarks are not
tests: nothing here asserts timings. Pass names to run a subset:

    .venv/bin/python bench/run_all.py envd_commands proxy
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    benches = sorted(HERE.glob("bench_*.py"))
    if argv:
        wanted = {f"bench_{a.removeprefix('bench_').removesuffix('.py')}.py" for a in argv}
        benches = [b for b in benches if b.name in wanted]
        missing = wanted - {b.name for b in benches}
        if missing:
            print(f"unknown benchmarks: {', '.join(sorted(missing))}", file=sys.stderr)
            return 2
    failed: list[str] = []
    for bench in benches:
        print(f"\n=== {bench.name} ===", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, str(bench)], cwd=HERE.parent)
        print(f"=== {bench.name}: exit {rc} after {time.monotonic() - t0:.0f} s ===", flush=True)
        if rc != 0:
            failed.append(bench.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
