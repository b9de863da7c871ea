"""`Jail`: one VMM process confined the way Firecracker's jailer confines Firecracker.

The VMM is spawned by the driver as usual; the jail adds a `preexec` function that runs in
the forked child before exec, while it is still root, and leaves it:

1. in its own cgroup (memory = guest RAM + overhead, pids, cpu quota from the vCPUs, I/O
   weight; cgroup.py), joined before anything is allocated;
2. in the sandbox's network namespace, holding its TAP device as an inherited file
   descriptor (the VMM never opens `/dev/net/tun` nor needs CAP_NET_ADMIN);
3. in its own mount namespace whose root is an empty tmpfs holding only what the VMM
   needs, each bind-mounted at the path it has on the host (so the VMM's command line,
   sockets and file names are the host's): `/usr` and the loader cache read-only, the
   kernel, read-only memory files and read-only disks read-only, its work dir (control
   socket, serial log, device-state files) and its disks' sockets writable, a few device
   nodes; then the root itself is made read-only. The state dir (keys, database, other
   sandboxes' files) is not in it;
4. as its own uid and gid (from `UidPool`), no supplementary groups but `kvm` when KVM is
   used, so no capability is left (`CapEff` 0), with `no_new_privs`, RLIMIT_FSIZE bounding
   every file it writes (the serial log) and no core dumps.

The VMM's own seccomp filter (QEMU's `-sandbox`) is installed by the VMM: the driver
passes the option. A jail's record (`jail.json` in the work dir) lets a restarted service
adopt the VM (its uid is claimed back) or clean up after one it could not (`forget`).

Why a preexec function and not a launcher process: one exec less on every VM start (a
Python launcher costs ~50 ms here); the child only makes system calls prepared by the
parent. Errors in the child are written to the VMM's stderr file before the spawn fails,
so they reach the start error's message.
"""

from __future__ import annotations

import contextlib
import grp
import json
import logging
import os
import resource
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import VmmError, VmmStartError
from . import syscalls as sc
from .cgroup import CPU_PERIOD_US, Cgroup, Limits, detect_version, nested_parent
from .config import JailConfig, UidPool

log = logging.getLogger(__name__)

RECORD = "jail.json"
# device nodes every VMM may use; /dev/kvm is added when the VM uses KVM
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/urandom", "/dev/random")
_READ_ONLY_HOST = ("/usr", "/etc/ld.so.cache")
_ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class Bind:
    """A host path the VMM sees at the same path in its root."""

    path: Path
    writable: bool = False


@dataclass(frozen=True)
class _Plan:
    """Everything the child needs, computed in the parent (primitives only)."""

    root: str
    cgroup_procs: tuple[str, ...]
    netns_fd: int | None
    tap: str | None
    tap_fd: int | None
    links: tuple[tuple[str, str], ...]
    binds: tuple[tuple[str, bool, bool], ...]  # (path, writable, is_dir)
    uid: int
    gid: int
    groups: tuple[int, ...]
    fsize: int
    die_with_parent: bool


