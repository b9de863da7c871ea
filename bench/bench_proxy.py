"""Proxy overhead: envd reached directly vs through our proxy vs through nginx.

One run starts a real envd, our proxy (+ the REST API, over a one-sandbox static
orchestrator), and nginx configured as the same reverse proxy (temp prefix, foreground,
1 worker, no buffering), then measures for each path:
  * `commands.run("true")` latency via the e2b SDK (n, median, p95),
  * `/files` download throughput of one 256 MiB file (MiB/s, best of 3),
  * requests/second of `GET /health` at 50 concurrent connections (wrk, else httpx).
Prints ratios against direct and nginx; samples and parameters go to --json.

    .venv/bin/python bench/bench_proxy.py [--runs 200] [--size-mib 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SANDBOX_ID = "ibench0000000000000000"
API_KEY = "e2b_bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the served side (run in a child process: `bench_proxy.py --serve ...`) -----------

def serve(api_port: int, proxy_port: int, envd_port: int) -> None:
    import dataclasses

    import uvicorn

    sys.path.insert(0, str(REPO))
    from host.api import ApiKeys, build_api_app
    from host.orchestrator.errors import SandboxNotFound
    from host.orchestrator.model import NetworkConfig, Route, RunEnded, SandboxInfo
    from host.orchestrator.states import SandboxState
    from host.proxy import build_proxy_app

    info = SandboxInfo(sandbox_id=SANDBOX_ID, template_id="base", alias="base",
                       state=SandboxState.RUNNING, cpu_count=2, memory_mb=512, disk_mb=1024,
                       started_at=time.time(), end_at=time.time() + 3600, envd_version="0.6.13",
                       envd_access_token=None, traffic_access_token=None, metadata={},
                       auto_pause=True, auto_resume=False, network=NetworkConfig())

    # Like NodeOrchestrator, routes carry the run's end event (the proxy watches it per
    # exchange); BENCH_PROXY_UNWATCHED=1 leaves it out, to measure what watching costs.
    run = None if os.environ.get("BENCH_PROXY_UNWATCHED") == "1" else RunEnded()

    class StaticOrchestrator:
        domain = "bench.test"

        async def get(self, sid: str) -> SandboxInfo:
            if sid != SANDBOX_ID:
                raise SandboxNotFound(sid)
            return info

        async def connect(self, sid: str, timeout_s: int | None, *,
                          memory: bool = True) -> tuple[SandboxInfo, bool]:
            return dataclasses.replace(await self.get(sid)), False

        async def route(self, sid: str, port: int, *, resume: bool) -> Route:
            await self.get(sid)
            return Route("127.0.0.1", envd_port, None, gone=run)

    orch = StaticOrchestrator()
    api = build_api_app(orch, ApiKeys([API_KEY]), domain="bench.test")  # type: ignore[arg-type]
    proxy = build_proxy_app(orch, "bench.test")  # type: ignore[arg-type]

    async def main() -> None:
        servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                 log_level="warning", timeout_keep_alive=300))
                   for app, port in ((api, api_port), (proxy, proxy_port))]
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(main())


# --- processes ------------------------------------------------------------------------

def start(argv: list[str], ready_url: str | None = None, **kw) -> subprocess.Popen:
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, **kw)
    deadline = time.monotonic() + 30
    while ready_url:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[:3]} exited with {proc.returncode}")
        try:
            httpx.get(ready_url, timeout=0.5, headers={"E2b-Sandbox-Id": SANDBOX_ID,
                                                       "E2b-Sandbox-Port": "49983"})
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{argv[:3]} not ready") from None
            time.sleep(0.1)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


NGINX_CONF = """
worker_processes 1;
daemon off;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
  upstream envd {{ server 127.0.0.1:{envd}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    client_max_body_size 0;
    location / {{
      proxy_pass http://envd;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 3600s;
    }}
  }}
}}
"""


# --- measurements ---------------------------------------------------------------------

def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def run_latency(api_url: str, sandbox_url: str, runs: int) -> list[float]:
    env = {**os.environ, "E2B_API_URL": api_url, "E2B_SANDBOX_URL": sandbox_url,
           "E2B_API_KEY": API_KEY, "E2B_DOMAIN": "bench.test"}
    env.pop("E2B_DEBUG", None)
    code = f"""
import json, time
from e2b import Sandbox
sbx = Sandbox.connect({SANDBOX_ID!r})
for _ in range(10): sbx.commands.run("true")
out = []
for _ in range({runs}):
    t = time.perf_counter(); sbx.commands.run("true"); out.append((time.perf_counter() - t) * 1000)
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def download_mib_s(url: str, path: str, size: int) -> float:
    best = 0.0
    headers = {"E2b-Sandbox-Id": SANDBOX_ID, "E2b-Sandbox-Port": "49983"}
    with httpx.Client(timeout=300) as c:
        for _ in range(3):
            got = 0
            t = time.perf_counter()
            with c.stream("GET", f"{url}/files", params={"path": path, "username": "user"},
                          headers=headers) as r:
                r.raise_for_status()
                for chunk in r.iter_raw(1 << 20):
                    got += len(chunk)
            dt = time.perf_counter() - t
            if got != size:
                raise RuntimeError(f"downloaded {got} bytes, expected {size}")
            best = max(best, size / dt / 2**20)
    return best


