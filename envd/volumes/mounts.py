"""`Mounts`: the volumes the host asked envd to mount (`aenvVolumeMounts` in /init).

Each mount is a child process (`envd volume-mount`, mount.py). /init is repeated after
every resume and fork, and retried by the host: a path already mounted by a living child
is left alone (its connections to the host recover by themselves, client.py), so /init
stays idempotent. Mount state is read from /proc/self/mountinfo, never by stat'ing the
mount point (a stuck FUSE server would block the caller).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import posixpath
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

MAX_MOUNTS = 16
MOUNT_TIMEOUT_S = 10.0
WATCH_S = 2.0
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x00000010
READ_AHEAD_KB = 4096
FSTYPE = "fuse.aenv"
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,250}")
ADDRESS_RE = re.compile(r"[0-9.]{7,15}:[0-9]{1,5}")


log = logging.getLogger(__name__)


class MountError(ValueError):
    pass


@dataclass(frozen=True)
class Mount:
    name: str
    path: str
    address: str


def parse(raw: Any) -> list[Mount]:
    """The /init field, validated (MountError naming what is wrong)."""
    if not isinstance(raw, list) or len(raw) > MAX_MOUNTS:
        raise MountError(f"'aenvVolumeMounts' must be a list of at most {MAX_MOUNTS}")
    out = []
    for item in raw:
        if not isinstance(item, dict):
            raise MountError("each volume mount must be an object")
        name, path, address = item.get("name"), item.get("path"), item.get("address")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise MountError(f"bad volume name {name!r}")
        if (not isinstance(path, str) or not path.startswith("/") or path == "/"
                or posixpath.normpath(path) != path or len(path) > 4096):
            raise MountError(f"bad mount path {path!r}")
        if not isinstance(address, str) or not ADDRESS_RE.fullmatch(address):
            raise MountError(f"bad volume server address {address!r}")
        out.append(Mount(name, path, address))
    return out


def _mounts() -> dict[str, str]:
    """Mount point -> device (major:minor) of our FUSE mounts (mountinfo escapes spaces
    as \\040)."""
    out = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(" - ", 1)
            if len(fields) == 2 and fields[1].split(" ", 1)[0] == FSTYPE:
                head = fields[0].split(" ")
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), head[4])
                out[point] = head[2]
    return out


def mounted_paths() -> set[str]:
    return set(_mounts())


def _read_ahead(device: str) -> None:
    """Reads of 1 MiB per round trip to the host: the kernel splits a FUSE read at the
    device's read-ahead (128 KiB by default), which only sysfs raises."""
    try:
        with open(f"/sys/class/bdi/{device}/read_ahead_kb", "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError:
        pass          # no sysfs (a container): smaller reads, same results


def _guard(path: str) -> None:
    """Make the directory under a mount immutable (chattr +i): while a mount is replaced
    (its process died) a program writing there gets EPERM, not a file that silently lands
    beside the volume. Best effort: a filesystem without the flag leaves it as is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        buf = bytearray(struct.pack("i", 0))
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf)
        flags = struct.unpack("i", buf)[0]
        if not flags & FS_IMMUTABLE_FL:
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("i", flags | FS_IMMUTABLE_FL))
    except OSError as exc:
        log.debug("%s: no immutable flag under the mount: %s", path, exc)
    finally:
        os.close(fd)


def _self_argv() -> list[str]:
    return [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "envd"]


class Mounts:
    """The mounts /init asked for, kept up: a child that dies (killed, out of memory) is
    replaced by the watchdog within `WATCH_S`, its dead mount lazily detached first."""

    def __init__(self) -> None:
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._wanted: dict[str, Mount] = {}
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None

    async def ensure(self, wanted: list[Mount]) -> None:
        async with self._lock:
            for m in wanted:
                self._wanted[m.path] = m
                await self._ensure_one(m)
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watchdog())

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            async with self._lock:
                for path, m in self._wanted.items():
                    child = self._children.get(path)
                    if child is not None and child.poll() is None:
                        continue
                    log.warning("volume %r at %s: its FUSE process ended; mounting it again",
                                m.name, path)
                    try:
                        await self._ensure_one(m)
                    except (MountError, OSError) as exc:
                        log.warning("volume %r at %s: mounting again failed: %s",
                                    m.name, path, exc)

    async def aclose(self) -> None:
        """Stop watching (the mounts stay: a restarted envd finds them by mountinfo)."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    async def _ensure_one(self, m: Mount) -> None:
        child = self._children.get(m.path)
        if child is not None and child.poll() is None and m.path in mounted_paths():
            return
        if child is not None and child.poll() is None:
            child.kill()
        if m.path in mounted_paths():   # a mount whose server died: lazily detach it
            await asyncio.to_thread(subprocess.run, ["umount", "-l", m.path], check=False)
        os.makedirs(m.path, mode=0o755, exist_ok=True)
        await asyncio.to_thread(_guard, m.path)
        child = await asyncio.to_thread(
            subprocess.Popen, [*_self_argv(), "volume-mount", m.name, m.path, m.address],
            stdin=subprocess.DEVNULL, start_new_session=True)
        self._children[m.path] = child
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MOUNT_TIMEOUT_S
        while m.path not in await asyncio.to_thread(mounted_paths):
            if child.poll() is not None:
                raise MountError(f"mounting volume {m.name!r} at {m.path} failed "
                                 f"(exit {child.returncode})")
            if loop.time() > deadline:
                child.kill()
                raise MountError(f"mounting volume {m.name!r} at {m.path} timed out")
            await asyncio.sleep(0.05)
        await asyncio.to_thread(_read_ahead, _mounts()[m.path])
