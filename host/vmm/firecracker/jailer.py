"""What a Firecracker process sees as its files: its work dir, or a jailer chroot.

Every path the driver gives Firecracker (drives, kernel, memory and state files,
snapshot outputs) is *relative* (`drives/rootfs`, `out-1/mem`) and resolved against the
process's working directory. A snapshot records drive paths as given, and Firecracker
reopens them on load ("at the same relative paths", as its snapshot docs put it), so a
VM restored in another work dir or chroot opens its own disks, not the saved VM's.

- `HostRoot` (no jailer): the cwd is the work dir; files are exposed as symlinks.
- `JailRoot` (`jailer` found and configured): the jailer builds
  `<chroot base>/<exec name>/<id>/root`, pivots into it and execs Firecracker as
  `uid:gid`. Files are exposed by hard link, else bind mount, else (small files) copy;
  block devices by `mknod` with the same device number, owned by `uid:gid`. Everything
  is exposed before the jailer starts: it makes its mount namespace private, so later
  mounts would not be seen inside. `release()` unmounts what was mounted and removes the
  chroot and the jailer's cgroup dir.

The control socket is always `<work dir>/firecracker.sock` (a symlink into the chroot
when jailed): host-side paths into a chroot are often too long for a unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import VmmError
from ..proc import run_command

log = logging.getLogger(__name__)

API_SOCKET = "firecracker.sock"  # in the work dir
_COPY_MAX = 256 << 20  # bytes: larger files are linked or bind-mounted, never copied
_RECORD = "jail.json"


@dataclass(frozen=True, kw_only=True)
class JailerConfig:
    """Run Firecracker through `jailer` (needs root). `chroot_base=None` puts the chroot
    inside the VM's work dir; `uid`/`gid` must be able to open the VM's TAP device and
    writable FileDisks (block devices from NBD are chowned to them)."""

    binary: str
    uid: int = 0
    gid: int = 0
    chroot_base: Path | None = None
    sys_root: Path = Path("/sys")


def find_jailer(setting: str, *, uid: int = 0, gid: int = 0) -> JailerConfig | None:
    """"auto": the `jailer` on PATH when running as root; "off"/"": none; else a path."""
    setting = setting.strip()
    if setting in ("", "off", "none"):
        return None
    if setting == "auto":
        found = shutil.which("jailer")
        if found is None:
            return None
        if os.geteuid() != 0:
            log.info("jailer found at %s but not running as root: Firecracker runs unjailed",
                     found)
            return None
        return JailerConfig(binary=found, uid=uid, gid=gid)
    path = shutil.which(setting)
    if path is None:
        raise VmmError(f"jailer {setting!r} not found or not executable")
    return JailerConfig(binary=path, uid=uid, gid=gid)


class HostRoot:
    """Firecracker unjailed, with the work dir as its cwd; files exposed as symlinks."""

    jailed = False

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.root = work_dir
        self._made: list[Path] = []
        self._outputs = 0

    @property
    def api_socket(self) -> Path:
        return self.work_dir / API_SOCKET

    @property
    def vmm_log(self) -> Path:
        return self.work_dir / "firecracker.log"

    def firecracker_args(self) -> list[str]:
        return ["--api-sock", str(self.api_socket), "--log-path", str(self.vmm_log)]

    def argv(self, firecracker: str, netns: str | None) -> list[str]:
        argv = [firecracker, *self.firecracker_args()]
        return ["ip", "netns", "exec", netns, *argv] if netns else argv

    def _dest(self, rel: str) -> Path:
        dst = self.root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        top = self.root / Path(rel).parts[0]
        if top not in self._made:
            self._made.append(top)
        dst.unlink(missing_ok=True)
        return dst

    async def expose(self, src: Path, rel: str) -> str:
        """Make `src` visible to Firecracker as `rel`; returns the path to give it."""
        self._dest(rel).symlink_to(src.resolve())
        return rel

    def place(self, rel: str) -> Path:
        """Host path of a file the driver creates for Firecracker to read at `rel`."""
        return self._dest(rel)

    def let_read(self, path: Path) -> None:
        """Make a file the driver created (at a `place`d path) readable by Firecracker:
        nothing to do, it runs as us."""

    async def output(self, dest: Path) -> tuple[str, Path]:
        """(path to give Firecracker, host dir) for files it writes, to end up in `dest`."""
        self._outputs += 1
        rel = f"out-{self._outputs}"
        self._dest(rel).symlink_to(dest.resolve())
        return rel, dest

    async def drop_output(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / rel).unlink()

    async def prepare(self) -> None:
        """Before the process starts: the log file (Firecracker may insist it exists)."""
        self.vmm_log.touch()

    async def release(self) -> None:
        """After the process is gone: nothing held outside the work dir."""

    def remove(self) -> None:
        """Remove what this root created in a work dir the VM does not own."""
        for p in reversed(self._made):
            if p.is_symlink() or p.is_file():
                p.unlink(missing_ok=True)
            else:
                shutil.rmtree(p, ignore_errors=True)

    def facts(self) -> dict[str, Any]:
        return {}


def jail_id(work_dir: Path) -> str:
    """The jailer's VM id: alphanumerics and '-', at most 64 characters."""
    return re.sub(r"[^A-Za-z0-9-]", "-", work_dir.name)[:64] or "vm"


