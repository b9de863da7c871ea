"""Template builds on real VMs: steps run in a build VM through envd, each step's disk
changes cached as a layer; the start command is running (and ready) in the template's
memory snapshot; a rebuild hits the cache; a failing step leaves nothing behind."""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from host.contract import BuildFailed, BuildSpec, BuildStep, MachineSpec, NetworkConfig, SnapshotRef
from host.runtime import NodeRuntime, builds
from host.runtime.parts import build_stack

from .helpers import assert_gone, netns_names, run

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

PORT = 8000
READY = f'[ -n "$(ss -Htuln sport = :{PORT})" ]'  # what the SDK's wait_for_port sends
MARKER = "aenv-start-marker"


def _archive(files_dir: Path, name: str, files: dict[str, str]) -> str:
    """A COPY archive as the SDK uploads it (gzipped tar, paths relative to the context)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    files_dir.mkdir(parents=True, exist_ok=True)
    (files_dir / name).write_bytes(buf.getvalue())
    return name


def _steps(files_hash: str, last: str = "echo built > /app/built.txt") -> tuple[BuildStep, ...]:
    return (
        BuildStep("ENV", ("GREETING", "hello world")),
        BuildStep("RUN", ("mkdir -p /app && chown user:user /app", "root")),
        BuildStep("COPY", ("site/index.html", "/app/", "", "0644"), files_hash=files_hash),
        BuildStep("WORKDIR", ("/app",)),
        BuildStep("RUN", ('echo "$GREETING from $(whoami) in $(pwd)" > env.txt',)),
        # E2B runs a RUN step with `/bin/bash -l -c`: bash syntax and a login shell
        BuildStep("RUN", (('[[ $0 == */bash ]] && shopt -q login_shell && echo bash -l '
                          '> shell.txt'),)),
        BuildStep("RUN", (last,)),
    )


async def test_build_run_copy_env_workdir_start_ready_and_cache(
        runtime: NodeRuntime, template: SnapshotRef, tmp_path: Path) -> None:
    files = tmp_path / "files"
    h = _archive(files, "a" * 64, {"site/index.html": "<h1>built by aenv</h1>\n"})
    logs: list[tuple[str, str, str | None]] = []
    spec = BuildSpec(snapshot_id="bt-1", machine=MachineSpec(memory_mb=256),
                     from_snapshot=template.snapshot_id, steps=_steps(h),
                     # `exec -a` is a bash builtin: E2B runs start commands through bash too
                     start_cmd=f"(exec -a {MARKER} sleep infinity) & "
                               f"python3 -m http.server {PORT}", ready_cmd=READY,
                     files_dir=files)
    t0 = time.perf_counter()
    ref = await runtime.build(spec, lambda lvl, msg, step: logs.append((lvl, msg, step)))
    first_s = time.perf_counter() - t0
    assert ref.facts["guest"] == {"user": "user", "workdir": "/app",
                                  "env": {"GREETING": "hello world"}}
    assert ref.facts["build"]["cached_steps"] == 0
    assert any(step == "finalize" and "Ready" in msg for _, msg, step in logs)
    assert not any(d for d in netns_names() if build_stack("bt-1") in d)

    sid = "bt-sbx"
    p = await runtime.start(sid, ref, NetworkConfig())
    try:
        out = await run(p, "cat /app/env.txt /app/index.html /app/built.txt /app/shell.txt; "
                           "stat -c '%U %a' /app/index.html")
        assert out.split("\n")[:5] == ["hello world from user in /app",
                                       "<h1>built by aenv</h1>", "built", "bash -l", "user 644"]
        # the start command's renamed process lives on in the sandbox
        assert MARKER in await run(p, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
        host, port = p.address(PORT)  # the start command's server is already up
        async with httpx.AsyncClient(trust_env=False) as http:
            r = await http.get(f"http://{host}:{port}/index.html", timeout=30)
        assert r.status_code == 200 and "built by aenv" in r.text
    finally:
        await runtime.kill(sid)
    await assert_gone(runtime, sid)

    # every input unchanged: the ready build is reused, no VM boots
    t0 = time.perf_counter()
    again = await runtime.build(BuildSpec(**{**spec.__dict__, "snapshot_id": "bt-2"}),
                                lambda *a: None)
    second_s = time.perf_counter() - t0
    assert again.facts["build"]["cached_steps"] == len(spec.steps)
    assert again.facts["build"]["reused"] == "bt-1"
    assert not any(k.startswith("boot") or k.endswith("boot_s") for k in runtime.last_timings)
    # the old build deleted (a rebuild moves the tag): the reuse keeps what it needs
    await runtime.delete_snapshot("bt-1")
    p = await runtime.start(sid, again, NetworkConfig())
    try:
        assert (await run(p, "cat /app/built.txt /app/shell.txt")).split("\n")[:2] == [
            "built", "bash -l"]
        assert MARKER in await run(p, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
    finally:
        await runtime.kill(sid)
    # skip_cache builds anew: every step runs, no reuse
    forced = await runtime.build(BuildSpec(**{**spec.__dict__, "snapshot_id": "bt-4",
                                              "force": True}), lambda *a: None)
    assert forced.facts["build"]["cached_steps"] == 0 and "reused" not in forced.facts["build"]
    # a ready build whose memory would not restore here (another VM configuration) is
    # not reused: the build boots a VM
    manifests = runtime.parts.manifests
    m4 = await manifests.get("bt-4")
    await manifests.put("bt-4", {**m4, "config_sha256": "0" * 64})
    fresh = await runtime.build(BuildSpec(**{**spec.__dict__, "snapshot_id": "bt-5"}),
                                lambda *a: None)
    assert "reused" not in fresh.facts["build"] and "cold_boot_s" in runtime.last_timings
    again = await runtime.build(BuildSpec(**{**spec.__dict__, "snapshot_id": "bt-6"}),
                                lambda *a: None)
    assert again.facts["build"]["reused"] == "bt-5"
    # one changed step (the last): only it runs again
    changed = BuildSpec(**{**spec.__dict__, "snapshot_id": "bt-3",
                           "steps": _steps(h, last="echo changed > /app/built.txt")})
    third = await runtime.build(changed, lambda *a: None)
    assert third.facts["build"]["cached_steps"] == len(spec.steps) - 1
    print(f"\nbuild: first {first_s:.1f}s, all cached {second_s:.1f}s; "
          f"timings {runtime.last_timings}")
    p = await runtime.start(sid, third, NetworkConfig())
    try:
        assert (await run(p, "cat /app/built.txt /app/env.txt")).split("\n")[:2] == [
            "changed", "hello world from user in /app"]
    finally:
        await runtime.kill(sid)
    for s in ("bt-2", "bt-3", "bt-4", "bt-5", "bt-6"):
        await runtime.delete_snapshot(s)


async def test_failing_step_fails_the_build_and_leaves_nothing(
        runtime: NodeRuntime, template: SnapshotRef) -> None:
    logs: list[tuple[str, str, str | None]] = []
    spec = BuildSpec(snapshot_id="bt-bad", machine=MachineSpec(memory_mb=256),
                     from_snapshot=template.snapshot_id,
                     steps=(BuildStep("RUN", ("echo about to fail; exit 3",)),))
    with pytest.raises(BuildFailed) as err:
        await runtime.build(spec, lambda lvl, msg, step: logs.append((lvl, msg, step)))
    # E2B's builder's words
    assert err.value.step == "1" and str(err.value) == (
        "failed to run command 'echo about to fail; exit 3': exit status 3")
    assert ("info", "about to fail", "1") in logs
    name = build_stack("bt-bad")
    assert name not in [i.name for i in await runtime.block.client.list()]
    assert not (runtime.config.vms_dir / name).exists()
    assert not (runtime.config.memory_dir / "bt-bad").exists()
    assert await runtime.find_snapshot("bt-bad") is None
    assert not any(name in d for d in netns_names())


async def test_run_as_a_user_that_does_not_exist(runtime: NodeRuntime,
                                                template: SnapshotRef) -> None:
    spec = BuildSpec(snapshot_id="bt-nouser", machine=MachineSpec(memory_mb=256),
                     from_snapshot=template.snapshot_id,
                     steps=(BuildStep("RUN", ("whoami", "root123")),))
    with pytest.raises(BuildFailed) as err:
        await runtime.build(spec, lambda *a: None)
    # what both E2B SDK suites match
    assert str(err.value) == ("failed to run command 'whoami': command failed: "
                              "unauthenticated: invalid username: 'root123'"), str(err.value)
    assert err.value.step == "1" and await runtime.find_snapshot("bt-nouser") is None


async def test_unknown_step_and_missing_copy_files(runtime: NodeRuntime,
                                                   template: SnapshotRef, tmp_path: Path) -> None:
    for step, why in ((BuildStep("FROBNICATE", ("x",)), "unknown step type"),
                      (BuildStep("COPY", ("a", "/b", "", ""), files_hash="f" * 64),
                       "never uploaded")):
        spec = BuildSpec(snapshot_id="bt-odd", machine=MachineSpec(memory_mb=256),
                         from_snapshot=template.snapshot_id, steps=(step,),
                         files_dir=tmp_path)
        with pytest.raises(BuildFailed, match=why):
            await runtime.build(spec, lambda *a: None)
        assert await runtime.find_snapshot("bt-odd") is None


async def test_min_free_disk_grows_the_template_disk(runtime: NodeRuntime,
                                                     template: SnapshotRef) -> None:
    spec = BuildSpec(snapshot_id="bt-disk", machine=MachineSpec(memory_mb=256),
                     from_snapshot=template.snapshot_id, min_free_disk_mb=6000,
                     steps=(BuildStep("RUN", ("touch /home/user/x",)),))
    ref = await runtime.build(spec, lambda *a: None)
    assert ref.facts["disk"]["virtual_size"] >= (4096 + 6000) << 20
    p = await runtime.start("bt-dsk", ref, NetworkConfig())
    try:
        free_mib = int((await run(p, "df -Pm / | tail -1")).split()[3])
        assert free_mib >= 6000, free_mib
    finally:
        await runtime.kill("bt-dsk")
    await runtime.delete_snapshot("bt-disk")


async def test_an_init_that_does_not_grow_the_disk_leaves_it_to_python3(
        runtime: NodeRuntime, template: SnapshotRef, monkeypatch: pytest.MonkeyPatch) -> None:
    """A base built with an init older than `aenv.growfs` (here: a flag name no init knows)
    leaves no status file: the build grows the filesystem from python3 in the guest."""
    monkeypatch.setattr(builds, "GROWFS_FLAG", "aenv.no-such-flag")
    logs: list[tuple[str, str, str | None]] = []
    spec = BuildSpec(snapshot_id="bt-oldinit", machine=MachineSpec(memory_mb=256),
                     from_snapshot=template.snapshot_id, min_free_disk_mb=5000,
                     steps=(BuildStep("RUN", ("touch /home/user/y",)),))
    ref = await runtime.build(spec, lambda lvl, msg, step: logs.append((lvl, msg, step)))
    grown_mib = ref.facts["disk"]["virtual_size"] >> 20
    assert ("info", f"disk grown to {grown_mib} MiB", "base") in logs, logs
    p = await runtime.start("bt-old", ref, NetworkConfig())
    try:
        assert "aenv.no-such-flag" in (await run(p, "cat /proc/cmdline"))  # not ours: no status
        assert int((await run(p, "df -Pm / | tail -1")).split()[3]) >= 5000
    finally:
        await runtime.kill("bt-old")
    await runtime.delete_snapshot("bt-oldinit")


async def test_two_builds_at_once(runtime: NodeRuntime, template: SnapshotRef) -> None:
    """Builds of different templates run side by side (own VM, stack and network each)."""
    specs = [BuildSpec(snapshot_id=f"bt-par{i}", machine=MachineSpec(memory_mb=256),
                       from_snapshot=template.snapshot_id,
                       steps=(BuildStep("RUN", (f"echo {i} > /home/user/which",)),))
             for i in (1, 2)]
    refs = await asyncio.gather(*(runtime.build(s, lambda *a: None) for s in specs))
    for i, ref in zip((1, 2), refs, strict=True):
        p = await runtime.start(f"bt-p{i}", ref, NetworkConfig())
        try:
            assert (await run(p, "cat /home/user/which")).strip() == str(i)
        finally:
            await runtime.kill(f"bt-p{i}")
        await runtime.delete_snapshot(ref.snapshot_id)


async def test_many_steps_leave_a_template_of_a_bounded_chain(
        runtime: NodeRuntime, template: SnapshotRef) -> None:
    """Ten steps that each write the disk seal ten layers: past `max_disk_chain` (8) the
    template's own layers are merged into one, every file intact; the steps' layers stay
    cached (a rebuild runs no step)."""
    steps = tuple(BuildStep("RUN", (f"echo step {i} > /home/user/s{i} && rm -f /home/user/s{i - 2}",))
                  for i in range(10))
    spec = BuildSpec(snapshot_id="bt-many", machine=MachineSpec(memory_mb=256),
                     from_snapshot=template.snapshot_id, steps=steps)
    logs: list[tuple[str, str, str | None]] = []
    ref = await runtime.build(spec, lambda lvl, msg, step: logs.append((lvl, msg, step)))
    source = template.facts["disk"]["layers"]
    layers = ref.facts["disk"]["layers"]
    print(f"\n10 steps: the template reads {len(layers)} layers ({len(source)} its source's)")
    assert layers[:len(source)] == source and len(layers) == len(source) + 1
    merged = [msg for _, msg, _ in logs if msg.startswith("Merged the ")]
    assert len(merged) == 1 and int(merged[0].split()[2]) >= 10, logs
    p = await runtime.start("bt-mny", ref, NetworkConfig())
    try:  # the last two files left, the earlier ones deleted by later steps stay deleted
        out = await run(p, "cat /home/user/s8 /home/user/s9; ls /home/user | grep -c '^s'")
        assert out.split("\n")[:3] == ["step 8", "step 9", "2"]
    finally:
        await runtime.kill("bt-mny")
    again = await runtime.build(BuildSpec(**{**spec.__dict__, "snapshot_id": "bt-many2"}),
                                lambda *a: None)
    assert again.facts["build"]["cached_steps"] == 10
    assert len(again.facts["disk"]["layers"]) == len(source) + 1
    for s in ("bt-many", "bt-many2"):
        await runtime.delete_snapshot(s)
