"""Throughput of envd's /files (upload + download) against a plain loopback HTTP copy.

Starts its own envd (`python -m envd`, default user `user`) and a baseline server (a
minimal Starlette app on the same uvicorn stack: GET streams the file with
FileResponse, POST writes the request body straight to disk) on free loopback ports,
moves a SIZE_MIB file through each with a streaming httpx client, and prints n,
median and p95 MiB/s per case plus envd/baseline ratios. Samples and parameters go
to a JSON file.

    .venv/bin/python bench/bench_envd_files.py [--size-mib 256] [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pwd
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1024 * 1024

BASELINE_APP = r'''
import os, sys
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Route

async def download(request: Request):
    return FileResponse(request.query_params["path"], media_type="application/octet-stream")

async def upload(request: Request):
    path = request.query_params["path"]
    with open(path, "wb") as f:
        async for chunk in request.stream():
            f.write(chunk)
    return JSONResponse([{"path": path}])

app = Starlette(routes=[Route("/files", download, methods=["GET"]),
                        Route("/files", upload, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in its own session; `stop()` kills the group and reaps it."""

    def __init__(self, argv: list[str], url: str, health_path: str) -> None:
        self.url = url
        self.proc = subprocess.Popen(argv, cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv} exited with {self.proc.returncode}")
            try:
                httpx.get(url + health_path, timeout=0.5)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{argv} did not come up") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def timed_upload(client: httpx.Client, url: str, src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    r = client.post(f"{url}/files", params={"path": str(dst)}, content=file_chunks(src),
                    headers={"Content-Type": "application/octet-stream"})
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    if dst.stat().st_size != src.stat().st_size:
        raise RuntimeError(f"upload to {url} wrote {dst.stat().st_size} bytes")
    return elapsed


def timed_download(client: httpx.Client, url: str, path: Path) -> float:
    n = 0
    t0 = time.perf_counter()
    with client.stream("GET", f"{url}/files", params={"path": str(path)},
                       headers={"Accept-Encoding": "identity"}) as r:
        r.raise_for_status()
        for chunk in r.iter_raw(CHUNK):
            n += len(chunk)
    elapsed = time.perf_counter() - t0
    if n != path.stat().st_size:
        raise RuntimeError(f"download from {url} returned {n} bytes")
    return elapsed


def summary(samples_s: list[float], size_mib: int) -> dict[str, float]:
    rates = sorted(size_mib / s for s in samples_s)
    # p95 of throughput = the rate 95% of runs reach or beat (low tail), nearest rank
    low_idx = max(0, round(0.05 * (len(rates) - 1)))
    return {"n": len(rates), "median_mib_s": statistics.median(rates),
            "p95_mib_s": rates[low_idx]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=str(Path(tempfile.gettempdir()) / "bench_envd_files.json"))
    args = ap.parse_args()

    user = pwd.getpwnam("user")
    work = Path(tempfile.mkdtemp(prefix="bench-envd-files-", dir=user.pw_dir))
    os.chown(work, user.pw_uid, user.pw_gid)
    src = work / "src.bin"
    with open(src, "wb") as f:
        f.writelines(os.urandom(CHUNK) for _ in range(args.size_mib))
    os.chown(src, user.pw_uid, user.pw_gid)

    servers: list[Server] = []
    try:
        envd_port, base_port = free_port(), free_port()
        envd = Server([sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port",
                       str(envd_port), "--default-user", "user"],
                      f"http://127.0.0.1:{envd_port}", "/health")
        servers.append(envd)
        baseline = Server([sys.executable, "-c", BASELINE_APP, str(base_port)],
                          f"http://127.0.0.1:{base_port}", "/")
        servers.append(baseline)

        samples: dict[str, list[float]] = {k: [] for k in (
            "envd_upload", "baseline_upload", "envd_download", "baseline_download")}
        with httpx.Client(timeout=300) as client:
            for i in range(args.runs + 1):  # run 0 warms caches and connections
                runs = [
                    ("baseline_upload", lambda: timed_upload(client, baseline.url, src,
                                                             work / "base.bin")),
                    ("envd_upload", lambda: timed_upload(client, envd.url, src,
                                                         work / "envd.bin")),
                    ("baseline_download", lambda: timed_download(client, baseline.url, src)),
                    ("envd_download", lambda: timed_download(client, envd.url, src)),
                ]
                if i % 2:
                    runs.reverse()  # alternate who goes first
                for name, fn in runs:
                    # Flush the previous case's dirty pages outside the timed region, so a
                    # case never pays for the writeback of the one before it.
                    for leftover in (work / "base.bin", work / "envd.bin"):
                        leftover.unlink(missing_ok=True)
                    os.sync()
                    elapsed = fn()
                    if i:
                        samples[name].append(elapsed)

        stats = {k: summary(v, args.size_mib) for k, v in samples.items()}
        print(f"envd /files vs plain loopback HTTP, {args.size_mib} MiB file, "
              f"n={args.runs} per case")
        print(f"{'case':<20}{'n':>3}{'median MiB/s':>15}{'p95 MiB/s':>12}")
        for name, s in stats.items():
            print(f"{name:<20}{s['n']:>3}{s['median_mib_s']:>15.1f}{s['p95_mib_s']:>12.1f}")
        ratios = {
            op: stats[f"envd_{op}"]["median_mib_s"] / stats[f"baseline_{op}"]["median_mib_s"]
            for op in ("upload", "download")
        }
        for op, ratio in ratios.items():
            print(f"{op} throughput envd/baseline median {ratio:.2f}x")
        Path(args.json).write_text(json.dumps({
            "params": {"size_mib": args.size_mib, "runs": args.runs, "chunk": CHUNK,
                       "host": platform.node(), "cpus": os.cpu_count(),
                       "python": platform.python_version()},
            "samples_s": samples, "stats": stats, "ratios": ratios,
        }, indent=2))
        print(f"samples: {args.json}")
    finally:
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