class Jail:
    """The confinement of one VM's VMM process. `prepare()` before the spawn, pass
    `preexec()` and `pass_fds` to it, `spawned()` after; `release()` once the process is
    gone (idempotent)."""

    def __init__(self, config: JailConfig, pool: UidPool, *, name: str) -> None:
        self.config, self.pool, self.name = config, pool, name
        self.uid: int | None = None
        self.cgroup: Cgroup | None = None
        self.tap_fd: int | None = None  # the TAP's fd number in the VMM (argv: fd=N)
        self._placeholder: int | None = None  # our fd of that number until the spawn
        self._netns_fd: int | None = None
        self._plan: _Plan | None = None
        self._work_dir: Path | None = None

    @property
    def gid(self) -> int | None:
        return self.uid

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.tap_fd,) if self.tap_fd is not None else ()

    def prepare(self, *, work_dir: Path, binds: Sequence[Bind], vcpus: int, mem_mib: int,
                netns: str | None = None, tap: str | None = None, kvm: bool = False,
                die_with_parent: bool = False) -> None:
        """Allocate the uid, make the cgroup with its limits, hand the writable paths to
        the uid, open the network namespace and reserve the TAP's fd number."""
        try:
            self._prepare(work_dir, binds, vcpus, mem_mib, netns, tap, kvm, die_with_parent)
        except BaseException:
            self.release()
            raise

    def _prepare(self, work_dir: Path, binds: Sequence[Bind], vcpus: int, mem_mib: int,
                 netns: str | None, tap: str | None, kvm: bool,
                 die_with_parent: bool) -> None:
        cfg = self.config
        self._work_dir = work_dir
        self.uid = uid = self.pool.allocate()
        version = detect_version()
        self.cgroup = Cgroup(nested_parent(cfg.cgroup_parent, version), work_dir.name,
                             version=version)
        self.cgroup.create(Limits(
            memory_bytes=(mem_mib + cfg.overhead_mib) << 20, pids=cfg.pids,
            # the vCPU threads plus half a core for the main loop and I/O
            cpu_quota_us=vcpus * CPU_PERIOD_US + CPU_PERIOD_US // 2,
            io_weight=cfg.io_weight))
        cfg.root.mkdir(parents=True, exist_ok=True, mode=0o755)
        all_binds = [*_host_binds(kvm), Bind(work_dir, writable=True), *binds]
        plan_binds = []
        for b in all_binds:
            if not b.path.exists():
                raise VmmStartError(f"{self.name}: {b.path} does not exist (the jail binds it)")
            if b.writable and not str(b.path).startswith("/dev/"):
                os.chown(b.path, uid, uid)
            elif not _readable_by_others(b.path):
                raise VmmStartError(f"{self.name}: {b.path} is not readable by the VM's uid "
                                    "(the jail exposes it read-only; make it world-readable)")
            plan_binds.append((str(b.path), b.writable, b.path.is_dir()))
        self._write_record()
        if netns is not None:
            self._netns_fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
        if tap is not None:
            # a number the child may overwrite: an fd open here, kept open by the spawn
            self._placeholder = self.tap_fd = os.open("/dev/null", os.O_RDONLY)
        groups = (grp.getgrnam("kvm").gr_gid,) if kvm and _has_group("kvm") else ()
        links = tuple((n, os.readlink(f"/{n}")) for n in _ROOT_LINKS if os.path.islink(f"/{n}"))
        self._plan = _Plan(
            root=str(cfg.root), cgroup_procs=tuple(self.cgroup.join_paths()),
            netns_fd=self._netns_fd, tap=tap, tap_fd=self.tap_fd, links=links,
            binds=tuple(plan_binds), uid=uid, gid=uid, groups=groups, fsize=cfg.fsize_bytes,
            die_with_parent=die_with_parent)

    def preexec(self) -> Callable[[], None]:
        plan = self._plan
        if plan is None:
            raise VmmError(f"{self.name}: jail not prepared")
        return lambda: _enter(plan)

    def spawned(self) -> None:
        """The VMM has its own copies now: close ours (once: the numbers are free for
        anyone to reuse after that)."""
        for fd in (self._netns_fd, self._placeholder):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._netns_fd = self._placeholder = None

    # -- facts, adoption, cleanup --------------------------------------------------------

    def facts(self) -> dict[str, Any]:
        assert self.cgroup is not None
        return {"uid": self.uid, "cgroup": [self.cgroup.version, self.cgroup.parent,
                                            self.cgroup.name]}

    def adopt(self, facts: dict[str, Any], work_dir: Path) -> None:
        """Take back the jail of a VM this service started before a restart."""
        self._work_dir = work_dir
        self.uid = int(facts["uid"])
        self.pool.claim(self.uid)
        version, parent, name = facts["cgroup"]
        self.cgroup = Cgroup(parent, name, version=int(version))

    def release(self) -> None:
        """After the process is gone: remove the cgroup, give the uid back."""
        self.spawned()
        self.tap_fd = None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self.uid is not None:
            self.pool.release(self.uid)
            self.uid = None
        if self._work_dir is not None:
            with contextlib.suppress(OSError):
                (self._work_dir / RECORD).unlink()

    def _write_record(self) -> None:
        assert self._work_dir is not None
        (self._work_dir / RECORD).write_text(json.dumps(self.facts()))


