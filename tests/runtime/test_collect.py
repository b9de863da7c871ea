"""Collection of layers and memory files (host/runtime/collect.py) with real VMs, a real
block server and the node's own posix_fs repository: a lifecycle whose snapshots lost
their manifests (a commit cut short, a crash between a manifest's delete and its files')
leaves nothing once collected, what live sandboxes and templates use stays, and a start
that read a manifest deleted meanwhile still gets its layers (pins)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from host.contract import SnapshotRef
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime
from host.runtime.collect import collect
from host.storage.collect import layer_hex

from .helpers import read, run, write

NET = NetworkConfig()
MiB = 1 << 20


def _counts(rt: NodeRuntime) -> dict[str, int]:
    repo = rt.config.state_dir / "repo"

    def n(d: Path, pattern: str = "*") -> int:
        return len(list(d.glob(pattern))) if d.is_dir() else 0

    return {"layers": n(rt.config.layers_dir, "*.lsmt"),
            "repository_layers": n(repo / "layers", "*.lsmt"),
            "memory": n(rt.config.memory_dir),
            "repository_memory": n(repo / "files" / "memory")}


def _total(report: dict[str, Any]) -> int:
    return sum(int(report[k]["bytes"]) for k in
               ("layers", "repository_layers", "memory", "repository_memory"))


async def test_a_lifecycle_whose_manifests_are_gone_leaves_nothing_once_collected(
        runtime: NodeRuntime, template: SnapshotRef) -> None:
    parts = runtime.parts
    await collect(parts, min_age_s=0)  # what earlier tests left
    before = _counts(runtime)
    keep_sid = "gc-keep"
    keeper = await runtime.start(keep_sid, template, NET)
    sid = "gc-life"
    try:
        await write(keeper, "/home/user/kept.txt", "still here")
        p = await runtime.start(sid, template, NET)
        await run(p, "head -c 8M /dev/urandom > /home/user/blob && sync")
        s1 = await runtime.snapshot(sid, "gc-life-1", stop=True)
        p = await runtime.start(sid, s1, NET)
        await run(p, "head -c 4M /dev/urandom > /home/user/blob2 && sync")
        await runtime.snapshot(sid, "gc-life-2", stop=True)
        grown = _counts(runtime)
        print(f"\nbefore {before}\nafter two pauses {grown}")
        assert grown["layers"] >= before["layers"] + 2
        assert grown["memory"] >= before["memory"] + 1
        # the snapshots' manifests go, their files stay: what a crash between the two, or
        # a commit cut after its files were written, leaves
        for snap in ("gc-life-1", "gc-life-2"):
            await parts.manifests.delete(snap)

        dry = await collect(parts, dry_run=True, min_age_s=0)
        assert dry["layers"]["files"] >= 2 and _counts(runtime) == grown  # nothing removed
        out = await collect(parts, min_age_s=0)
        after = _counts(runtime)
        print(f"collected {_total(out) / MiB:.1f} MiB: "
              + ", ".join(f"{k} {out[k]['files']}" for k in after) + f"\nafter {after}")
        assert after == before
        assert _total(out) >= 12 * MiB  # the two blobs, written into two layers
        assert out["held"]["layers"] > 0
        # the live sandbox, the template and the image layers were kept
        assert await read(keeper, "/home/user/kept.txt") == "still here"
        again = await runtime.start("gc-again", template, NET)
        assert (await run(again, "echo ok")).strip() == "ok"
        await runtime.kill("gc-again")
    finally:
        await runtime.kill(keep_sid)
        await runtime.kill(sid)


async def test_a_start_keeps_the_layers_of_a_manifest_deleted_after_it_read_it(
        runtime: NodeRuntime, template: SnapshotRef) -> None:
    """The snapshot is deleted and a collection runs between the start's manifest read and
    its stack's creation: the start's pins keep its layers and memory (without them the
    stack's create fails: layer not found)."""
    parts = runtime.parts
    src = "gc-src"
    p = await runtime.start(src, template, NET)
    await write(p, "/home/user/mark.txt", "pinned")
    await run(p, "sync")  # on the disk, so the pause seals a layer of its own
    snap = await runtime.snapshot(src, "gc-pinned", stop=True)
    assert len(snap.facts["disk"]["layers"]) > len(template.facts["disk"]["layers"])
    provision = parts.machines.provision
    collected: list[dict[str, Any]] = []

    async def delete_then_provision(sid: str, layers: list[str], policy: Any) -> Any:
        if sid == "gc-dst":
            await parts.manifests.delete("gc-pinned")
            collected.append(await collect(parts, min_age_s=0))
        return await provision(sid, layers, policy)

    parts.machines.provision = delete_then_provision  # type: ignore[method-assign]
    try:
        q = await runtime.start("gc-dst", snap, NET)
        assert await read(q, "/home/user/mark.txt") == "pinned"
        assert collected and layer_hex(snap.facts["disk"]["layers"][-1]) not in \
            collected[0]["layers"]["digests"]
    finally:
        parts.machines.provision = provision  # type: ignore[method-assign]
        await runtime.kill("gc-dst")
        await runtime.kill(src)
    # nothing needs them now: the next collection takes them
    out = await collect(parts, min_age_s=0)
    assert layer_hex(snap.facts["disk"]["layers"][-1]) in out["layers"]["digests"]
    assert "gc-pinned" in out["memory"]["digests"]


async def test_collections_while_16_children_start_from_a_deleted_snapshot(
        runtime: NodeRuntime, template: SnapshotRef) -> None:
    """16 children read a snapshot's manifest, then it is deleted and collections run
    again and again while they create their stacks and restore its memory: every child
    boots with the snapshot's data (their pins, then their stacks and VMs, hold it)."""
    parts = runtime.parts
    src, n = "gc16-src", 16
    p = await runtime.start(src, template, NET)
    await write(p, "/home/user/mark.txt", "for the children")
    await run(p, "sync")
    snap = await runtime.snapshot(src, "gc16", stop=True)
    provision = parts.machines.provision
    entered, all_in, go = 0, asyncio.Event(), asyncio.Event()

    async def gated(sid: str, layers: list[str], policy: Any) -> Any:
        nonlocal entered
        if sid.startswith("gc16-c"):
            entered += 1
            if entered == n:
                all_in.set()
            await go.wait()  # every child has read the manifest and pinned what it names
        return await provision(sid, layers, policy)

    kids = [f"gc16-c{i}" for i in range(n)]
    parts.machines.provision = gated  # type: ignore[method-assign]
    starts = [asyncio.create_task(runtime.start(k, snap, NET)) for k in kids]
    try:
        await asyncio.wait_for(all_in.wait(), 300)
        await parts.manifests.delete("gc16")
        runs = [await collect(parts, min_age_s=0)]
        go.set()
        while not all(t.done() for t in starts):
            runs.append(await collect(parts, min_age_s=0))
            await asyncio.sleep(0.05)
        placements = await asyncio.gather(*starts)
        taken = {d for r in runs for d in r["layers"]["digests"]}
        print(f"\n{len(runs)} collections while {n} children started; none took their layers")
        assert not taken & {layer_hex(d) for d in snap.facts["disk"]["layers"]}
        texts = await asyncio.gather(*(read(pl, "/home/user/mark.txt") for pl in placements))
        assert texts == ["for the children"] * n
    finally:
        parts.machines.provision = provision  # type: ignore[method-assign]
        go.set()
        await asyncio.gather(*starts, return_exceptions=True)
        for sid in (*kids, src):
            await runtime.kill(sid)


async def test_build_cache_entries_unused_past_their_ttl_go_with_their_layers(
        runtime: NodeRuntime) -> None:
    """Build-step and OCI-import cache entries are roots only while used: one unused for
    `build_cache_ttl_s` is dropped and its layer collected; a hit keeps an entry (it
    rewrites `used_at`), an entry from before `used_at` existed is stamped (one whole
    period), and nothing expires while the node builds."""
    from host.runtime.buildcache import last_used, read_entry

    parts = runtime.parts
    client = parts.block.client
    digests = []
    for i in range(3):  # three distinct sealed layers, named by nothing but their entry
        stack = f"cache-layer-{i}"
        await client.create(stack, virtual_size=MiB)
        await asyncio.to_thread(_write_through_nbd, runtime, stack, bytes([i + 1]) * 4096)
        digests.append(await client.seal(stack))
        await client.delete(stack)
    week = 7 * 86400.0
    ancient = {"used_at": 1.0}
    await parts.manifests.put_doc("buildstep-old", {"layers": [digests[0]], **ancient})
    await parts.manifests.put_doc("ocilayer-hit", {"layers": [digests[1]], **ancient})
    await parts.manifests.put_doc("buildstep-legacy", {"layers": [digests[2]]})
    assert await read_entry(parts.manifests, "ocilayer-hit") is not None  # a hit: a use
    assert parts.config.build_cache_ttl_s == week  # the default
    parts.building.add("some-build")
    try:
        held = await collect(parts, min_age_s=0)
        assert held["build_cache"]["files"] == 0
        assert all(has_layer(runtime, d) for d in digests)
    finally:
        parts.building.discard("some-build")
    dry = await collect(parts, dry_run=True, min_age_s=0)
    assert dry["build_cache"]["digests"] == ["buildstep-old"]
    assert await parts.manifests.get_doc("buildstep-old") is not None
    out = await collect(parts, min_age_s=0)
    assert out["build_cache"]["digests"] == ["buildstep-old"]
    assert await parts.manifests.get_doc("buildstep-old") is None
    assert not has_layer(runtime, digests[0])  # its layer went with it
    assert has_layer(runtime, digests[1]) and has_layer(runtime, digests[2])
    legacy = await parts.manifests.get_doc("buildstep-legacy")
    assert legacy is not None and last_used(legacy) is not None  # stamped: one period
    for name in ("ocilayer-hit", "buildstep-legacy"):
        await parts.manifests.delete_doc(name)
    await collect(parts, min_age_s=0)


def has_layer(runtime: NodeRuntime, digest: str) -> bool:
    return (runtime.config.layers_dir / f"{layer_hex(digest)}.lsmt").exists()


def _write_through_nbd(runtime: NodeRuntime, stack: str, data: bytes) -> None:
    import subprocess

    uri = f"nbd+unix:///{stack}?socket={runtime.block.nbd_socket}"
    subprocess.run(["qemu-io", "-f", "raw", "-c", f"write -P {data[0]} 0 {len(data)}", uri],
                   check=True, capture_output=True, timeout=60)
