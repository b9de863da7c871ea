"""End-to-end latency from the Python SDK against a real `python -m host` service.

    e2e    Sandbox.create() -> commands.run("true") done, measured in this process
           (also split: create() returned / first command done)
beside
    build  the service's first create: template build (cold boot + envd + snapshot) + restore
    cold   a plain cold boot of the same image, QEMU start -> envd answers
           (bench/bench_boot.py -n N, in a subprocess; --cold-boot 0 skips it)
and prints p50 over N (default 5) plus the ratios cold/e2e and build/e2e. The service is
private: temp state dir, free ports, namespaces ae2e- / pool 10.216.32.0/20; everything it
started is stopped. Samples go to JSON (--json, default out/bench/e2e.json).

    .venv/bin/python bench/bench_e2e.py [-n 5] [--cold-boot 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import E2EService, build_template


def cold_boot_p50(n: int) -> float | None:
    if n <= 0:
        return None
    out = Path(tempfile.mkdtemp(prefix="bench-e2e-")) / "boot.json"
    try:
        r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_boot.py"), "-n", str(n),
                            "--mem-mib", "256", "--json", str(out)], cwd=REPO, text=True,
                           capture_output=True, timeout=1800, check=False)
        if r.returncode != 0:
            print(f"  bench_boot failed: {r.stderr[-1500:]}")
            return None
        return float(json.loads(out.read_text())["boot_p50_s"])
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--cold-boot", type=int, default=3, help="cold boots to measure (0: none)")
    ap.add_argument("--json", type=Path, default=REPO / "out/bench/e2e.json")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="aenv-bench-e2e-", dir="/var/tmp"))
    svc = E2EService(root, pool="10.216.32.0/20", tag="ae2eb")
    creates: list[float] = []
    totals: list[float] = []
    try:
        svc.start()
        build_s = build_template(svc)
        print(f"  template build + first create: {build_s:6.2f} s", flush=True)
        os.environ.update(svc.sdk_env())
        os.environ["E2B_DOMAIN"] = "sbx.localhost"
        from e2b import Sandbox

        Sandbox.create(timeout=60).kill()  # warm the SDK's clients (not measured)
        for i in range(args.n):
            t0 = time.perf_counter()
            sbx = Sandbox.create(timeout=120)
            t1 = time.perf_counter()
            sbx.commands.run("true")
            t2 = time.perf_counter()
            sbx.kill()
            creates.append(t1 - t0)
            totals.append(t2 - t0)
            print(f"  e2e {i + 1}/{args.n}: create {creates[-1] * 1000:7.1f} ms   "
                  f"+ first command {(t2 - t1) * 1000:7.1f} ms   = {totals[-1] * 1000:7.1f} ms",
                  flush=True)
    finally:
        svc.cleanup()
        shutil.rmtree(root, ignore_errors=True)

    cold = cold_boot_p50(args.cold_boot)
    e50, c50 = statistics.median(totals), statistics.median(creates)
    print(f"Python SDK e2e, accel tcg, n={args.n}")
    print(f"  create -> run('true') done  p50 {e50 * 1000:8.1f} ms "
          f"(create p50 {c50 * 1000:.1f} ms)")
    print(f"  template build (first create)    {build_s * 1000:8.1f} ms   "
          f"build / e2e {build_s / e50:.1f}x")
    if cold is not None:
        print(f"  cold boot p50 (bench_boot)       {cold * 1000:8.1f} ms   "
              f"cold boot / e2e {cold / e50:.1f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "bench": "e2e", "n": args.n, "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "create_s": creates, "e2e_s": totals, "e2e_p50_s": e50, "create_p50_s": c50,
        "template_build_s": build_s, "cold_boot_p50_s": cold,
        "ratio_cold_over_e2e": cold / e50 if cold else None,
        "ratio_build_over_e2e": build_s / e50,
    }, indent=2) + "\n")
    print(f"  samples: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