class JailRoot(HostRoot):
    """Firecracker started by `jailer` in a chroot under `chroot_base`."""

    jailed = True

    def __init__(self, work_dir: Path, config: JailerConfig, firecracker: str) -> None:
        super().__init__(work_dir)
        self.config = config
        self.firecracker = shutil.which(firecracker) or firecracker
        self.id = jail_id(work_dir)
        self.base = config.chroot_base or work_dir / "jail"
        self.jail_dir = self.base / Path(self.firecracker).name / self.id
        self.root = self.jail_dir / "root"
        self.mounts: list[Path] = []

    @property
    def vmm_log(self) -> Path:
        return self.root / "firecracker.log"

    def firecracker_args(self) -> list[str]:
        return ["--api-sock", "/api.sock", "--log-path", "/firecracker.log"]

    def argv(self, firecracker: str, netns: str | None) -> list[str]:
        c = self.config
        argv = [c.binary, "--id", self.id, "--exec-file", self.firecracker,
                "--uid", str(c.uid), "--gid", str(c.gid), "--chroot-base-dir", str(self.base)]
        if (c.sys_root / "fs/cgroup/cgroup.controllers").exists():  # unified hierarchy
            argv += ["--cgroup-version", "2"]
        if netns:
            argv += ["--netns", f"/var/run/netns/{netns}"]
        return [*argv, "--", *self.firecracker_args()]

    async def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._record)
        log_file = self.vmm_log
        log_file.touch()
        os.chown(log_file, self.config.uid, self.config.gid)
        link = self.api_socket
        link.unlink(missing_ok=True)
        link.symlink_to(self.root / "api.sock")

    def _record(self) -> None:
        data = {"jail_dir": str(self.jail_dir), "mounts": [str(m) for m in self.mounts],
                "id": self.id, "parent_cgroup": Path(self.firecracker).name,
                "uid": self.config.uid, "gid": self.config.gid}
        (self.work_dir / _RECORD).write_text(json.dumps(data))

    async def expose(self, src: Path, rel: str) -> str:
        dst = self._dest(rel)
        st = src.stat()
        if stat.S_ISBLK(st.st_mode):
            os.mknod(dst, stat.S_IFBLK | 0o600, st.st_rdev)
            os.chown(dst, self.config.uid, self.config.gid)
            return rel
        if stat.S_ISREG(st.st_mode):
            try:
                os.link(src, dst)
            except OSError as exc:
                why = str(exc)
            else:
                self.let_read(dst)
                return rel
            dst.touch(mode=0o600)  # a copy (below) keeps this mode
        else:
            why = "a directory"
            dst.mkdir()
        rc, out = await run_command(["mount", "--bind", str(src), str(dst)])
        if rc == 0:
            self.mounts.append(dst)
            await asyncio.to_thread(self._record)
            if stat.S_ISREG(st.st_mode):
                self.let_read(dst)
            return rel
        if stat.S_ISREG(st.st_mode) and st.st_size <= _COPY_MAX:
            await asyncio.to_thread(shutil.copyfile, src, dst)
            self.let_read(dst)
            return rel
        raise VmmError(f"cannot make {src} visible in the jail {self.root}: hard link "
                       f"failed ({why}) and bind mount failed ({out.strip()})")

    def place(self, rel: str) -> Path:
        return self._dest(rel)

    def let_read(self, path: Path) -> None:
        """A file only root may read (guest memory is 0400/0600) gets group read for the
        jailer's gid: never the jailer's uid as owner, which could then change it (a
        linked frozen base is shared by every VM of its template)."""
        if self.config.uid == 0:
            return
        st = path.stat()
        if not st.st_mode & stat.S_IROTH:
            os.chown(path, -1, self.config.gid)
            os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IRGRP)

    async def output(self, dest: Path) -> tuple[str, Path]:
        self._outputs += 1
        rel = f"out-{self._outputs}"
        host = self._dest(rel)
        host.mkdir()
        os.chown(host, self.config.uid, self.config.gid)
        return rel, host

    async def drop_output(self, rel: str) -> None:
        await asyncio.to_thread(shutil.rmtree, self.root / rel, True)

    async def release(self) -> None:
        """Unmount, then remove the chroot and the cgroup the jailer made."""
        await release_jail(self.work_dir, sys_root=self.config.sys_root)
        self.mounts = []

    def remove(self) -> None:
        if mounts_under(self.jail_dir):  # release() failed: never delete through a mount
            return
        super().remove()
        shutil.rmtree(self.base if self.config.chroot_base is None else self.jail_dir,
                      ignore_errors=True)
        (self.work_dir / _RECORD).unlink(missing_ok=True)

    def facts(self) -> dict[str, Any]:
        return {"jail": jail_record(self.work_dir)}


