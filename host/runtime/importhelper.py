"""`ConfinedHelper`: host/images/confined.py run as an unprivileged uid in namespaces of
its own, the way HostImporter (hostimport.py) applies each layer.

    copy the helper's standalone scripts where that uid can read them
    -> `unshare --user --mount --net --pid --fork` as UID_BASE, its uids mapped (0-65535 of
       the namespace onto UID_BASE..), then `go`: it re-executes itself as root of that
       namespace alone
    -> the layer on its stdin (a 1 MiB pipe), its one JSON summary line on stdout; exit
       status 0, 1 (failed: stderr says why), 3 (diff id mismatch), 4 (not streamable)

`populate` makes an image's first layer a new ext4: streamed into `mke2fs -d -` where this
host's mke2fs reads a tar (e2fsprogs 1.47.1+), else through a tree the uid owns.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from host.contract import BuildFailed
from host.images import APPLY_SCRIPTS
from host.images.errors import ImageCorrupt
from host.images.layertar import widen_pipe

# The helper's uids: the namespace's 0-65535 on this host range, used by nothing else.
UID_BASE = 3_900_000_000
UID_COUNT = 65536
HELPER_DIR = Path(__file__).resolve().parents[1] / "images"
# the helper's standalone scripts, copied together (apply.py's own: APPLY_SCRIPTS)
HELPER_SCRIPTS = ("confined.py", "gunzip.py", "streamed.py", "syscallfilter.py")
_HELPER_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_ANSWER_LIMIT = 1 << 20  # the helper's stdout and stderr kept (it prints one JSON line)
# How every imported image's ext4 is made (the blank, and a first layer's `mke2fs -d`):
# one geometry, so the blocks of layers above read the same on either. Without
# metadata_csum: fuse2fs (the layers above the first) spends over half its CPU in software
# crc32c, re-verifying every metadata block that libext2fs's 8-block cache read again
# (~100 reads per entry); /usr/share of the bench's image (8,367 entries) through fuse2fs:
# 3.6 s -> 1.9 s. The block layers are checked by digest on the host, and the filesystem
# is the guest's own, so its metadata checksums guarded nothing the host relies on.
MKFS_OPTIONS = ("-L", "aenv-root", "-m", "0", "-b", "4096", "-I", "256",
                "-O", "^metadata_csum", "-E", "lazy_itable_init=0,lazy_journal_init=0")


class NotStreamable(Exception):
    """A first layer `mke2fs -d -` would make differently from apply.py: why."""


@functools.cache
def mke2fs_reads_tar() -> bool:
    """Whether this host's mke2fs takes a tar for -d: e2fsprogs 1.47.1+ with libarchive
    (which it loads when asked; bookworm-backports has 1.47.2, `make setup` installs it)."""
    try:
        out = subprocess.run(["mke2fs", "-V"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    m = re.search(rb"mke2fs (\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    version = tuple(int(g) for g in m.groups()) if m else (0, 0, 0)
    return version >= (1, 47, 1) and ctypes.util.find_library("archive") is not None


class ConfinedHelper:
    """host/images/confined.py, run as an unprivileged uid in namespaces of its own.

    Its scripts are copied where that uid can read them (the checkout may sit under a
    directory only root can enter) and run with the system's python3 (ours may too)."""

    def __init__(self) -> None:
        for tool, package in (("fuse2fs", "fuse2fs"), ("unshare", "util-linux")):
            if shutil.which(tool, path=_HELPER_PATH) is None:
                raise BuildFailed(f"image import needs {tool} on this host: apt-get install "
                                  f"{package} (deploy/install.sh and make setup do)",
                                  step="base")
        self.scripts = Path(tempfile.mkdtemp(prefix="aenv-confined-"))
        for script in (*(HELPER_DIR / name for name in HELPER_SCRIPTS), *APPLY_SCRIPTS):
            shutil.copyfile(script, self.scripts / script.name)
            (self.scripts / script.name).chmod(0o644)
        self.scripts.chmod(0o755)

    def close(self) -> None:
        shutil.rmtree(self.scripts, ignore_errors=True)

    def run(self, image: Path, args: list[str], feed: Callable[[IO[bytes]], None], *,
            pass_fds: tuple[int, ...] = ()) -> dict[str, Any]:
        """The helper's summary of `args` on `image` (fed by `feed`); BuildFailed with
        what it said if it failed."""
        code, out, err = self._spawn(image, args, feed, pass_fds)
        if code == 4:
            raise NotStreamable(err.strip()[-300:])
        if code == 3:
            raise BuildFailed(f"image import: {err.strip()[-300:]}", step="base")
        if code != 0:
            why = err.strip()[-500:] or f"exit {code}"
            if why.startswith("unshare:"):
                why += (" (the helper needs user namespaces: user.max_user_namespaces > 0; "
                        "where AppArmor restricts them, kernel."
                        "apparmor_restrict_unprivileged_userns=0)")
            raise BuildFailed(f"image import failed: {why}", step="base")
        try:
            summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise BuildFailed(f"image import: the helper answered {out[-200:]!r}",
                              step="base") from None
        return summary

    def populate(self, image: Path, size: int, tree: Path, args: list[str],
                 feed: Callable[[IO[bytes]], None], *,
                 streamed: bool | None = None) -> dict[str, Any]:
        """`run` of `populate` ARGS (a first layer; ARGS its options) with the blank's
        mke2fs options on `image`, made a sparse file of `size` bytes: streamed into
        mke2fs where this host's reads a tar (`streamed` None) and the layer allows (else
        `not_streamed` in the summary says why), otherwise through `tree`, an empty
        directory of the helper's uid, removed after. `feed` may be called twice."""
        if streamed if streamed is not None else mke2fs_reads_tar():
            _blank_file(image, size)
            try:
                return self.run(image, ["populate", "--streamed", *args, "--",
                                        *MKFS_OPTIONS], feed)
            except NotStreamable as exc:
                why = str(exc)
        else:
            why = ""
        with _helper_dir(tree) as fd:
            _blank_file(image, size)
            summary = self.run(image, ["--tree-fd", str(fd), "populate", *args, "--",
                                       *MKFS_OPTIONS], feed, pass_fds=(fd,))
        return {**summary, "not_streamed": why} if why else summary

    def _spawn(self, image: Path, args: list[str], feed: Callable[[IO[bytes]], None],
               pass_fds: tuple[int, ...]) -> tuple[int, str, str]:
        """Spawn the helper in new namespaces as UID_BASE, map its uids, let it go, feed
        its stdin; (exit code, stdout, stderr)."""
        fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
        go_r, go_w = os.pipe()
        argv = ["unshare", "--user", "--mount", "--net", "--pid", "--fork", "--kill-child",
                _python(), str(self.scripts / "confined.py"), "--image-fd", str(fd),
                "--go-fd", str(go_r), *args]

        def as_helper() -> None:
            os.setgroups([])
            os.setresgid(UID_BASE, UID_BASE, UID_BASE)
            os.setresuid(UID_BASE, UID_BASE, UID_BASE)

        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(fd, go_r, *pass_fds), cwd="/",
                                env={"PATH": _HELPER_PATH, "LANG": "C.UTF-8"},
                                preexec_fn=as_helper)  # noqa: PLW1509 - before exec only
        os.close(go_r)
        os.close(fd)
        assert proc.stdin is not None
        widen_pipe(proc.stdin.fileno())  # the layer's bytes in fewer wakeups of the helper
        try:
            _map_ids(proc.pid)
            os.write(go_w, b"go")
            os.close(go_w)
            go_w = -1
            answers: dict[str, bytes] = {}
            readers = [_drain(proc.stdout, answers, "out"), _drain(proc.stderr, answers, "err")]
            for r in readers:
                r.start()
            try:
                feed(proc.stdin)
            except BrokenPipeError:
                pass  # the helper stopped reading: its exit code and stderr say why
            except ImageCorrupt as exc:
                proc.kill()
                raise BuildFailed(f"image import: {exc}", step="base") from exc
            finally:
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()
            code = proc.wait()
            for r in readers:
                r.join()
            return (code, answers.get("out", b"").decode(errors="replace"),
                    answers.get("err", b"").decode(errors="replace"))
        finally:
            if go_w >= 0:
                os.close(go_w)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _python() -> str:
    """The system's python3 (ours may live where the helper's uid cannot read)."""
    for candidate in ("/usr/bin/python3", shutil.which("python3") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise BuildFailed("image import needs python3 on the host", step="base")


def _map_ids(pid: int) -> None:
    """Map the namespace of `pid` (once unshare made it): 0-65535 onto UID_BASE."""
    own = os.readlink("/proc/self/ns/user")
    deadline = time.monotonic() + 10
    while os.readlink(f"/proc/{pid}/ns/user") == own:
        if time.monotonic() > deadline:
            raise BuildFailed("image import: the helper's user namespace did not appear",
                              step="base")
        time.sleep(0.002)
    for kind in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{kind}", "w") as f:
            f.write(f"0 {UID_BASE} {UID_COUNT}\n")


def _drain(stream: IO[bytes] | None, into: dict[str, bytes], key: str) -> threading.Thread:
    """A thread keeping the last _ANSWER_LIMIT bytes of `stream` in `into[key]`."""
    def run() -> None:
        buf = b""
        assert stream is not None
        while chunk := stream.read(65536):
            buf = (buf + chunk)[-_ANSWER_LIMIT:]
        into[key] = buf
    return threading.Thread(target=run, daemon=True)


@contextlib.contextmanager
def _helper_dir(path: Path) -> Iterator[int]:
    """An empty directory the helper's uid owns (an fd: its parents are root's alone),
    removed with whatever the helper left in it."""
    path.mkdir(mode=0o700)
    try:
        os.chown(path, UID_BASE, UID_BASE)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _blank_file(path: Path, size: int) -> None:
    """A sparse file of `size` bytes for the helper's uid (mke2fs writes it whole)."""
    with open(path, "wb") as f:
        f.truncate(size)
    os.chown(path, UID_BASE, UID_BASE)