def rps(url: str, seconds: int) -> float:
    h = ["-H", f"E2b-Sandbox-Id: {SANDBOX_ID}", "-H", "E2b-Sandbox-Port: 49983"]
    if shutil.which("wrk"):
        out = subprocess.run(["wrk", "-t2", "-c50", f"-d{seconds}s", *h, f"{url}/health"],
                             capture_output=True, text=True, check=True).stdout
        m = re.search(r"Requests/sec:\s+([\d.]+)", out)
        if not m:
            raise RuntimeError(out)
        return float(m.group(1))

    async def loop() -> float:  # fallback: httpx with 50 concurrent connections
        n = 0
        end = time.perf_counter() + seconds
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=50)) as c:
            async def worker() -> None:
                nonlocal n
                while time.perf_counter() < end:
                    await c.get(f"{url}/health", headers=dict(zip(h[1::2], h[1::2])))
                    n += 1
            await asyncio.gather(*(worker() for _ in range(50)))
        return n / seconds
    return asyncio.run(loop())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", nargs=3, type=int, metavar=("API", "PROXY", "ENVD"))
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rps-seconds", type=int, default=10)
    ap.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "bench_proxy.json")
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return 0

    envd_port, api_port, proxy_port, nginx_port = (free_port() for _ in range(4))
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    data = Path(tempfile.gettempdir()) / f"bench-proxy-{os.getpid()}.bin"
    size = args.size_mib * 2**20
    try:
        with open(data, "wb") as f:
            f.truncate(size)  # sparse zeros: measures the proxy, not the disk
        os.chmod(data, 0o644)
        procs.append(start([sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port",
                            str(envd_port), "--default-user", "user"],
                           f"http://127.0.0.1:{envd_port}/health", cwd=REPO))
        procs.append(start([sys.executable, __file__, "--serve", str(api_port),
                            str(proxy_port), str(envd_port)],
                           f"http://127.0.0.1:{proxy_port}/health"))
        for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (tmp / d).mkdir()
        (tmp / "nginx.conf").write_text(NGINX_CONF.format(prefix=tmp, envd=envd_port,
                                                          port=nginx_port))
        procs.append(start(["nginx", "-p", str(tmp), "-c", str(tmp / "nginx.conf")],
                           f"http://127.0.0.1:{nginx_port}/health"))
        api = f"http://127.0.0.1:{api_port}"
        targets = {"direct": f"http://127.0.0.1:{envd_port}",
                   "aenv-proxy": f"http://127.0.0.1:{proxy_port}",
                   "nginx": f"http://127.0.0.1:{nginx_port}"}
        results: dict[str, dict[str, object]] = {}
        for name, url in targets.items():
            lat = run_latency(api, url, args.runs)
            results[name] = {
                "run_true_ms": {"n": len(lat), "median": statistics.median(lat),
                                "p95": pct(lat, 95), "samples": lat},
                "download_mib_s": download_mib_s(url, str(data), size),
                "health_rps_c50": rps(url, args.rps_seconds),
            }
            r = results[name]
            print(f"{name:11s} run('true') n={args.runs} median={r['run_true_ms']['median']:.2f} ms "
                  f"p95={r['run_true_ms']['p95']:.2f} ms | download {r['download_mib_s']:.0f} MiB/s "
                  f"| GET /health c50 {r['health_rps_c50']:.0f} req/s", flush=True)
        ours, ngx, direct = results["aenv-proxy"], results["nginx"], results["direct"]
        for base_name, base in (("direct", direct), ("nginx", ngx)):
            print(f"aenv-proxy/{base_name}: run('true') median "
                  f"{ours['run_true_ms']['median'] / base['run_true_ms']['median']:.2f}x, "
                  f"download {ours['download_mib_s'] / base['download_mib_s']:.2f}x, "
                  f"rps {ours['health_rps_c50'] / base['health_rps_c50']:.2f}x")
        args.json.write_text(json.dumps({
            "params": {"runs": args.runs, "size_mib": args.size_mib,
                       "rps_seconds": args.rps_seconds, "concurrency": 50,
                       "cpus": os.cpu_count(), "rps_tool": "wrk" if shutil.which("wrk") else "httpx"},
            "results": results}, indent=1))
        print(f"samples: {args.json}")
    finally:
        for proc in reversed(procs):
            stop(proc)
        data.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
