"""The node's builder (host/runtime/builder.py) on real VMs: a template build from an image
restores its VM from a saved VM that booted envd on a tmpfs root, then switches every
process onto the image's disk (rootfs/init/init.c `switch-root`); a builder is made once
per machine shape and reused; one that cannot be restored is dropped and the build
cold-boots; a sandbox from such a template runs on the image's root, with its files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from host.contract import BuildSpec, BuildStep, MachineSpec, NetworkConfig
from host.runtime import NodeRuntime, builder
from host.runtime.parts import build_stack
from tests.images.conftest import Registry
from tests.images.ocibuild import LayerTar, OciLayout, busybox_layer, push

from .helpers import assert_gone, netns_names, run

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

MACHINE = MachineSpec(memory_mb=256)


@pytest.fixture(scope="module")
def bld_images(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Images of this module's own (no layer shared with the other tests' images, whose
    imports they expect to make): `one` (a busybox userland), `two` (another one with
    /app/one on top)."""
    layout = OciLayout(tmp_path_factory.mktemp("bld-oci"))
    one = layout.image([busybox_layer(b"bld-one\n")], config={"Env": ["PATH=/bin"]})
    two = layout.image([busybox_layer(b"bld-two\n"),
                        LayerTar().dir("app").file("app/one", b"1\n").bytes()],
                       config={"Env": ["PATH=/bin"]})
    refs = {}
    for name, img in (("one", one), ("two", two)):
        refs[name] = f"{registry.host}/bld/{name}:1"
        push(layout.tag(name, img.manifest), refs[name])
    return refs
STEP = BuildStep("RUN", ("mkdir -p /srv && echo built > /srv/built.txt", "root"))


def _builders(rt: NodeRuntime) -> list[Path]:
    root = rt.config.state_dir / "builders"
    return sorted(root.iterdir()) if root.is_dir() else []


async def _build(rt: NodeRuntime, sid: str, image: str) -> list[str]:
    """A build of `image` that runs STEP and one step of its own (never reused whole)."""
    logs: list[str] = []
    own = BuildStep("RUN", (f"echo {sid} > /srv/id", "root"))
    await rt.build(BuildSpec(snapshot_id=sid, machine=MACHINE, from_image=image,
                             steps=(STEP, own)), lambda _lvl, msg, _step: logs.append(msg))
    return logs


async def test_a_builder_is_made_once_reused_and_its_vm_runs_on_the_image(
        runtime: NodeRuntime, bld_images: dict[str, str]) -> None:
    first = await _build(runtime, "bld-one", bld_images["one"])
    assert "Restoring the build VM from the node's builder" in first, first
    assert any("switched onto /dev/vda" in m for m in first), first
    made = _builders(runtime)
    assert len([d for d in made if not d.name.startswith(".")]) >= 1, made
    # another image, the same machine: the same builder, not made again
    second = await _build(runtime, "bld-two", bld_images["two"])
    assert "Restoring the build VM from the node's builder" in second, second
    assert not any(m.startswith("Made a builder") for m in second), second
    assert _builders(runtime) == made
    # nothing of the builder's own VM is left: no VM dir, stack or namespace of `<build>-b`
    for sid in ("bld-one", "bld-two"):
        name = build_stack(sid) + "-b"
        assert not (runtime.config.vms_dir / name).exists()
        assert name not in [i.name for i in await runtime.block.client.list()]
        assert not any(name in n for n in netns_names())
    ref = await runtime.find_snapshot("bld-two")
    assert ref is not None
    sid = "bld-sbx"
    p = await runtime.start(sid, ref, NetworkConfig())
    try:
        out = await run(p, "cat /srv/built.txt /app/one; grep ' / ' /proc/mounts; "
                           "ls / | grep -c newroot; ls -d /run/aenv/envd")
        built, one, root_mount, newroot, envd_dir = out.strip().split("\n")
        assert built == "built" and one == "1"  # the RUN step and the image's file
        assert root_mount.startswith("/dev/vda / ext4 "), root_mount
        assert newroot == "0"  # the builder's tmpfs root is gone from the view
        assert envd_dir == "/run/aenv/envd"  # envd's unpacked self moved along with /run
        # on its disk now: init refuses another switch (the builder's mark is gone)
        again = await run(p, "/usr/sbin/aenv-init switch-root 2>&1; echo exit=$?; "
                             "ls /run/aenv/builder 2>/dev/null | wc -l; cat /srv/built.txt")
        assert "not a builder" in again and "exit=1" in again, again
        assert again.strip().split("\n")[-2:] == ["0", "built"], again
    finally:
        await runtime.kill(sid)
    await assert_gone(runtime, sid)
    for s in ("bld-one", "bld-two"):
        await runtime.delete_snapshot(s)


