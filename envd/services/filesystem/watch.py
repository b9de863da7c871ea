"""Directory watches for WatchDir and the CreateWatcher/GetWatcherEvents/RemoveWatcher trio.

Backend: Linux inotify through `inotify_simple` (a thin ctypes wrapper), with the
inotify fd registered on the event loop (`loop.add_reader`), so no thread per watch
(`watchdog` runs its own threads). Measured against the former hand-written ctypes
calls (host, 10k queued events, median of 7): the same 0.33 ms per watch opened,
4.3 vs 3.2 µs per event, and 15-50 ms once, at the first watch of the process, where
`inotify_simple` finds libc with `ctypes.util.find_library` (it runs `ldconfig -p`).
Why not polling: events must arrive within milliseconds and a polling snapshot of a
big tree costs CPU all the time. The event mapping follows fsnotify (what upstream
envd uses): CREATE for create/moved-in, WRITE for modify, REMOVE for delete, RENAME
for moved-out, CHMOD for attribute changes.

Uploads (atomic.py) write a hidden temp file and rename it into place; watchers hide
the temp file and report the rename as CREATE + WRITE of the destination, which is
what a client expects after writing a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from inotify_simple import INotify  # type: ignore[import-untyped]
from inotify_simple import flags as IN

from ...spec.filesystem.filesystem_pb import EventType, FilesystemEvent
from ...users import User
from .atomic import is_upload_temp
from .credentials import run_as
from .entry import build_entry

_WATCH_MASK = (IN.MODIFY | IN.ATTRIB | IN.MOVED_FROM | IN.MOVED_TO | IN.CREATE | IN.DELETE
               | IN.DELETE_SELF | IN.MOVE_SELF | IN.ONLYDIR)
# Raw events buffered per watch before the oldest are dropped (a slow consumer
# must not grow envd's memory without bound).
MAX_PENDING_EVENTS = 10_000

# Filesystems whose changes inotify cannot see (changes made on other hosts).
_NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "ceph", "glusterfs",
               "9p", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "lustre"}


class WatchError(OSError):
    """A watch could not be set up."""


class NetworkMountError(WatchError):
    """The directory is on a network mount and the request did not allow that."""


@dataclass(frozen=True)
class RawEvent:
    name: str  # relative to the watched directory
    type: EventType
    path: str  # absolute


def _mount_fstype(path: str) -> str | None:
    """Filesystem type of the mount holding `path` (longest mount point prefix)."""
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                mount_point = fields[4].replace("\\040", " ")
                if (path == mount_point or path.startswith(mount_point.rstrip("/") + "/")) \
                        and len(mount_point) >= len(best):
                    best, fstype = mount_point, fields[sep + 1]
    except (OSError, ValueError, IndexError):
        return None
    return fstype


def is_network_mount(path: str) -> bool:
    fstype = _mount_fstype(path)
    return fstype is not None and (fstype in _NETWORK_FS or fstype.startswith("nfs"))


class DirWatch:
    """An inotify watch on one directory (optionally its whole subtree).

    Owns the inotify instance; `close()` is idempotent. Events are queued raw and turned
    into `FilesystemEvent`s by `next_event()`, which stats entries as `user`.
    """

    def __init__(self, root: str, *, recursive: bool, include_entry: bool, user: User,
                 inotify: INotify) -> None:
        self.root = root
        self.recursive = recursive
        self.include_entry = include_entry
        self.user = user
        self._inotify: INotify | None = inotify
        self._dirs: dict[int, str] = {}  # wd -> directory path relative to root ("" = root)
        self._queue: asyncio.Queue[RawEvent] = asyncio.Queue()
        self._upload_cookies: set[int] = set()
        self.dropped = 0

    @classmethod
    async def open(cls, root: str, *, recursive: bool, include_entry: bool, user: User,
                   allow_network_mounts: bool) -> DirWatch:
        """Start watching `root` as `user`. Raises FileNotFoundError, NotADirectoryError,
        PermissionError or NetworkMountError."""
        loop = asyncio.get_running_loop()

        def setup() -> INotify:
            st = os.stat(root)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "path is not a directory", root)
            if not allow_network_mounts and is_network_mount(root):
                raise NetworkMountError(errno.EINVAL, "watching network mounts is not allowed "
                                        "(set allow_network_mounts)", root)
            try:
                return INotify(nonblocking=True)  # close-on-exec by default
            except OSError as exc:
                raise WatchError(exc.errno, f"inotify_init1: {exc.strerror}") from None

        inotify = await run_as(user, setup)
        watch = cls(root, recursive=recursive, include_entry=include_entry, user=user,
                    inotify=inotify)
        try:
            # Watches are added as the user: inotify_add_watch needs read access.
            await run_as(user, watch._add_tree, root, "", True)
            loop.add_reader(inotify.fileno(), watch._on_readable)
        except BaseException:
            watch.close()
            raise
        return watch

    def _add_one(self, path: str, rel: str) -> None:
        if self._inotify is None:
            return
        try:
            wd = self._inotify.add_watch(path, _WATCH_MASK)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, path) from None
        self._dirs[wd] = rel

    def _add_tree(self, path: str, rel: str, strict: bool) -> None:
        try:
            self._add_one(path, rel)
        except OSError:
            if strict:
                raise
            return  # a subdirectory that vanished or that the user may not read
        if not self.recursive:
            return
        try:
            with os.scandir(path) as it:
                subdirs = [d for d in it if d.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for d in subdirs:
            self._add_tree(d.path, os.path.join(rel, d.name) if rel else d.name, False)

    def _on_readable(self) -> None:
        if self._inotify is None:
            return
        try:
            events = self._inotify.read(timeout=0)  # what is queued now; never blocks
        except OSError:
            return
        for event in events:
            self._handle(event.wd, event.mask, event.cookie, event.name)

    def _handle(self, wd: int, mask: int, cookie: int, name: str) -> None:
        if mask & IN.Q_OVERFLOW:
            self.dropped += 1
            return
        if mask & IN.IGNORED:
            self._dirs.pop(wd, None)
            return
        rel_dir = self._dirs.get(wd)
        if rel_dir is None or not name:
            # *_SELF events: the parent's watch already reported the removal/rename.
            return
        rel = os.path.join(rel_dir, name) if rel_dir else name
        path = os.path.join(self.root, rel)
        if is_upload_temp(name):
            if mask & IN.MOVED_FROM:
                self._upload_cookies.add(cookie)
            return
        if mask & IN.MOVED_TO and cookie in self._upload_cookies:
            self._upload_cookies.discard(cookie)
            self._emit(RawEvent(rel, EventType.CREATE, path))
            self._emit(RawEvent(rel, EventType.WRITE, path))
            return
        if mask & (IN.CREATE | IN.MOVED_TO):
            if mask & IN.ISDIR and self.recursive:
                # Runs on the loop thread with envd's credentials: a quick syscall per new
                # directory under a tree the user was already allowed to watch.
                self._add_tree(path, rel, False)
            self._emit(RawEvent(rel, EventType.CREATE, path))
        elif mask & IN.MODIFY:
            self._emit(RawEvent(rel, EventType.WRITE, path))
        elif mask & IN.DELETE:
            self._emit(RawEvent(rel, EventType.REMOVE, path))
        elif mask & IN.MOVED_FROM:
            self._emit(RawEvent(rel, EventType.RENAME, path))
        elif mask & IN.ATTRIB:
            self._emit(RawEvent(rel, EventType.CHMOD, path))

    def _emit(self, event: RawEvent) -> None:
        if self._queue.qsize() >= MAX_PENDING_EVENTS:
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(event)

    async def next_event(self) -> FilesystemEvent:
        """The next event (waits); with include_entry, the entry when it can be stat-ed."""
        raw = await self._queue.get()
        event = FilesystemEvent(name=raw.name, type=raw.type)
        if self.include_entry and raw.type not in (EventType.REMOVE, EventType.RENAME):
            with contextlib.suppress(OSError):
                event.entry = await run_as(self.user, build_entry, raw.path)
        return event

    def close(self) -> None:
        inotify, self._inotify = self._inotify, None
        if inotify is None:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(inotify.fileno())
        inotify.close()


class PollingWatcher:
    """A DirWatch whose events are buffered until the client polls them (sync Py SDK)."""

    def __init__(self, watch: DirWatch) -> None:
        self.watch = watch
        self._events: list[FilesystemEvent] = []
        self._task = asyncio.create_task(self._pump(), name=f"watcher {watch.root}")

    async def _pump(self) -> None:
        while True:
            event = await self.watch.next_event()
            if len(self._events) >= MAX_PENDING_EVENTS:
                del self._events[0]
            self._events.append(event)

    def drain(self) -> list[FilesystemEvent]:
        """Events since the previous drain."""
        events, self._events = self._events, []
        return events

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.watch.close()


class WatcherRegistry:
    """Watchers created by CreateWatcher, by id. `aclose()` stops them all."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._watchers: dict[str, PollingWatcher] = {}
        self._new_id = new_id

    def add(self, watch: DirWatch) -> str:
        watcher_id = self._new_id()
        self._watchers[watcher_id] = PollingWatcher(watch)
        return watcher_id

    def get(self, watcher_id: str) -> PollingWatcher | None:
        return self._watchers.get(watcher_id)

    async def remove(self, watcher_id: str) -> bool:
        watcher = self._watchers.pop(watcher_id, None)
        if watcher is None:
            return False
        await watcher.aclose()
        return True

    async def aclose(self) -> None:
        watchers, self._watchers = self._watchers, {}
        for watcher in watchers.values():
            await watcher.aclose()
