"""A root directory opened once, its paths resolved inside it as a chroot would (apply.py's
tree, and confined.py's checks of it): symlinks followed as if the root were `/`, `..`
never above it, every component opened with O_NOFOLLOW relative to its parent's fd.

Standalone (Python 3.11 stdlib): copied with apply.py into the confined helper.
"""

from __future__ import annotations

import os
import stat
from collections import OrderedDict

try:  # run as a script beside apply.py (the helper); imported as host.images.rootdir
    from layertar import ApplyError  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    from host.images.layertar import ApplyError

MAX_SYMLINKS = 40
FD_CACHE = 128

RPath = tuple[str, ...]  # a resolved path below the root: real directories, then a name


class Root:
    """TARGET_DIR opened once; resolves paths inside it as a chroot would."""

    def __init__(self, target: str) -> None:
        self.fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._dirs: OrderedDict[RPath, int] = OrderedDict()

    def close(self) -> None:
        self.forget()
        os.close(self.fd)

    def forget(self) -> None:
        """Drop cached directory fds (after anything was removed)."""
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def _fd(self, path: RPath) -> int:
        """A cached fd of the real directory `path` (every component a real directory)."""
        if not path:
            return self.fd
        fd = self._dirs.get(path)
        if fd is not None:
            self._dirs.move_to_end(path)
            return fd
        parent = self._fd(path[:-1])
        fd = os.open(path[-1], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
        self._dirs[path] = fd
        if len(self._dirs) > FD_CACHE:
            _, old = self._dirs.popitem(last=False)
            os.close(old)
        return fd

    def open_real(self, path: RPath) -> int:
        """A new fd (the caller closes it) of the real directory `path`."""
        return os.dup(self._fd(path))

    def resolve_dir(self, parts: list[str], *, create: bool,
                    made: list[RPath] | None = None) -> RPath | None:
        """The real path of directory `parts`, following symlinks inside the root.
        Missing components are made (0755) when `create`, else None is returned; a
        component that is not a directory raises ApplyError."""
        real: list[str] = []
        todo = list(parts)
        links = 0
        while todo:
            comp = todo.pop(0)
            if comp in ("", "."):
                continue
            if comp == "..":
                if real:
                    real.pop()
                continue
            if tuple(real) + (comp,) in self._dirs:
                # opened before as a real directory (O_NOFOLLOW) and not removed since
                # (forget): no stat, each is a round trip through fuse2fs
                real.append(comp)
                continue
            dirfd = self._fd(tuple(real))
            try:
                st = os.stat(comp, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(comp, 0o755, dir_fd=dirfd)
                real.append(comp)
                if made is not None:
                    made.append(tuple(real))
                continue
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_SYMLINKS:
                    raise ApplyError(f"too many levels of symbolic links in {'/'.join(parts)}")
                target = os.readlink(comp, dir_fd=dirfd)
                if target.startswith("/"):
                    real = []
                todo = target.split("/") + todo
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise ApplyError(f"{'/'.join(parts)}: {'/'.join(real + [comp])} is not a "
                                 "directory")
            real.append(comp)
        return tuple(real)
