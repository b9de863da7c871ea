"""Templates from OCI images on real VMs: an image pushed into a registry on loopback
(Debian's docker-registry) is pulled, each layer applied on the host (no VM: the confined
helper; the first layer by mke2fs -d, the next through fuse2fs) into a block layer keyed by its chain id, init + envd added; a busybox-only image (no libc, no
init, no envd) becomes a working sandbox; images sharing a base layer share its block
layer; bad references and credentials fail the build cleanly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from host.contract import (
    BuildFailed,
    BuildSpec,
    BuildStep,
    MachineSpec,
    NetworkConfig,
    RegistryAuth,
)
from host.runtime import NodeRuntime
from host.runtime.parts import build_stack
from tests.images.conftest import PushedImages, Registry

from .helpers import assert_gone, netns_names, run

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

MACHINE = MachineSpec(memory_mb=256)
FREE_MIB = 5000  # minFreeDiskMb: more than an imported image's 4 GiB filesystem leaves


def _repo_layers(rt: NodeRuntime) -> dict[str, int]:
    """Block layers in the (posix_fs) repository: digest -> bytes on disk."""
    root = Path(rt.config.state_dir) / "repo" / "layers"
    return {"sha256:" + p.stem: p.stat().st_blocks * 512 for p in root.glob("*.lsmt")}


async def test_busybox_image_becomes_a_template(runtime: NodeRuntime, registry: Registry,
                                                images: PushedImages) -> None:
    logs: list[tuple[str, str, str | None]] = []
    spec = BuildSpec(snapshot_id="img-bb", machine=MACHINE, min_free_disk_mb=FREE_MIB,
                     from_image=f"{registry.host}/busybox:1",
                     steps=(BuildStep("RUN", ("echo $GREETING > /srv/greeting.txt",)),))
    ref = await runtime.build(spec, lambda lvl, msg, step: logs.append((lvl, msg, step)))
    assert ref.facts["guest"]["workdir"] == "/srv"
    assert ref.facts["guest"]["env"]["GREETING"] == "hello world"
    assert any("applying layer 1/1" in msg for _, msg, _ in logs)
    assert any(msg.startswith("applied ") and "MiB/s" in msg for _, msg, _ in logs), logs
    # its gzip inflated by igzip beside the helper's reading (host/images/gunzip.py)
    assert any("inflated by igzip" in msg for _, msg, _ in logs), logs
    # its VM restored from the node's builder (host/runtime/builder.py), then switched onto
    # the image's disk, grown there
    assert ("info", "Restoring the build VM from the node's builder", "base") in logs, logs
    assert not any(msg == "Booting the build VM" for _, msg, _ in logs), logs
    assert any("switched onto /dev/vda" in msg for _, msg, _ in logs), logs
    # the first layer (only the blank ext4 below) becomes a new ext4 of its tree
    assert any("a new ext4 by mke2fs -d" in msg for _, msg, _ in logs), logs
    # grown for minFreeDiskMb by our init at boot: busybox has no python3 to do it
    grown_mib = ref.facts["disk"]["virtual_size"] >> 20
    assert grown_mib >= FREE_MIB and ("info", f"disk grown to {grown_mib} MiB", "base") in logs
    # nothing of the import is left: its stack, its raw copies, the helper's scripts
    stacks = [i.name for i in await runtime.block.client.list()]
    assert build_stack("img-bb") + "-t" not in stacks
    assert not list(runtime.config.state_dir.glob(".import-*"))
    name = build_stack("img-bb")
    assert not any(name in n for n in netns_names())
    assert not (runtime.config.vms_dir / name).exists()
    sid = "img-sbx"
    p = await runtime.start(sid, ref, NetworkConfig())
    try:
        out = await run(p, "cat /srv/greeting.txt; ls /lib 2>/dev/null | wc -l; "
                           "readlink /bin/sh; id -u user; df -Pm / | tail -1")
        greeting, libs, sh, user, df = out.strip().split("\n")
        assert int(df.split()[3]) >= FREE_MIB, df  # available MiB
        assert greeting == "hello world"
        assert libs.strip() == "0" and sh.endswith("busybox")  # no libc: busybox alone
        assert user == "1000"  # added for E2B's default user (the orchestrator's /init)
    finally:
        await runtime.kill(sid)
    await assert_gone(runtime, sid)
    # the same image again: every layer (and the init/envd layer) comes from the cache
    again_logs: list[str] = []
    again = await runtime.build(dataclasses.replace(spec, snapshot_id="img-bb2"),
                                lambda lvl, msg, step: again_logs.append(msg))
    assert any(m.startswith("CACHED image") for m in again_logs)
    assert again.facts["build"]["cached_steps"] == 1
    for s in ("img-bb", "img-bb2"):
        await runtime.delete_snapshot(s)


async def test_images_sharing_a_base_layer_share_its_block_layer(
        runtime: NodeRuntime, registry: Registry, images: PushedImages) -> None:
    before = _repo_layers(runtime)
    logs1: list[str] = []
    one = await runtime.build(BuildSpec(snapshot_id="img-a1", machine=MACHINE,
                                        from_image=f"{registry.host}/app1:1"),
                              lambda lvl, msg, step: logs1.append(msg))
    after_one = _repo_layers(runtime)
    logs2: list[str] = []
    two = await runtime.build(BuildSpec(snapshot_id="img-a2", machine=MACHINE,
                                        from_image=f"{registry.host}/app2:1"),
                              lambda lvl, msg, step: logs2.append(msg))
    after_two = _repo_layers(runtime)
    l1, l2 = one.facts["disk"]["layers"], two.facts["disk"]["layers"]
    # blank ext4, then the busybox chain id's block layer: the same object for both images
    assert l1[:2] == l2[:2] and l1[2:] != l2[2:]
    shared = l1[1]
    assert shared in after_one
    # app2 applied only its own layer (the busybox one was imported for app1 or earlier)
    assert any("1 of 2 layers to apply" in m for m in logs2), logs2
    assert any("through fuse2fs" in m for m in logs2), logs2  # onto the shared layer
    new1 = sum(v for k, v in after_one.items() if k not in before)
    new2 = sum(v for k, v in after_two.items() if k not in after_one)
    print(f"\nshared busybox block layer: {after_one[shared]} bytes on disk, stored once; "
          f"new bytes for app1 {new1}, for app2 {new2}")
    assert new2 < new1 or shared not in set(after_one) - set(before)
    sid = "img-app2"
    p = await runtime.start(sid, two, NetworkConfig())
    try:
        assert (await run(p, "cat /app/two; ls /app")).split() == ["2", "two"]
    finally:
        await runtime.kill(sid)
    for s in ("img-a1", "img-a2"):
        await runtime.delete_snapshot(s)


async def test_missing_image_and_bad_credentials_fail_cleanly(
        runtime: NodeRuntime, registry: Registry, auth_registry: Registry,
        images: PushedImages) -> None:
    cases = [
        (BuildSpec(snapshot_id="img-miss", machine=MACHINE,
                   from_image=f"{registry.host}/no-such-image:1"), "not found"),
        (BuildSpec(snapshot_id="img-auth", machine=MACHINE,
                   from_image=f"{auth_registry.host}/private/busybox:1",
                   registry=RegistryAuth("alice", "wrong")), "auth"),
    ]
    for spec, why in cases:
        with pytest.raises(BuildFailed) as err:
            await runtime.build(spec, lambda *a: None)
        assert err.value.step == "base" and why in str(err.value).lower(), str(err.value)
        assert await runtime.find_snapshot(spec.snapshot_id) is None
        assert not (runtime.config.memory_dir / spec.snapshot_id).exists()
        # the builder it started beside the pull (builder.py) ended with it: no half-made
        # builder, and nothing of its VM
        name = build_stack(spec.snapshot_id) + "-b"
        assert not list((runtime.config.state_dir / "builders").glob(".*"))
        assert name not in [i.name for i in await runtime.block.client.list()]
        assert not (runtime.config.vms_dir / name).exists()
        assert not any(name in n for n in netns_names())
    ok = await runtime.build(BuildSpec(snapshot_id="img-priv", machine=MACHINE,
                                       from_image=f"{auth_registry.host}/private/busybox:1",
                                       registry=RegistryAuth("alice", "s3cret")),
                             lambda *a: None)
    assert ok.facts["guest"]["env"]["GREETING"] == "hello world"
    await runtime.delete_snapshot("img-priv")
