"""Host-only checks of the runtime's pure parts (no VM): the QEMU argv of a snapshot
family and its config digest, manifests as the commit point, and memory-dir garbage
collection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from host.runtime import NodeRuntime, RuntimeConfig, SnapshotNotFoundError
from host.runtime.manifests import ManifestStore
from host.vmm.driver import MemoryBacking, NbdDisk, TapNet, UserNet, VmSpec
from host.vmm.procscan import is_vmm_for, pid_alive
from host.vmm.qemu.cmdline import QemuRunFiles, build_argv, config_digest


def _spec(tmp: Path, *, mem: str, sock: str, export: str, net: TapNet | UserNet,
          shared: bool) -> VmSpec:
    return VmSpec(kernel=Path("/k/vmlinux"), cmdline="console=ttyS0 root=/dev/vda", vcpus=1,
                  mem_mib=256, disks=(NbdDisk(socket=Path(sock), export=export),), network=net,
                  memory=MemoryBacking(path=tmp / mem, shared=shared), name=export)


def test_family_argv_has_memsnap_flags(tmp_path: Path) -> None:
    spec = _spec(tmp_path, mem="base.mem", sock="/s/nbd.sock", export="sbx-a",
                 net=TapNet(tap="tap0", guest_ip="10.0.0.2", netns="aenv-a"), shared=False)
    argv = build_argv(spec, files=QemuRunFiles.in_dir(tmp_path), accel="tcg", tsc_khz=1000,
                      host_port=None, incoming=True, qemu="qemu-system-x86_64")
    assert argv[:4] == ["ip", "netns", "exec", "aenv-a"]
    mem = next(a for a in argv if a.startswith("memory-backend-file,"))
    assert "share=off" in mem and mem.endswith("merge=off")
    assert argv[-3:] == ["-incoming", "defer", "-S"]
    # QEMU 10.0 aborts saving with send-configuration=off: every stream has its
    # configuration section now (memsnap/devstate.py keeps the template's)
    assert "migration.send-configuration=off" not in argv
    assert "-sandbox" not in argv


def test_jailed_argv_has_the_seccomp_filter_the_tap_fd_and_a_read_only_base(
        tmp_path: Path) -> None:
    """A jailed QEMU installs its seccomp filter, is handed its TAP (the jail already put
    it in the namespace: no `ip netns exec`) and opens a shared base read-only."""
    spec = _spec(tmp_path, mem="base.mem", sock="/s/x/sbx-a/nbd.sock", export="sbx-a",
                 net=TapNet(tap="tap0", guest_ip="10.0.0.2", netns="aenv-a"), shared=False)
    argv = build_argv(spec, files=QemuRunFiles.in_dir(tmp_path), accel="tcg", tsc_khz=1000,
                      host_port=None, incoming=True, qemu="/usr/bin/qemu-system-x86_64",
                      jailed=True, tap_fd=7, readonly_private_ram=True)
    assert argv[0] == "/usr/bin/qemu-system-x86_64"
    assert argv[argv.index("-sandbox") + 1] == (
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny")
    assert argv[argv.index("-netdev") + 1] == "tap,id=net0,fd=7"
    mem = next(a for a in argv if a.startswith("memory-backend-file,"))
    assert "share=off,readonly=on,rom=off" in mem
    kw = {"accel": "tcg", "tsc_khz": 1000, "qemu": "/usr/bin/qemu-system-x86_64"}
    unjailed = _spec(tmp_path, mem="base.mem", sock="/s/nbd.sock", export="sbx-a",
                     net=TapNet(tap="tap0", guest_ip="10.0.0.2", netns="aenv-a"), shared=False)
    assert config_digest(spec, **kw) == config_digest(unjailed, **kw)


def test_family_digest_ignores_per_instance_parts(tmp_path: Path) -> None:
    a = _spec(tmp_path, mem="scratch.mem", sock="/s1/nbd.sock", export="tpl-x",
              net=TapNet(tap="tap0", guest_ip="10.0.0.2", netns="aenv-tpl-x"), shared=True)
    b = _spec(tmp_path / "o", mem="base.mem", sock="/s2/nbd.sock", export="sbx-y",
              net=TapNet(tap="tap0", guest_ip="10.0.0.6", netns="aenv-y"), shared=False)
    kw = {"accel": "tcg", "tsc_khz": 1000, "qemu": "qemu-system-x86_64"}
    assert config_digest(a, **kw) == config_digest(b, **kw)
    c = VmSpec(**{**a.__dict__, "mem_mib": 512})
    assert config_digest(c, **kw) != config_digest(a, **kw)
    assert config_digest(a, **{**kw, "tsc_khz": 2000}) != config_digest(a, **kw)


def test_pid_checks() -> None:
    assert pid_alive(os.getpid())
    assert not is_vmm_for(os.getpid(), "qemu-system", Path("/nonexistent/qmp.sock"))


@pytest.mark.asyncio(loop_scope="session")
async def test_manifest_store_and_memory_gc(tmp_path: Path) -> None:
    cfg = RuntimeConfig(state_dir=tmp_path / "state", run_dir=tmp_path / "run")
    store = ManifestStore(cfg.repository_spec)
    with pytest.raises(SnapshotNotFoundError):
        await store.get("nope")
    await store.put("t", {"depends_on": ["t"]})
    await store.put("s1", {"depends_on": ["t", "s1"]})
    await store.put("s2", {"depends_on": ["t", "s1", "s2"]})
    for d in ("t", "s1", "s2", "stale"):
        (cfg.memory_dir / d).mkdir(parents=True)
    rt = NodeRuntime(cfg)  # not opened: GC needs only the repository and memory dir
    await rt.delete_snapshot("s1")  # s2's chain still uses s1's diff
    assert sorted(p.name for p in cfg.memory_dir.iterdir()) == ["s1", "s2", "t"]
    await rt.delete_snapshot("s2")
    assert sorted(p.name for p in cfg.memory_dir.iterdir()) == ["t"]
    assert sorted(await store.all()) == ["t"]
    await rt.delete_snapshot("s2")  # idempotent
