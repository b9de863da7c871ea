"""The VMM jail (host/vmm/jail) on real kernel objects: cgroups, mount and network
namespaces, uids. A probe process is started exactly the way a VMM is (the jail's
`preexec` in the forked child, then exec) and reports what it can reach; the parent reads
its /proc entries. VM-level checks (QEMU itself jailed, its seccomp filter) are in
tests/vmm/test_jail_vm.py and tests/e2e/test_confinement.py."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from host.vmm.jail import (
    Bind,
    Cgroup,
    Jail,
    JailConfig,
    Limits,
    UidPool,
    UidRangeError,
    detect_version,
    forget,
    parse_uid_range,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the jail needs root")

PROBE = r"""
import errno, json, os, socket, sys
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "root": sorted(os.listdir("/"))}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
for i, path in enumerate(sys.argv[1].split(",")):
    attempt(f"read{i}", lambda p=path: open(p, "rb").read(1))
attempt("write_ro", lambda: open(sys.argv[2], "ab").write(b"x"))
attempt("write_work", lambda: open(os.path.join(sys.argv[3], "probe.out"), "w").write("x"))
attempt("write_root", lambda: open("/evil", "w").write("x"))
attempt("setuid0", lambda: os.setuid(0))
def connect(path):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
attempt("connect_other", lambda: connect(sys.argv[4]))
print(json.dumps(out), flush=True)
sys.stdin.read()  # stay alive until the test has read /proc
"""


def test_uid_range_parse_and_pool() -> None:
    assert parse_uid_range("1000-1009") == (1000, 10)
    for bad in ("0-10", "10-5", "x", "5", "1-4294967295"):
        with pytest.raises(UidRangeError):
            parse_uid_range(bad)
    pool = UidPool(5000, 3)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [5000, 5001, 5002]
    with pytest.raises(Exception, match="in use"):
        pool.allocate()
    pool.release(5001)
    assert pool.allocate() == 5001
    pool.release(5000)
    pool.claim(5000)
    assert pool.in_use() == {5000, 5001, 5002}


def test_cgroup_limits_and_removal() -> None:
    version = detect_version()
    cg = Cgroup("aenv-test", f"cg-{os.getpid()}", version=version)
    cg.create(Limits(memory_bytes=300 << 20, pids=64, cpu_quota_us=150_000, io_weight=100))
    try:
        assert cg.memory_limit() == 300 << 20
        pids_dir = cg.dirs()["" if version == 2 else "pids"]
        assert (pids_dir / "pids.max").read_text().strip() == "64"
        assert cg.procs() == []
    finally:
        cg.remove()
    assert all(not d.exists() for d in cg.dirs().values())
    cg.remove()  # idempotent


async def test_a_jailed_process_sees_only_its_binds(tmp_path: Path) -> None:
    state = tmp_path / "state"  # stands for /var/lib/aenv: keys, database, other sandboxes
    state.mkdir(mode=0o700)
    keys = state / "api_keys"
    keys.write_text("secret\n")
    keys.chmod(0o600)
    other_mem = state / "other" / "base.mem"
    other_mem.parent.mkdir()
    other_mem.write_bytes(b"\0" * 4096)
    other_mem.chmod(0o444)  # readable by every uid, but not bound into this jail
    other_sock_dir = state / "x" / "other"
    other_sock_dir.mkdir(parents=True)
    other_sock = socket_at(other_sock_dir / "nbd.sock")
    mine = state / "mine" / "kernel"
    mine.parent.mkdir()
    mine.write_bytes(b"kernel")
    mine.chmod(0o444)
    work = tmp_path / "vm-1"
    work.mkdir(mode=0o700)
    cfg = JailConfig(uid_range=(1879048192, 16), root=tmp_path / "jail-root")
    pool = UidPool(*cfg.uid_range)
    jail = Jail(cfg, pool, name="probe")
    jail.prepare(work_dir=work, binds=[Bind(mine)], vcpus=1, mem_mib=64)
    try:
        assert jail.uid is not None and jail.cgroup is not None
        # Debian's python: the jail's root has /usr, not this venv's interpreter
        argv = [os.path.realpath("/usr/bin/python3"), "-c", PROBE, f"{keys},{state / 'state.db'},{other_mem},{mine}", str(mine),
                str(work), str(other_sock_dir / "nbd.sock")]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, preexec_fn=jail.preexec(),
            pass_fds=jail.pass_fds)
        jail.spawned()
        assert proc.stdout is not None and proc.stdin is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line, (await proc.stderr.read()).decode() if proc.stderr else ""
        out = json.loads(line)
        status = dict(ln.split(":\t", 1) for ln in
                      Path(f"/proc/{proc.pid}/status").read_text().splitlines() if ":\t" in ln)
        cgroups = Path(f"/proc/{proc.pid}/cgroup").read_text()
        root_entries = sorted(os.listdir(f"/proc/{proc.pid}/root"))
        proc.stdin.close()
        await proc.wait()
    finally:
        jail.release()
        other_sock.close()
    assert out["uid"] == out["gid"] == jail_uid_of(out) and out["uid"] >= cfg.uid_range[0]
    assert out["groups"] == []
    assert status["CapEff"].strip() == "0000000000000000"
    assert status["CapPrm"].strip() == "0000000000000000"
    assert status["NoNewPrivs"].strip() == "1"
    assert f"aenv-vms/{work.name}" in cgroups or f"{cfg.cgroup_parent}/{work.name}" in cgroups
    # nothing of the state dir but the bound file; the api key, the database, another
    # sandbox's memory file and its disk socket are not there at all
    assert out["read0"] == "ENOENT" and out["read1"] == "ENOENT" and out["read2"] == "ENOENT"
    assert out["read3"] == "ok"  # its own kernel, read-only
    assert out["write_ro"] in ("EROFS", "EACCES")
    assert out["write_work"] == "ok" and (work / "probe.out").read_text() == "x"
    assert out["write_root"] in ("EROFS", "EACCES")
    assert out["setuid0"] == "EPERM"
    assert out["connect_other"] == "ENOENT"
    assert "api_keys" not in str(root_entries) and "state" not in root_entries
    assert set(out["root"]) <= {"usr", "etc", "dev", "tmp", "bin", "sbin", "lib", "lib32",
                                "lib64", "libx32"}
    assert pool.in_use() == set()
    assert all(not d.exists() for d in Cgroup(cfg.cgroup_parent, work.name,
                                              version=detect_version()).dirs().values())


def test_forget_removes_a_lost_vms_cgroup(tmp_path: Path) -> None:
    work = tmp_path / "lost-vm"
    work.mkdir()
    cfg = JailConfig(uid_range=(1879048192, 4), root=tmp_path / "jail-root")
    jail = Jail(cfg, UidPool(*cfg.uid_range), name="lost")
    jail.prepare(work_dir=work, binds=[], vcpus=1, mem_mib=64)
    cg = jail.cgroup
    assert cg is not None and all(d.is_dir() for d in cg.dirs().values())
    forget(work)  # what a restarted service does for a VM it could not adopt
    assert all(not d.exists() for d in cg.dirs().values())


def jail_uid_of(out: dict[str, object]) -> int:
    uid = out["uid"]
    assert isinstance(uid, int)
    return uid


def socket_at(path: Path) -> object:
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.listen(1)
    os.chmod(path, 0o666)
    return s
