"""Round-trip latency of `commands.run("true")` through envd vs a local `bash -l -c true`.

Starts its own envd (`python -m envd`) on a free port, points the e2b Python SDK at it
(E2B_DEBUG + E2B_SANDBOX_URL), measures both, prints n / p50 / p95 / p99 and the
envd/local ratio, then stops envd. `--json PATH` also writes the samples.

    .venv/bin/python bench/bench_envd_commands.py [-n 200] [--warmup 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_envd(port: int) -> subprocess.Popen[bytes]:
    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port", str(port),
         "--default-user", os.environ.get("BENCH_ENVD_USER", "root")],
        cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envd exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 204:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    stop_envd(proc)
    raise TimeoutError("envd did not become healthy")


def stop_envd(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def raw_start(port: int):
    """One Process.Start of /bin/true over a kept-alive HTTP/1.1 connection, read to the end."""
    import httpx

    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    payload = json.dumps({"process": {"cmd": "/bin/true"}, "stdin": False}).encode()
    body = b"\x00" + len(payload).to_bytes(4, "big") + payload
    headers = {"content-type": "application/connect+json", "connect-protocol-version": "1"}

    def run() -> None:
        r = client.post("/process.Process/Start", content=body, headers=headers)
        if not r.content.endswith(b"\x02\x00\x00\x00\x02{}"):
            raise RuntimeError(f"unexpected Start response: {r.content[-80:]!r}")

    return run


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(fn, n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def summary(name: str, ms: list[float]) -> dict[str, float]:
    row = {"n": len(ms), "p50_ms": statistics.median(ms), "p95_ms": pct(ms, 0.95),
           "p99_ms": pct(ms, 0.99), "mean_ms": statistics.fmean(ms)}
    print(f"{name:<28} n={row['n']:<5} p50={row['p50_ms']:7.2f} ms  p95={row['p95_ms']:7.2f} ms"
          f"  p99={row['p99_ms']:7.2f} ms")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    port = free_port()
    envd = start_envd(port)
    try:
        os.environ["E2B_DEBUG"] = "true"
        os.environ["E2B_SANDBOX_URL"] = f"http://127.0.0.1:{port}"
        from e2b import Sandbox

        sbx = Sandbox.create()
        via_envd = measure(lambda: sbx.commands.run("true"), args.n, args.warmup)
        # Without the login shell: what envd itself adds to a bare exec of /bin/true.
        raw_envd = measure(raw_start(port), args.n, args.warmup)
    finally:
        stop_envd(envd)
    local = measure(lambda: subprocess.run(["/bin/bash", "-l", "-c", "true"], check=True),
                    args.n, args.warmup)
    raw_local = measure(lambda: subprocess.run(["/bin/true"], check=True), args.n, args.warmup)

    print(f"commands.run('true') round trip, {platform.node()} ({os.cpu_count()} cpus)")
    a = summary("envd (Python SDK, sync)", via_envd)
    b = summary("local bash -l -c true", local)
    ratio50, ratio99 = a["p50_ms"] / b["p50_ms"], a["p99_ms"] / b["p99_ms"]
    print(f"envd/local ratio: p50 {ratio50:.2f}x  p99 {ratio99:.2f}x")
    c = summary("envd raw Start /bin/true", raw_envd)
    d = summary("local /bin/true", raw_local)
    print(f"raw envd/local ratio: p50 {c['p50_ms'] / d['p50_ms']:.2f}x  "
          f"p99 {c['p99_ms'] / d['p99_ms']:.2f}x  (envd overhead p50 "
          f"{c['p50_ms'] - d['p50_ms']:.2f} ms)")
    if args.json:
        args.json.write_text(json.dumps({
            "params": {"n": args.n, "warmup": args.warmup, "cpus": os.cpu_count()},
            "envd": a, "local": b, "ratio_p50": ratio50, "ratio_p99": ratio99,
            "raw_envd": c, "raw_local": d,
            "samples_ms": {"envd": via_envd, "local": local, "raw_envd": raw_envd,
                           "raw_local": raw_local}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