def forget(work_dir: Path) -> None:
    """Remove the cgroup of a lost VM (its process already gone) from its record."""
    try:
        facts = json.loads((work_dir / RECORD).read_text())
        version, parent, name = facts["cgroup"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    Cgroup(parent, name, version=int(version)).remove()


def _host_binds(kvm: bool) -> list[Bind]:
    binds = [Bind(Path(p)) for p in _READ_ONLY_HOST if os.path.exists(p)]
    devices = [*_DEVICES, *(("/dev/kvm",) if kvm else ())]
    # writable (/dev/null takes writes) but never handed to the uid: only /dev/kvm is
    # limited by its mode, and the kvm group is given where KVM is used
    binds += [Bind(Path(d), writable=True) for d in devices if os.path.exists(d)]
    return binds


def _readable_by_others(path: Path) -> bool:
    st = path.stat()
    if path.is_dir():
        return bool(st.st_mode & 0o005 == 0o005)
    if path.is_char_device() or path.is_socket():
        return True
    return bool(st.st_mode & 0o004)


def _has_group(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _enter(plan: _Plan) -> None:
    """Run in the forked child, as root, before exec (see the module docstring)."""
    try:
        pid = str(os.getpid()).encode()
        for procs in plan.cgroup_procs:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        if plan.netns_fd is not None:
            sc.setns(plan.netns_fd, sc.CLONE_NEWNET)
        if plan.tap is not None and plan.tap_fd is not None:
            tap = sc.open_tap(plan.tap)
            os.dup2(tap, plan.tap_fd, inheritable=True)
            os.close(tap)
        sc.unshare(sc.CLONE_NEWNS)
        sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
        root = plan.root
        sc.mount("aenv-jail", root, "tmpfs", sc.MS_NOSUID | sc.MS_NODEV, "mode=0755,size=64k")
        for name, target in plan.links:
            os.symlink(target, f"{root}/{name}")
        for path, writable, is_dir in plan.binds:
            dest = root + path
            os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
            if is_dir:
                os.makedirs(dest, mode=0o755, exist_ok=True)
            else:
                os.close(os.open(dest, os.O_CREAT | os.O_WRONLY, 0o600))
            sc.mount(path, dest, None, sc.MS_BIND)
            if not writable:
                flags = sc.MS_BIND | sc.MS_REMOUNT | sc.MS_RDONLY | sc.MS_NOSUID
                if not path.startswith("/dev/"):
                    flags |= sc.MS_NODEV
                sc.mount(None, dest, None, flags)
        os.chdir(root)
        sc.pivot_root(".", ".")
        sc.umount2(".", sc.MNT_DETACH)  # the old root, stacked under the new one
        os.chdir("/")
        sc.mount(None, "/", None,
                 sc.MS_BIND | sc.MS_REMOUNT | sc.MS_RDONLY | sc.MS_NOSUID | sc.MS_NODEV)
        resource.setrlimit(resource.RLIMIT_FSIZE, (plan.fsize, plan.fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # past RLIMIT_FSIZE a write fails with EFBIG instead of killing the VMM
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        os.setgroups(list(plan.groups))
        os.setresgid(plan.gid, plan.gid, plan.gid)
        os.setresuid(plan.uid, plan.uid, plan.uid)  # drops every capability
        sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
        if plan.die_with_parent:
            # after setresuid, which clears it
            sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"aenv jail: {exc}\n".encode())
        raise
