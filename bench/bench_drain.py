"""How long a node's stop-time drain takes (issue 35), to size the container deploys'
grace periods (`docker --stop-timeout`, compose's `stop_grace_period`, the DaemonSet's
`terminationGracePeriodSeconds`) from a measurement rather than a guess.

N sandboxes after real setup (each wrote `--disk-mib` to its disk and holds `--mem-mib`
in a live process, so its pause carries dirty memory and a disk layer), then SIGTERM of a
service with `--drain-on-stop`. Printed: the drain (SIGTERM to exit, and the drain's own
time from its log), per sandbox; the anchor is one such sandbox paused alone through the
API in the same run (N x that = a drain one at a time); the restart's resume of all N;
and how many such sandboxes the 300 s grace the deploys give covers at the measured rate.

    .venv/bin/python bench/bench_drain.py [-n 20] [--disk-mib 100] [--mem-mib 100]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import E2EService, build_template

GRACE_S = 300  # what deploy/ gives a node to drain
SETUP = ("dd if=/dev/urandom of=/home/user/setup.bin bs=1M count={disk} status=none && sync"
         " && (python3 -c \"b = bytearray({mem} << 20); b[::4096] = b'x' * len(b[::4096]); "
         "import time; time.sleep(86400)\" >/dev/null 2>&1 &)")


def setup(b: Any, disk_mib: int, mem_mib: int) -> None:
    b.commands.run(SETUP.format(disk=disk_mib, mem=mem_mib), timeout=600)


def wait_running(svc: E2EService, ids: list[str], timeout_s: float = 1800) -> float:
    t0 = time.monotonic()
    while not all(svc.db_states().get(sid) == "running" for sid in ids):
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"not all resumed: {svc.db_states()}")
        time.sleep(0.25)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=20, help="running sandboxes at the stop")
    ap.add_argument("--disk-mib", type=int, default=100, help="what each wrote to its disk")
    ap.add_argument("--mem-mib", type=int, default=100, help="what each holds in a process")
    ap.add_argument("--json", type=Path, default=REPO / "out/bench/drain.json")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="aenv-bench-drain-", dir="/var/tmp"))
    svc = E2EService(root, pool="10.216.192.0/20", tag="abdrn", extra=["--drain-on-stop"])
    svc.memory_mb = 512
    res: dict[str, Any] = {"bench": "drain", "n": args.n, "disk_mib": args.disk_mib,
                           "mem_mib": args.mem_mib}
    try:
        svc.start()
        print(f"  template build + first create: {build_template(svc):6.2f} s", flush=True)
        os.environ.update(svc.sdk_env())
        os.environ["E2B_DOMAIN"] = "sbx.localhost"
        from e2b import Sandbox

        # the anchor: one sandbox after the same setup, paused alone
        one = Sandbox.create(timeout=3600)
        setup(one, args.disk_mib, args.mem_mib)
        t0 = time.perf_counter()
        one.beta_pause()  # answered once the guest is stopped; the commit follows
        answered = time.perf_counter() - t0
        while svc.db_states().get(one.sandbox_id) != "paused":
            time.sleep(0.01)
        single = time.perf_counter() - t0
        print(f"  one sandbox paused alone (the anchor): answered in {answered:.2f} s, "
              f"committed in {single:.2f} s", flush=True)
        Sandbox.kill(one.sandbox_id)

        boxes = [Sandbox.create(timeout=3600) for _ in range(args.n)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda b: setup(b, args.disk_mib, args.mem_mib), boxes))
        ids = [b.sandbox_id for b in boxes]
        print(f"  {args.n} sandboxes set up", flush=True)

        t0 = time.perf_counter()
        rc = svc.stop(timeout_s=1800)
        stop_s = time.perf_counter() - t0
        log = svc.log(50_000_000)
        m = re.search(r"drain: (\d+) sandboxes paused, (\d+) failed, \d+ spare VMs released, "
                      r"in ([\d.]+) s", log)
        if rc != 0 or not m:
            raise RuntimeError(f"the drain did not finish (exit {rc}): {log[-3000:]}")
        paused, failed, drain_s = int(m.group(1)), int(m.group(2)), float(m.group(3))
        svc.start()
        resume_s = wait_running(svc, ids)
        per = stop_s / args.n
        covers = int(GRACE_S / per)
        res.update({"single_pause_s": single, "stop_s": stop_s, "drain_s": drain_s,
                    "paused": paused, "failed": failed, "per_sandbox_s": per,
                    "resume_all_s": resume_s, "grace_s": GRACE_S, "grace_covers": covers})
        print(f"\n  {'':40} {'s':>8} {'/ anchor':>9}")
        for name, v in (("one pause alone (anchor)", single),
                        (f"drain of {args.n} (SIGTERM to exit)", stop_s),
                        ("  of which the drain itself", drain_s),
                        ("  per sandbox", per),
                        (f"{args.n} paused one at a time (N x anchor)", args.n * single),
                        (f"restart: all {args.n} running again", resume_s)):
            print(f"  {name:40} {v:8.2f} {v / single:8.2f}x")
        print(f"  paused {paused}, failed {failed}; at {per:.2f} s a sandbox the {GRACE_S} s "
              f"grace covers ~{covers} such sandboxes", flush=True)
        for sid in ids:
            Sandbox.kill(sid)
    finally:
        svc.cleanup()
        shutil.rmtree(root, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
