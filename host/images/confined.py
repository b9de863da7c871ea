"""Apply an OCI layer onto an ext4 image file on the host, confined (no VM, no privilege).

    python3 confined.py --image-fd N --go-fd M apply [--diff-id sha256:HEX] [--gzip]
                        (tar on stdin; --gzip: gzip, inflated by igzip: gunzip.py)
    python3 confined.py --image-fd N --go-fd M --tree-fd T populate [--diff-id sha256:HEX]
                        [--gzip] -- MKE2FS_OPTIONS...  (N: a file of the image's size)
    python3 confined.py --image-fd N --go-fd M populate --streamed [--diff-id ...] -- ...
    python3 confined.py --image-fd N --go-fd M finish --workdir DIR   (our files: tar on stdin)

Standalone (Python 3.11 stdlib, beside apply.py): the parent copies both into a directory
this unprivileged uid can read and runs them with the system's python3. The image file
comes as an open fd (read-write); the layer tar (plain or gzip: the parent decompresses
zstd) on stdin; one JSON summary line goes to stdout. The parent
(`host/runtime/importhelper.py`) starts this under `unshare --user --mount --net --pid
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
writable (a uid that owns nothing), no privilege gained by exec (no_new_privs), a seccomp
filter (`DENIED`: ptrace, BPF, io_uring, keys, modules, new namespaces, ...; fuse2fs runs
under it too) and, once the image is mounted, a second one while the layer is read
(`DENIED_APPLYING`: no mount, exec or fork), devices cannot be created (the kernel refuses
mknod in a user namespace: apply.py skips them with a warning). Then the image is unmounted and
fuse2fs's exit waited for, so every write has reached the file when this exits.

`populate` (an image's first layer, over nothing but the blank ext4): a child under both
filters applies the layer into an empty directory on the host's disk (given as an fd; only
this uid can enter it), its bytes bounded by the image's size; then `mke2fs -d` writes the
image's ext4 of that tree in one pass, about 3x faster than fuse2fs's round trip per
operation. Both ways give the layers above the same filesystem to apply onto.
`populate --streamed` (e2fsprogs 1.47.1+): mke2fs reads the tar itself, no tree at all,
while this process hashes it and checks each entry is one mke2fs makes as apply.py would
(host/images/streamed.py); exit 4 when one is not (the caller goes the tree's way).

Exit status: 0 done, 1 failed (invalid layer, I/O error, full disk: the message says),
3 diff id mismatch, 4 not for `--streamed` (why on stderr).
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

try:  # run as a script beside apply.py (the helper); imported as host.images.confined
    import streamed  # type: ignore[import-not-found,unused-ignore]
    from apply import apply_layer  # type: ignore[import-not-found,unused-ignore]
    from gunzip import layer_input  # type: ignore[import-not-found,unused-ignore]
    from layertar import (  # type: ignore[import-not-found,unused-ignore]
        ApplyError,
        DiffIdMismatch,
        clean_name,
    )
    from rootdir import Root  # type: ignore[import-not-found,unused-ignore]
    from streamed import NotPlain  # type: ignore[import-not-found,unused-ignore]
    from syscallfilter import (  # type: ignore[import-not-found,unused-ignore]
        DENIED,
        DENIED_APPLYING,
        SeccompError,
        deny_syscalls,
        filters,
    )
except ImportError:
    from host.images import streamed
    from host.images.apply import apply_layer
    from host.images.gunzip import layer_input
    from host.images.layertar import ApplyError, DiffIdMismatch, clean_name
    from host.images.rootdir import Root
    from host.images.streamed import NotPlain
    from host.images.syscallfilter import (
        DENIED,
        DENIED_APPLYING,
        SeccompError,
        deny_syscalls,
        filters,
    )

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
        deny_syscalls(DENIED_APPLYING, processes=False)
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


def apply(image_fd: int, diff_id: str | None, layer: IO[bytes]) -> dict[str, Any]:
    """The layer tar (plain or gzip: the parent decompresses zstd) onto the image."""
    with mounted_image(image_fd) as root:
        summary: dict[str, Any] = apply_layer(layer, root, expect_diff_id=diff_id)
    return summary


def populate(image_fd: int, tree_fd: int, diff_id: str | None, mkfs: list[str],
             layer: IO[bytes]) -> dict[str, Any]:
    """The first layer of an image (nothing below it but the blank ext4): applied into the
    empty directory `tree_fd` on the host's disk, then `mke2fs -d` makes the image's ext4 of
    that tree at once (3x faster than fuse2fs here, where a FUSE round trip per operation
    dominates). The layer is read by a child under DENIED_APPLYING (no exec, fork or mount)
    and bounded by the image's size; mke2fs, started after it is gone, only reads the tree
    (lstat/readlink: it never follows a symlink the layer made)."""
    tree = f"/proc/self/fd/{tree_fd}"  # its parents are root's alone: reached by the fd
    os.chmod(tree, 0o755)  # the root directory of the image, as the blank's
    size = os.fstat(image_fd).st_size
    status, summary = _in_child(lambda: apply_layer(layer, tree, expect_diff_id=diff_id,
                                                    max_bytes=size))
    if status != 0:
        raise _ChildFailed(status)
    mke2fs = shutil.which("mke2fs") or "/usr/sbin/mke2fs"
    proc = subprocess.run([mke2fs, "-q", "-F", "-t", "ext4", *mkfs, "-d", tree,
                           f"/proc/self/fd/{image_fd}", f"{size // 1024}k"],
                          pass_fds=(image_fd, tree_fd), stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    if proc.returncode != 0:
        raise ConfinedError(f"mke2fs -d: {proc.stderr.decode(errors='replace')[-500:]}")
    return summary


def populate_streamed(image_fd: int, diff_id: str | None, mkfs: list[str],
                      layer: IO[bytes]) -> dict[str, Any]:
    """The first layer of an image straight into `mke2fs -d -` (host/images/streamed.py):
    mke2fs reads the tar under DENIED; a child under DENIED_APPLYING too reads it beside
    it (the diff id, each entry checked); then `debugfs -w` writes what mke2fs leaves out
    (sub-second mtimes, xattrs but security.capability). NotPlain (exit 4, from the child
    or here) when an entry needs the tree's way (`populate`)."""
    size = os.fstat(image_fd).st_size
    image = f"/proc/self/fd/{image_fd}"
    mke2fs, sink, err_file = streamed.start_mke2fs(mkfs, image, size // 1024, (image_fd,))
    with err_file:
        # the sink is the child's alone: mke2fs sees the tar end when the child closes it
        status, summary = _in_child(
            lambda: streamed.stream(layer, sink, size, expect_diff_id=diff_id),
            parent_closes=sink)
        if status != 0:
            mke2fs.kill()
            mke2fs.wait()
            raise _ChildFailed(status)
        if mke2fs.wait() != 0:
            err_file.seek(0)
            said = err_file.read(64 << 10).decode(errors="replace").strip()
            raise NotPlain(f"mke2fs -d - refused it: {said[-300:]}")
    if fixups := summary.pop("fixup_list"):
        streamed.run_fixups(image, fixups, (image_fd,))
    return summary


def _in_child(work: Callable[[], dict[str, Any]], *, parent_closes: int = -1
              ) -> tuple[int, dict[str, Any]]:
    """`work` (reading the layer) in a child under the second filter (no exec, fork or
    mount); (its exit status, its summary). The child exits 0, 1 (failed), 3 (diff id
    mismatch) or 4 (not for `--streamed`), having said why on stderr."""
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        code = 1
        try:
            deny_syscalls(DENIED_APPLYING, processes=False)
            summary = work()
            summary["seccomp_filters"] = filters()
            with os.fdopen(out_w, "wb") as out:
                out.write(json.dumps(summary).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001 - said on stderr; the child never returns
            print(f"{exc}", file=sys.stderr)
            code = 3 if isinstance(exc, DiffIdMismatch) else 4 if isinstance(exc, NotPlain) \
                else 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(out_w)
    if parent_closes >= 0:
        os.close(parent_closes)
    with os.fdopen(out_r, "rb") as answer:
        text = answer.read()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return status, json.loads(text) if status == 0 else {}


class _ChildFailed(Exception):
    """The child applying the layer failed; it has said why on stderr."""


def finish(image_fd: int, workdir: str, files: IO[bytes]) -> dict[str, Any]:
    """Our init and envd (a tar of them on stdin, from the host's built-in image), the
    mount points they need, user `user` (uid 1000) and the image's working directory
    (Docker makes it when missing). Paths resolve as apply.py resolves a layer's: symlinks
    of the image followed inside it, never out."""
    import tarfile
    with mounted_image(image_fd) as target, \
            tarfile.open(fileobj=files, mode="r|") as tar:
        root = Root(target)
        try:
            _finish(root, target, tar, workdir)
        finally:
            root.close()
    return {"finished": True}


def _finish(root: Root, target: str, tar: Any, workdir: str) -> None:
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
    # our init boots a builder on a root that holds this (rootfs/init/init.c): an image's
    # own never does (the host's builder disk gets it from our tar, below)
    mark = os.path.join(directory("etc/aenv"), "builder")
    if os.path.isdir(mark) and not os.path.islink(mark):
        shutil.rmtree(mark)
    elif os.path.lexists(mark):
        os.unlink(mark)
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
    ap.add_argument("--tree-fd", type=int, default=-1, help="populate's empty directory")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("apply")
    a.add_argument("--diff-id")
    a.add_argument("--gzip", action="store_true", help="the layer is gzip (gunzip.py)")
    pp = sub.add_parser("populate")
    pp.add_argument("--diff-id")
    pp.add_argument("--gzip", action="store_true", help="the layer is gzip (gunzip.py)")
    pp.add_argument("--streamed", action="store_true", help="mke2fs -d - (no --tree-fd)")
    pp.add_argument("mkfs", nargs="*", help="mke2fs options (after --)")
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
        deny_syscalls(DENIED, namespaces=True)
        # igzip, if the layer is gzip, starts now: no program starts once it is read
        with layer_input(sys.stdin.buffer, getattr(args, "gzip", False)) as layer:
            if args.cmd == "apply":
                summary = apply(args.image_fd, args.diff_id, layer)
            elif args.cmd == "populate" and args.streamed:
                summary = populate_streamed(args.image_fd, args.diff_id, args.mkfs, layer)
            elif args.cmd == "populate":
                if args.tree_fd < 0:
                    raise ConfinedError("populate needs --tree-fd")
                summary = populate(args.image_fd, args.tree_fd, args.diff_id, args.mkfs,
                                   layer)
            else:
                summary = finish(args.image_fd, args.workdir, layer)
            summary["inflated_by"] = "igzip" if layer is not sys.stdin.buffer else None
    except _ChildFailed as exc:  # it said why on stderr
        return exc.args[0] if exc.args[0] in (3, 4) else 1
    except DiffIdMismatch as exc:
        print(f"{exc}", file=sys.stderr)
        return 3
    except NotPlain as exc:
        print(f"{exc}", file=sys.stderr)
        return 4
    except (ApplyError, ConfinedError, SeccompError, OSError) as exc:
        print(f"{exc}", file=sys.stderr)
        return 1
    with open("/proc/self/uid_map", encoding="ascii") as uid_map:  # who applied it
        summary["uid_map"] = " ".join(uid_map.read().split())
    summary.setdefault("seccomp_filters", filters())  # populate's: its child's
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