def jail_record(work_dir: Path) -> dict[str, Any] | None:
    """What `JailRoot` recorded in `work_dir` (chroot, mounts, id), None without a jail."""
    try:
        data = json.loads((work_dir / _RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


async def release_jail(work_dir: Path, record: dict[str, Any] | None = None, *,
                       sys_root: Path = Path("/sys")) -> None:
    """Undo a jail (also for a VM whose handle was lost): unmount every mount under its
    chroot, remove the chroot and the jailer's cgroup dirs. `record`: `jail_record()`,
    read from `work_dir` when not given."""
    data = record or jail_record(work_dir)
    if data is None:
        return
    jail_dir = Path(data["jail_dir"])
    mounted = [Path(m) for m in data.get("mounts", [])] + mounts_under(jail_dir)
    failed = []
    for m in sorted(set(mounted), key=lambda p: len(p.parts), reverse=True):
        if m not in mounts_under(jail_dir):
            continue
        rc, out = await run_command(["umount", str(m)])
        if rc != 0:
            rc, out = await run_command(["umount", "-l", str(m)])
        if rc != 0:
            failed.append(f"{m}: {out.strip()}")
    if failed or mounts_under(jail_dir):
        # Never rmtree over a mount: it would delete the mounted files' contents.
        raise VmmError(f"cannot unmount in jail {jail_dir}: {'; '.join(failed)}")
    await asyncio.to_thread(shutil.rmtree, jail_dir, True)
    for cg in (sys_root / "fs/cgroup").glob(f"*/{data.get('parent_cgroup', '')}/{data['id']}"):
        with contextlib.suppress(OSError):
            cg.rmdir()
    (work_dir / _RECORD).unlink(missing_ok=True)


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below `path` (from /proc/self/mountinfo)."""
    prefix = str(path)
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point == prefix or point.startswith(prefix + "/"):
            found.append(Path(point))
    return found

