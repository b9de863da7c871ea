"""Code-interpreter sandboxes through the unmodified `e2b-code-interpreter` Python SDK
against a real `python -m host` service, next to plain commands in the same run.

    build       the first create of code-interpreter-v1: the built-in recipe built on
                first use (host pip tree, COPY, warm kernel, snapshot) + that create
    first code  Sandbox.create() -> first run_code("1+1") result (p50 over N sandboxes)
    first cmd   anchor: Sandbox.create() of the base template -> commands.run(
                "python3 -c 1") done (p50 over N)
    warm code   run_code("1+1") in one sandbox, M times: p50 / p99
    warm cmd    anchor: commands.run("python3 -c 1") in one sandbox, M times: p50 / p99
    languages   per language (python, javascript, typescript, r, java, bash): the first
                run_code after Sandbox.create() (python and javascript are warm in the
                template, the others start their kernel then), and the warm round trip
                of a trivial expression, M times: p50 / p99
    size        the guest's used disk in a code-interpreter sandbox vs a base sandbox
    memory      the guest's used memory (MemTotal - MemAvailable) just after create
                (python's kernel warm; any warm Deno kernel's RSS is subtracted for
                "python only"), with every language's kernel started, and each kernel's RSS

Ratios: first code / first cmd, warm code / warm cmd, all kernels / python only. Samples
go to JSON (--json, default out/bench/code_interpreter.json). Nothing is asserted.

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

from tests.code_interpreter.battery import BATTERY, LANGUAGES
from tests.e2e.conftest import E2EService, build_template

# one trivial expression per language for the warm round trip
TRIVIAL = {"python": "1+1", "javascript": "1+1", "typescript": "1+1", "r": "1+1",
           "java": "1+1", "bash": "echo 2"}
# which kernel process is which language's (ps args)
KERNEL_MARKS = {"python": "aenv_code_interpreter.kernelside", "deno": "deno jupyter",
                "r": "IRkernel::main", "java": "jjava.jar", "bash": "bash_kernel"}


def guest_used_bytes(sbx) -> int:
    out = sbx.commands.run("cat /proc/meminfo").stdout
    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in out.splitlines()}
    return info["MemTotal"] - info["MemAvailable"]


def guest_disk_used(sbx) -> int:
    return int(sbx.commands.run("df -B1 --output=used / | tail -1").stdout.strip())


def kernel_rss(sbx) -> dict[str, int]:
    out = sbx.commands.run("ps -eo rss=,args=").stdout
    rss: dict[str, int] = {}
    for line in out.splitlines():
        kb, _, args = line.strip().partition(" ")
        for name, mark in KERNEL_MARKS.items():
            if mark in args:
                rss[name] = rss.get(name, 0) + int(kb) * 1024
    return rss


def languages_rows(Sandbox, m: int, res: dict[str, object]) -> None:
    first: dict[str, float] = {}
    for lang in LANGUAGES:
        sbx = Sandbox.create(timeout=900, request_timeout=600)
        try:
            t0 = time.perf_counter()
            ex = sbx.run_code(BATTERY[lang]["hello"]["code"], language=lang, timeout=600)
            first[lang] = time.perf_counter() - t0
            assert ex.error is None, ex.error
        finally:
            sbx.kill()
    sbx = Sandbox.create(timeout=900, request_timeout=600)
    try:
        used_fresh = guest_used_bytes(sbx)
        rss_fresh = kernel_rss(sbx)
        warm: dict[str, list[float]] = {}
        for lang in LANGUAGES:
            sbx.run_code(TRIVIAL[lang], language=lang, timeout=600)
            warm[lang] = []
            for _ in range(m):
                t0 = time.perf_counter()
                sbx.run_code(TRIVIAL[lang], language=lang)
                warm[lang].append(time.perf_counter() - t0)
        used_all = guest_used_bytes(sbx)
        rss_all = kernel_rss(sbx)
    finally:
        sbx.kill()
    python_only = used_fresh - rss_fresh.get("deno", 0)
    res.update(first_by_language_s=first, warm_by_language_s=warm,
               guest_used_fresh=used_fresh, guest_used_all=used_all,
               kernel_rss_fresh=rss_fresh, kernel_rss_all=rss_all)
    print("\nper language: first run_code after create | warm round trip p50 / p99")
    for lang in LANGUAGES:
        print(f"  {lang:<11} first {ms(first[lang])}   warm p50 {ms(pct(warm[lang], .5))} "
              f"p99 {ms(pct(warm[lang], .99))}")
    mib = 1 << 20
    print(f"guest memory used: just after create {used_fresh / mib:.0f} MiB (warm kernels: "
          f"{', '.join(sorted(rss_fresh))}), python only ~{python_only / mib:.0f} MiB, "
          f"every kernel started {used_all / mib:.0f} MiB   ratio all / python only "
          f"{used_all / python_only:.2f}")
    print("kernel RSS with every kernel started: " + ", ".join(
        f"{k} {v / mib:.0f} MiB" for k, v in sorted(rss_all.items())))


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
        ci_disk = guest_disk_used(sbx)
        sbx.kill()
        plain = Plain.create(timeout=300)
        base_disk = guest_disk_used(plain)
        plain.kill()
        res.update(first_code_s=first_code, first_cmd_s=first_cmd, warm_code_s=warm_code,
                   warm_cmd_s=warm_cmd, disk_used_ci=ci_disk, disk_used_base=base_disk)
        languages_rows(Sandbox, args.m, res)

        fc, fm = statistics.median(first_code), statistics.median(first_cmd)
        print(f"\ncode-interpreter-v1 build on first use: {res['ci_build_s']:.1f} s "
              f"(base template build {res['base_build_s']:.1f} s)")
        print(f"guest disk used: code-interpreter-v1 {ci_disk / (1 << 20):.0f} MiB, base "
              f"{base_disk / (1 << 20):.0f} MiB (the template adds "
              f"{(ci_disk - base_disk) / (1 << 20):.0f} MiB)")
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
