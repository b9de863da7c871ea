"""Code-interpreter sandboxes through the unmodified `e2b-code-interpreter` Python SDK
against a real `python -m host` service, next to plain commands in the same run.

    build       the first create of code-interpreter-v1: the built-in recipe built on
                first use (host pip tree, COPY, warm kernel, snapshot) + that create
    first code  Sandbox.create() -> first run_code("1+1") result (p50 over N sandboxes)
    first cmd   anchor: Sandbox.create() of the base template -> commands.run(
                "python3 -c 1") done (p50 over N)
    warm code   run_code("1+1") in one sandbox, M times: p50 / p99
    warm cmd    anchor: commands.run("python3 -c 1") in one sandbox, M times: p50 / p99

Ratios: first code / first cmd, warm code / warm cmd. Samples go to JSON
(--json, default out/bench/code_interpreter.json). Nothing is asserted.

    .venv/bin/python bench/bench_code_interpreter.py [-n 3] [-m 30]
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

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import E2EService, build_template


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def ms(s: float) -> str:
    return f"{s * 1e3:8.0f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=3, help="sandboxes per first-result row")
    ap.add_argument("-m", type=int, default=30, help="warm runs per warm row")
    ap.add_argument("--json", type=Path, default=REPO / "out/bench/code_interpreter.json")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="aenv-bench-ci-", dir="/var/tmp"))
    svc = E2EService(root, pool="10.216.48.0/20", tag="aecib")
    res: dict[str, object] = {}
    try:
        svc.start()
        os.environ.update(svc.sdk_env())
        os.environ["E2B_DOMAIN"] = "sbx.localhost"
        from e2b import Sandbox as Plain
        from e2b_code_interpreter import Sandbox

        res["base_build_s"] = build_template(svc)
        with svc.client() as c:
            t0 = time.perf_counter()
            r = c.post("/v2/sandboxes", json={"templateID": "code-interpreter-v1",
                                              "timeout": 60}, timeout=httpx.Timeout(3000.0))
            res["ci_build_s"] = time.perf_counter() - t0
            r.raise_for_status()
            c.delete(f"/sandboxes/{r.json()['sandboxID']}")

        first_code, first_cmd = [], []
        for _ in range(args.n):
            t0 = time.perf_counter()
            sbx = Sandbox.create(timeout=300)
            assert sbx.run_code("1+1").text == "2"
            first_code.append(time.perf_counter() - t0)
            sbx.kill()
            t0 = time.perf_counter()
            plain = Plain.create(timeout=300)
            plain.commands.run("python3 -c 1")
            first_cmd.append(time.perf_counter() - t0)
            plain.kill()

        sbx = Sandbox.create(timeout=600)
        warm_code = []
        for _ in range(args.m):
            t0 = time.perf_counter()
            sbx.run_code("1+1")
            warm_code.append(time.perf_counter() - t0)
        warm_cmd = []
        for _ in range(args.m):
            t0 = time.perf_counter()
            sbx.commands.run("python3 -c 1")
            warm_cmd.append(time.perf_counter() - t0)
        sbx.kill()
        res.update(first_code_s=first_code, first_cmd_s=first_cmd, warm_code_s=warm_code,
                   warm_cmd_s=warm_cmd)

        fc, fm = statistics.median(first_code), statistics.median(first_cmd)
        print(f"\ncode-interpreter-v1 build on first use: {res['ci_build_s']:.1f} s "
              f"(base template build {res['base_build_s']:.1f} s)")
        print(f"create -> first run_code('1+1') p50 {ms(fc)}   anchor create -> "
              f"commands.run('python3 -c 1') p50 {ms(fm)}   ratio {fc / fm:.2f}")
        print(f"warm run_code('1+1')         p50 {ms(pct(warm_code, .5))} p99 "
              f"{ms(pct(warm_code, .99))}")
        print(f"warm commands.run(python3 -c 1) p50 {ms(pct(warm_cmd, .5))} p99 "
              f"{ms(pct(warm_cmd, .99))}   ratio p50 "
              f"{pct(warm_code, .5) / pct(warm_cmd, .5):.2f}")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
        return 0
    finally:
        svc.cleanup()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
