"""What the VM jail costs (host/vmm/jail): the lifecycle and fork rows of
bench_density.py, run twice in one process against the same machine, once with every
VMM jailed (the service's default) and once with `--no-vm-jail` (QEMU as root, unconfined),
printed side by side with their ratio. The unjailed service is the anchor: the jail adds
a fork (not a vfork) with a preexec function per VM start, a cgroup, a mount namespace
with ~10 bind mounts and a netns switch in the child, and files handed to QEMU as
descriptors.

    .venv/bin/python bench/bench_jail.py [-n 5] [--fork 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_density import Bench
from tests.e2e.conftest import E2EService, build_template

ROWS = (("create p50", "create_p50_s"), ("pause idle p50 (answered)", "pause_idle_p50_s"),
        ("resume + run p50 (kept VM)", "resume_p50_s"),
        ("resume + run p50 (restored)", "resume_restored_p50_s"),
        ("kill p50", "kill_p50_s"), ("fork {n}", "fork16_s"),
        ("fork {n}: parent down", "fork16_parent_down_s"))


def measure(args: argparse.Namespace, jailed: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="aenv-bench-jail-", dir="/var/tmp"))
    svc = E2EService(root, pool="10.216.64.0/20", tag="ajail")
    svc.memory_mb = args.mem_mib
    svc.keep_paused_s = args.keep_paused
    if not jailed:
        svc.extra.append("--no-vm-jail")
    saved = dict(os.environ)
    try:
        svc.start()
        print(f"\n[{'jailed' if jailed else 'unjailed'}] template build + first create: "
              f"{build_template(svc):6.2f} s", flush=True)
        os.environ.update(svc.sdk_env())
        os.environ["E2B_DOMAIN"] = "sbx.localhost"
        bench = Bench(svc, args)
        bench.create().kill()  # warm the SDK's clients (not measured)
        bench.lifecycle()
        bench.fork()
        return dict(bench.res)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        svc.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="samples per lifecycle row")
    ap.add_argument("--mem-mib", type=int, default=512)
    ap.add_argument("--fork", type=int, default=16)
    ap.add_argument("--keep-paused", type=float, default=3.0)
    ap.add_argument("--json", type=Path, default=REPO / "out/bench/jail.json")
    args = ap.parse_args()
    # the attributes bench_density's Bench reads and this bench does not vary
    args.idle, args.parallel, args.settle, args.window, args.seconds = 0, 0, 0.0, 0.0, 0.0
    args.ksm, args.warm_pool = False, 1
    plain = measure(args, jailed=False)
    jailed = measure(args, jailed=True)
    print(f"\nPython SDK, TCG, {args.mem_mib} MiB sandboxes, n={args.n}; anchor: the same "
          "service unjailed, same run")
    print(f"  {'row':30} {'unjailed':>10} {'jailed':>10} {'ratio':>7}")
    for label, key in ROWS:
        a, b = plain.get(key), jailed.get(key)
        if isinstance(a, float) and isinstance(b, float) and a > 0:
            name = label.format(n=args.fork)  # bench_density keys fork rows "fork16"
            print(f"  {name:30} {a * 1e3:8.0f} ms {b * 1e3:8.0f} ms {b / a:6.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"bench": "jail", "time": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "unjailed": plain, "jailed": jailed},
        indent=1, default=str) + "\n")
    print(f"  samples: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
