"""Apply an OCI layer onto an ext4 image file on the host, confined (no VM, no privilege).

    python3 confined.py --image-fd N --go-fd M apply [--diff-id sha256:HEX]  (tar on stdin)
    python3 confined.py --image-fd N --go-fd M finish --workdir DIR   (our files: tar on stdin)

Standalone (Python 3.11 stdlib, beside apply.py): the parent copies both into a directory
this unprivileged uid can read and runs them with the system's python3. The image file
comes as an open fd (read-write); the layer tar (plain or gzip: the parent decompresses
zstd) on stdin; one JSON summary line goes to stdout. The parent
(`host/runtime/hostimport.py`) starts this under `unshare --user --mount --net --pid
--fork` as an unprivileged host uid, maps uids/gids 0-65535 of the new user namespace onto
an unused host range, and only then writes `go` on the go fd: this process re-executes
itself, so that it is root of its namespace with that namespace's capabilities, and of no
other.

Inside: every mount is made private, tmpfs covers /tmp, /var/tmp and /dev/shm (a write
that escaped the target would land in memory that vanishes with the namespace), the
image is mounted with `fuse2fs` (e2fsprogs' userspace ext4: the host kernel never parses
the image; the ext4 the layer builds is written by libext2fs), and the layer is applied
with `apply.py`, the same code (whiteouts, opaque dirs, hard links, xattrs, no path
escape) the importer VM ran before. No network (an empty network namespace), no host file
writable (a uid that owns nothing), no privilege gained by exec (no_new_privs; no seccomp
filter yet: the stdlib has none), devices cannot be created (the kernel refuses mknod in
a user namespace: apply.py skips them with a warning). Then the image is unmounted and
fuse2fs's exit waited for, so every write has reached the file when this exits.

Exit status: 0 done, 1 failed (invalid layer, I/O error, full disk: the message says),
3 diff id mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:  # run as a script beside apply.py (the helper); imported as host.images.confined
    from apply import (  # type: ignore[import-not-found,unused-ignore]
        ApplyError,
        DiffIdMismatch,
        _Root,
        apply_layer,
        clean_name,
    )
except ImportError:
    from host.images.apply import ApplyError, DiffIdMismatch, _Root, apply_layer, clean_name

TARGET = "/tmp/aenv-root"
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_MNT_DETACH = 2
_PR_SET_NO_NEW_PRIVS = 38


class ConfinedError(Exception):
    pass


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    libc = _libc()
    if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                  ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise ConfinedError(f"mount {target}: {os.strerror(err)}")


def _umount(target: str) -> None:
    if _libc().umount2(target.encode(), _MNT_DETACH) != 0:
        raise ConfinedError(f"umount {target}: {os.strerror(ctypes.get_errno())}")


def _private_scratch() -> None:
    """Mounts of this namespace private; fresh tmpfs over the world-writable dirs."""
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE, None)
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d):
            _mount("tmpfs", d, "tmpfs", 0, "mode=1777,size=64m")


@contextlib.contextmanager
def mounted_image(image_fd: int) -> Iterator[str]:
    """The image of `image_fd` mounted at TARGET with fuse2fs; unmounted (and fuse2fs
    gone, every write in the file) on exit."""
    os.makedirs(TARGET, exist_ok=True)
    fuse2fs = shutil.which("fuse2fs") or "/usr/sbin/fuse2fs"
    proc = subprocess.Popen([fuse2fs, "-f", "-o", "fakeroot", f"/proc/self/fd/{image_fd}",
                             TARGET], pass_fds=(image_fd,), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(TARGET):
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise ConfinedError(f"fuse2fs could not mount the image: {err[-500:]}")
            if time.monotonic() > deadline:
                raise ConfinedError("fuse2fs did not mount the image within 30 s")
            time.sleep(0.02)
        yield TARGET
    finally:
        if os.path.ismount(TARGET):
            _umount(TARGET)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if code != 0 and sys.exc_info()[0] is None:
            raise ConfinedError(f"fuse2fs exited {code}: {err[-500:]}")


def apply(image_fd: int, diff_id: str | None) -> dict[str, Any]:
    """The layer tar on stdin (plain or gzip: the parent decompresses zstd) onto the image."""
    with mounted_image(image_fd) as root:
        summary: dict[str, Any] = apply_layer(sys.stdin.buffer, root, expect_diff_id=diff_id)
    return summary


def finish(image_fd: int, workdir: str) -> dict[str, Any]:
    """Our init and envd (a tar of them on stdin, from the host's built-in image), the
    mount points they need, user `user` (uid 1000) and the image's working directory
    (Docker makes it when missing). Paths resolve as apply.py resolves a layer's: symlinks
    of the image followed inside it, never out."""
    import tarfile
    with mounted_image(image_fd) as target, \
            tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        root = _Root(target)
        try:
            _finish(root, target, tar, workdir)
        finally:
            root.close()
    return {"finished": True}


def _finish(root: _Root, target: str, tar: Any, workdir: str) -> None:
    def directory(rel: str) -> str:
        real = root.resolve_dir(clean_name(rel)[0], create=True)
        return os.path.join(target, *(real or ()))

    def entry(rel: str) -> str:
        """The path of `rel` (its directories made), nothing left at it."""
        parts, _ = clean_name(rel)
        path = os.path.join(directory("/".join(parts[:-1])), parts[-1])
        if os.path.lexists(path):
            os.unlink(path)
        return path

    for d in ("usr/sbin", "usr/bin", "etc", "etc/aenv", "proc", "sys", "dev", "run", "tmp",
              "home", "root"):
        directory(d)
    os.chmod(directory("tmp"), 0o1777)
    for member in tar:  # our own regular files, from the host, straight into the image
        src = tar.extractfile(member) if member.isfile() else None
        if src is None:
            continue
        path = entry(member.name)
        with open(path, "wb") as out:
            shutil.copyfileobj(src, out)
        os.chmod(path, member.mode & 0o7777)
        os.utime(path, (member.mtime, member.mtime))
    os.symlink("aenv-init", entry("usr/sbin/aenv-exec"))
    etc = directory("etc")
    _append_missing(os.path.join(etc, "passwd"), "root:", "root:x:0:0:root:/root:/bin/sh\n")
    _append_missing(os.path.join(etc, "group"), "root:", "root:x:0:\n")
    _append_missing(os.path.join(etc, "passwd"), "user:",
                    "user:x:1000:1000:user:/home/user:/bin/sh\n")
    _append_missing(os.path.join(etc, "group"), "user:", "user:x:1000:\n")
    os.chown(directory("home/user"), 1000, 1000)
    if root.resolve_dir(clean_name(workdir)[0], create=False) is None:
        os.chown(directory(workdir), 1000, 1000)


def _append_missing(path: str, prefix: str, line: str) -> None:
    if os.path.islink(path):  # never follow one out of the image: a file of our own instead
        os.unlink(path)
    text = Path(path).read_text(errors="replace") if os.path.exists(path) else ""
    if not any(row.startswith(prefix) for row in text.splitlines()):
        with open(path, "a") as f:
            f.write(("" if text.endswith("\n") or not text else "\n") + line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="confined.py")
    ap.add_argument("--started", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--image-fd", type=int, required=True)
    ap.add_argument("--go-fd", type=int, required=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("apply")
    a.add_argument("--diff-id")
    f = sub.add_parser("finish")
    f.add_argument("--workdir", default="/home/user")
    args = ap.parse_args(argv)
    if not args.started:
        # wait for the parent to map our uids, then become root of the namespace
        with os.fdopen(args.go_fd, "rb") as go:
            if go.read(2) != b"go":
                return 1
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "--started",
                                  *(argv if argv is not None else sys.argv[1:])])
    try:
        if _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # no setuid way back up
            raise ConfinedError("prctl(PR_SET_NO_NEW_PRIVS) failed")
        _private_scratch()
        summary = (apply(args.image_fd, args.diff_id) if args.cmd == "apply"
                   else finish(args.image_fd, args.workdir))
    except DiffIdMismatch as exc:
        print(f"{exc}", file=sys.stderr)
        return 3
    except (ApplyError, ConfinedError, OSError) as exc:
        print(f"{exc}", file=sys.stderr)
        return 1
    with open("/proc/self/uid_map", encoding="ascii") as uid_map:  # who applied it
        summary["uid_map"] = " ".join(uid_map.read().split())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
