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
    assert ["-global", "migration.send-configuration=off"] == argv[argv.index("-global"):
                                                                   argv.index("-global") + 2]


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
