"""Sandbox network create/destroy: our NetworkManager against the previous teardown.

Every start of a sandbox (create, resume, fork child) builds a network namespace with a
veth pair, bridge, TAP and nftables rules; every kill and pause takes it down. This bench
runs a real `NetworkManager` whose "host" side is a throwaway namespace (nothing touches
the machine's own network) and measures, in one run:

  * create and destroy, one sandbox at a time (p50 over --n cycles);
  * --burst creates at once, then as many destroys at once (a fork's children);
  * anchors: the previous teardown (delete the host veth, which waits for RCU under the
    rtnl lock, then the namespace: what `destroy` did until the kernel was left to free
    the pair), and the floor (`ip netns add` + removing it, no devices).

    .venv/bin/python bench/bench_network.py [--n 30] [--burst 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host.network import NetworkManager, NetworkManagerConfig
from host.network.commands import Namespace, remove_netns, run

HOST_NS = f"aenvbench-host{os.getpid()}"
PREFIX = "aenvbn-"


async def timed(coro) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    await coro
    return time.perf_counter() - t0


async def previous_teardown(nm: NetworkManager, sid: str) -> None:
    """The teardown before the kernel was left to free the veth pair."""
    net = nm.get(sid)
    await Namespace(HOST_NS).ip("link", "del", net.host_ifname)
    remove_netns(net.netns)
    await nm.destroy(sid)  # forgets it and frees its slot; nothing left to remove


async def measure(n: int, burst: int) -> dict[str, float]:
    res: dict[str, list[float]] = {"create": [], "destroy": [], "destroy_previous": [],
                                   "floor": []}
    config = NetworkManagerConfig(prefix=PREFIX, pool="10.219.0.0/20", host_netns=HOST_NS)
    async with NetworkManager(config) as nm:
        for i in range(n):
            res["create"].append(await timed(nm.create(f"c{i}")))
            await asyncio.sleep(0.05)  # the guest's life: the kernel settles meanwhile
            res["destroy"].append(await timed(nm.destroy(f"c{i}")))
            await asyncio.sleep(0.05)
            await nm.create(f"p{i}")
            await asyncio.sleep(0.05)
            res["destroy_previous"].append(await timed(previous_teardown(nm, f"p{i}")))
            await asyncio.sleep(0.05)
            name = f"{PREFIX}floor{i}"
            res["floor"].append(await timed(run(["ip", "netns", "add", name])))
            remove_netns(name)
        ids = [f"b{i}" for i in range(burst)]
        t_create = await timed(asyncio.gather(*(nm.create(s) for s in ids)))
        t_destroy = await timed(asyncio.gather(*(nm.destroy(s) for s in ids)))
        ids = [f"q{i}" for i in range(burst)]
        await asyncio.gather(*(nm.create(s) for s in ids))
        t_previous = await timed(asyncio.gather(*(previous_teardown(nm, s) for s in ids)))
    out = {f"{k}_p50_s": statistics.median(v) for k, v in res.items()}
    out.update({"burst": burst, "burst_create_s": t_create, "burst_destroy_s": t_destroy,
                "burst_destroy_previous_s": t_previous})
    return out


def report(r: dict[str, float], n: int) -> None:
    ms = 1e3
    floor = r["floor_p50_s"]
    print(f"\nsandbox networks, n={n}, burst={int(r['burst'])}")
    print(f"  {'row':38} {'measured':>10} {'x floor':>8} {'x previous':>11}")
    rows = [
        ("create p50", r["create_p50_s"], None),
        ("destroy p50", r["destroy_p50_s"], r["destroy_previous_p50_s"]),
        ("destroy p50 (previous teardown)", r["destroy_previous_p50_s"], None),
        (f"{int(r['burst'])} creates at once", r["burst_create_s"], None),
        (f"{int(r['burst'])} destroys at once", r["burst_destroy_s"],
         r["burst_destroy_previous_s"]),
        (f"{int(r['burst'])} destroys at once (previous)", r["burst_destroy_previous_s"], None),
        ("floor: ip netns add p50", floor, None),
    ]
    for label, v, prev in rows:
        vs_prev = f"{v / prev:10.2f}x" if prev else ""
        print(f"  {label:38} {v * ms:8.1f}ms {v / floor:7.1f}x {vs_prev:>11}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=30, help="create/destroy cycles")
    ap.add_argument("--burst", type=int, default=16, help="networks made and removed at once")
    ap.add_argument("--json", type=Path, default=Path("out/bench/network.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_network needs root (network namespaces)", file=sys.stderr)
        return 2
    asyncio.run(run(["ip", "netns", "add", HOST_NS]))
    try:
        res = asyncio.run(measure(args.n, args.burst))
    finally:
        remove_netns(HOST_NS)
    report(res, args.n)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
