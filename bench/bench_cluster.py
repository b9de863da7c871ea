"""The cluster's cost: the same sandbox reached through the gateway vs its node directly.

Starts a LocalCluster (`make cluster`: Redis, scheduler, gateway, N nodes in their own
network namespaces, real QEMU VMs), then measures, in the same run:
  * `commands.run("true")` latency via the e2b SDK: gateway vs the node's own API/proxy
    (n sequential runs on one sandbox; median, p95),
  * throughput of `run("true")` with T client threads, one sandbox each, gateway vs node,
  * create latency through the gateway (placement by the scheduler + the node's create)
    vs straight to a node, and the scheduler's placement time per create (the gateway's
    `aenv_gateway_placement_seconds` histogram, when it serves one).
Prints ratios; samples go to --json.

    .venv/bin/python bench/bench_cluster.py [--nodes 3] [--runs 100] [--threads 6]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from host.cluster.local import LocalCluster
from tests.metrics.scrape import parse


@contextmanager
def endpoint(api_url: str, sandbox_url: str, key: str):
    """E2B_* for SDK objects made inside (the SDK reads them when a config is built)."""
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(E2B_API_URL=api_url, E2B_SANDBOX_URL=sandbox_url, E2B_API_KEY=key)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def latency(sbx, runs: int) -> list[float]:
    sbx.commands.run("true")  # warm the connection
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sbx.commands.run("true")
        out.append((time.perf_counter() - t0) * 1000)
    return out


def throughput(boxes, per_thread: int) -> float:
    def work(sbx) -> int:
        for _ in range(per_thread):
            sbx.commands.run("true")
        return per_thread

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(boxes)) as pool:
        done = sum(pool.map(work, boxes))
    return done / (time.perf_counter() - t0)


def placement_seconds(c: LocalCluster) -> tuple[float, float] | None:
    """(sum, count) of the gateway's placement histogram, if it has one."""
    try:
        page = parse(httpx.get(f"{c.gateway_url}/metrics", timeout=10).text)
    except (httpx.HTTPError, ValueError):
        return None
    total = page.total("aenv_gateway_placement_seconds_sum")
    count = page.total("aenv_gateway_placement_seconds_count")
    return (total, count) if count else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--per-thread", type=int, default=20)
    ap.add_argument("--creates", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from e2b import Sandbox

    c = LocalCluster(nodes=args.nodes, prefix="abc", subnet="10.252", pool_base=240,
                     gateway_port=18080, scheduler_port=19090, redis_port=16390,
                     node_args=["--memory-mb", "256"])
    print(f"starting a {args.nodes}-node cluster ...", flush=True)
    c.start()
    out: dict[str, object] = {}
    made = []
    try:
        gw = (c.gateway_url, c.gateway_url, c.api_key)
        node = (f"http://{c.node_addr(1)}:3000", f"http://{c.node_addr(1)}:3001", c.api_key)
        # first creates build each node's default template: not timed
        with endpoint(*gw):
            made += [Sandbox.create(timeout=900) for _ in range(args.nodes)]
        with endpoint(*node):
            made.append(Sandbox.create(timeout=900))
        before = placement_seconds(c)

        creates: dict[str, list[float]] = {"gateway": [], "node": []}
        for _ in range(args.creates):
            for name, where in (("gateway", gw), ("node", node)):
                with endpoint(*where):
                    t0 = time.perf_counter()
                    made.append(Sandbox.create(timeout=900))
                    creates[name].append((time.perf_counter() - t0) * 1000)
        after = placement_seconds(c)
        place_ms = None
        if before is not None and after is not None and after[1] > before[1]:
            place_ms = (after[0] - before[0]) / (after[1] - before[1]) * 1000

        # one sandbox on node 1, reached both ways
        with endpoint(*node):
            target = Sandbox.create(timeout=900)
            made.append(target)
            direct = Sandbox.connect(target.sandbox_id)
        with endpoint(*gw):
            via = Sandbox.connect(target.sandbox_id)
        lat = {"node": latency(direct, args.runs), "gateway": latency(via, args.runs)}

        with endpoint(*node):
            local = [Sandbox.create(timeout=900) for _ in range(args.threads)]
            made += local
            local_direct = [Sandbox.connect(s.sandbox_id) for s in local]
        with endpoint(*gw):
            local_via = [Sandbox.connect(s.sandbox_id) for s in local]
        tput = {"node": throughput(local_direct, args.per_thread),
                "gateway": throughput(local_via, args.per_thread)}
    finally:
        for s in made:
            try:
                s.kill()
            except Exception as exc:  # noqa: BLE001 - the cluster's stop kills what is left
                print(f"kill {s.sandbox_id}: {exc!r}", file=sys.stderr)
        c.stop()

    def row(name: str, g: float, n: float, unit: str) -> None:
        print(f"{name:<38} {g:>10.1f} {n:>10.1f} {unit:<6} {g / n:>7.2f}x")

    print(f"\n{'':<38} {'gateway':>10} {'node':>10} {'':<6} {'ratio':>8}")
    row("run('true') p50", statistics.median(lat["gateway"]), statistics.median(lat["node"]),
        "ms")
    row("run('true') p95", pct(lat["gateway"], 95), pct(lat["node"], 95), "ms")
    row(f"run('true') throughput, {args.threads} threads", tput["gateway"], tput["node"],
        "/s")
    row("create p50", statistics.median(creates["gateway"]),
        statistics.median(creates["node"]), "ms")
    print(f"placement per create (scheduler, via the gateway): "
          f"{'n/a' if place_ms is None else f'{place_ms:.1f} ms'}")
    out.update(latency_ms=lat, throughput_per_s=tput, create_ms=creates, placement_ms=place_ms,
               nodes=args.nodes, runs=args.runs, threads=args.threads)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