async def test_a_builder_that_cannot_be_restored_is_dropped_and_the_build_boots(
        runtime: NodeRuntime, bld_images: dict[str, str]) -> None:
    await _build(runtime, "bld-warm", bld_images["one"])  # one exists: the latest used
    used = max((d for d in _builders(runtime) if not d.name.startswith(".")),
               key=lambda d: d.stat().st_mtime_ns)
    (used / "state").write_bytes(b"not a QEMU migration stream")
    logs = await _build(runtime, "bld-cold", bld_images["one"])
    assert any(m.startswith("the builder failed") for m in logs), logs
    assert "Booting the build VM" in logs, logs
    assert not used.exists()  # dropped: the next build makes another
    ref = await runtime.find_snapshot("bld-cold")
    assert ref is not None
    p = await runtime.start("bld-sbx2", ref, NetworkConfig())
    try:
        assert (await run(p, "cat /srv/built.txt")).strip() == "built"
    finally:
        await runtime.kill("bld-sbx2")
    again = await _build(runtime, "bld-again", bld_images["one"])
    assert any(m.startswith("Made a builder") for m in again), again
    for s in ("bld-warm", "bld-cold", "bld-again"):
        await runtime.delete_snapshot(s)


async def test_a_builder_being_made_is_not_reaped_as_an_orphan(
        runtime: NodeRuntime, bld_images: dict[str, str]) -> None:
    """The builder's VM, stack and network are named after the build (`<build>-b`): the
    node's reaping of orphans (a periodic reconcile) leaves them while the build runs."""
    machine = MachineSpec(memory_mb=288)  # a shape no builder exists for yet
    logs: list[str] = []
    build = asyncio.create_task(runtime.build(
        BuildSpec(snapshot_id="bld-reap", machine=machine, from_image=bld_images["one"],
                  steps=(STEP,)), lambda _lvl, msg, _step: logs.append(msg)))
    vm_dir = runtime.config.vms_dir / (build_stack("bld-reap") + "-b")
    try:
        async with asyncio.timeout(300):
            while not (vm_dir / "pid").exists():
                assert not build.done(), logs
                await asyncio.sleep(0.05)
        reaped = await runtime.reap_orphans(known=set(runtime.sandboxes))
        assert not any("bld-reap" in r for r in reaped), reaped
        await build
    finally:
        if not build.done():
            build.cancel()
    assert any(m.startswith("Made a builder") for m in logs), logs
    assert "Restoring the build VM from the node's builder" in logs, logs
    await runtime.delete_snapshot("bld-reap")


async def test_a_builder_still_on_its_disk_is_not_saved(
        runtime: NodeRuntime, bld_images: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Init says `ready` only once the builder's disk is let go; without that word (here:
    the host looks for another file) no builder is saved and the build cold-boots."""
    monkeypatch.setattr(builder, "BUILDER_READY", "/run/aenv/no-such-word")
    before = _builders(runtime)
    logs: list[str] = []
    await runtime.build(BuildSpec(snapshot_id="bld-unready", machine=MachineSpec(memory_mb=304),
                                  from_image=bld_images["one"], steps=(STEP,)),
                        lambda _lvl, msg, _step: logs.append(msg))
    assert any("no builder" in m and "did not leave its disk" in m for m in logs), logs
    assert "Booting the build VM" in logs, logs
    assert _builders(runtime) == before  # nothing saved, nothing half-made left
    await runtime.delete_snapshot("bld-unready")
