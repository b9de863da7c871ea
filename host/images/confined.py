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
    from apply import ApplyError, DiffIdMismatch, apply_layer, clean_name  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    from host.images.apply import ApplyError, DiffIdMismatch, apply_layer, clean_name

TARGET = "/tmp/aenv-root"
STAGING = "/tmp/aenv-staged"
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
            _mount("tmpfs", d, "tmpfs", 0, "mode=1777,size=256m")


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
    (Docker makes it when missing)."""
    import tarfile
    with mounted_image(image_fd) as root, \
            tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        # staged on this namespace's tmpfs, not in the image: blocks written there and
        # freed would still differ from the layer below and grow the block layer
        staged = Path(STAGING)
        staged.mkdir(mode=0o700)
        for member in tar:  # our own regular files, from the host
            f = tar.extractfile(member)
            if f is None or "/" not in member.name.strip("/") and not member.isfile():
                continue
            dest = staged / member.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with dest.open("wb") as out:
                shutil.copyfileobj(f, out)
            dest.chmod(member.mode & 0o7777)
        _finish(Path(root), staged, workdir)
    return {"finished": True}


def _finish(root: Path, staged: Path, workdir: str) -> None:
    for d in ("usr/sbin", "usr/bin", "etc", "etc/aenv", "proc", "sys", "dev", "run", "tmp", "home",
              "root"):
        _mkdirs(root, d)
    (root / "tmp").chmod(0o1777)
    for rel in ("usr/sbin/aenv-init", "usr/bin/envd", "etc/aenv/release"):
        src = staged / rel
        if src.exists():
            dest = _inside(root, rel)
            if dest.is_symlink() or dest.exists():
                dest.unlink()
            shutil.copy2(src, dest)
    helper = _inside(root, "usr/sbin/aenv-exec")
    if helper.is_symlink() or helper.exists():
        helper.unlink()
    helper.symlink_to("aenv-init")
    shutil.rmtree(staged)
    passwd, group = _inside(root, "etc/passwd"), _inside(root, "etc/group")
    _append_missing(passwd, "root:", "root:x:0:0:root:/root:/bin/sh\n")
    _append_missing(group, "root:", "root:x:0:\n")
    _append_missing(passwd, "user:", "user:x:1000:1000:user:/home/user:/bin/sh\n")
    _append_missing(group, "user:", "user:x:1000:\n")
    home = _mkdirs(root, "home/user")
    os.chown(home, 1000, 1000)
    work = _inside(root, workdir.lstrip("/"))
    if not work.is_dir():
        made = _mkdirs(root, workdir.lstrip("/"))
        os.chown(made, 1000, 1000)


def _inside(root: Path, rel: str) -> Path:
    """`rel` below `root` with every directory on the way resolved inside it (a symlink in
    the image pointing at /etc resolves to root/etc, never the helper's own /etc)."""
    parts, _ = clean_name(rel)
    here = root
    for part in parts[:-1]:
        here = here / part
        for _ in range(40):
            if not here.is_symlink():
                break
            link = os.readlink(here)
            here = (root / link.lstrip("/")) if link.startswith("/") else here.parent / link
        here = Path(os.path.normpath(here))
        if here != root and root not in here.parents:
            raise ConfinedError(f"{rel}: a symlink in the image leads outside it")
    return here / parts[-1] if parts else root


def _mkdirs(root: Path, rel: str) -> Path:
    path = _inside(root, rel)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _append_missing(path: Path, prefix: str, line: str) -> None:
    if path.is_symlink():  # never follow one out of the image: a file of our own instead
        path.unlink()
    text = path.read_text(errors="replace") if path.exists() else ""
    if not any(row.startswith(prefix) for row in text.splitlines()):
        with path.open("a") as f:
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
