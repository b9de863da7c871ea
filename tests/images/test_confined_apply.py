"""The host-side importer's confined helper (host/images/confined.py through
host/runtime/importhelper.py's ConfinedHelper): a layer applied onto a real ext4 image file
with fuse2fs, by an unprivileged uid in user, mount, network and PID namespaces of its own.
The image is read back with debugfs (never mounted on the host). Hostile layers: names
that climb, symlinks out, device nodes, a hard link to a host path, a file bigger than the
disk: each fails with a clear error or is contained, and nothing outside the image is
written."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from host.contract import BuildFailed
from host.runtime.importhelper import (
    MKFS_OPTIONS,
    UID_BASE,
    UID_COUNT,
    ConfinedHelper,
    mke2fs_reads_tar,
)

from .ocibuild import LayerTar, compress

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and uid maps need root")


@pytest.fixture
def helper() -> Iterator[ConfinedHelper]:
    h = ConfinedHelper()
    try:
        yield h
    finally:
        h.close()


def _image(tmp_path: Path, mib: int = 256) -> Path:
    img = tmp_path / "disk.raw"
    subprocess.run(["mkfs.ext4", "-q", "-F", *MKFS_OPTIONS, str(img), f"{mib}M"],
                   check=True)
    os.chown(img, UID_BASE, UID_BASE)
    return img


@pytest.fixture(params=["apply", "populate", "streamed"])
def mode(request: pytest.FixtureRequest) -> str:
    """`apply`: onto the image through fuse2fs; `populate` (a first layer): into a tree on
    the host's disk, then `mke2fs -d` makes the image of it; `streamed` (a first layer):
    the tar straight into `mke2fs -d -`, through a tree when an entry needs it."""
    if request.param == "streamed" and not mke2fs_reads_tar():
        pytest.fail("this host's mke2fs does not read tars (e2fsprogs 1.47.1+ with "
                    "libarchive13): run `make setup`")
    return str(request.param)


def _apply(helper: ConfinedHelper, img: Path, mode: str, feed, *args: str) -> dict:
    if mode == "apply":
        return helper.run(img, ["apply", *args], feed)
    tree = img.parent / "tree"
    summary = helper.populate(img, img.stat().st_size, tree, list(args), feed,
                              streamed=mode == "streamed")
    assert not tree.exists()  # the helper's tree goes with it
    assert bool(summary.get("streamed")) == (mode == "streamed"
                                             and not summary.get("not_streamed"))
    return summary


def _feed(data: bytes):
    def feed(stdin: IO[bytes]) -> None:
        stdin.write(data)
    return feed


def _debugfs(img: Path, request: str) -> str:
    return subprocess.run(["debugfs", "-R", request, str(img)], capture_output=True,
                          text=True, check=False).stdout


def _stat(img: Path, path: str) -> str:
    return _debugfs(img, f"stat {path}")


@pytest.mark.parametrize("inflated_by", [None, "igzip"])
def test_a_layer_lands_in_the_image_with_owners_modes_and_links(helper: ConfinedHelper,
                                                                tmp_path: Path, mode: str,
                                                                inflated_by: str | None) -> None:
    """The gzip inflated by the helper's Python or by igzip beside it (`--gzip`, as the
    importer asks for every gzip layer): the same image."""
    img = _image(tmp_path)
    layer = (LayerTar().dir("srv", uid=1000, gid=1000, mode=0o750)
             .file("srv/app.py", b"print('hi')\n", uid=1000, gid=1000, mode=0o4755)
             .symlink("srv/latest", "app.py").hardlink("srv/again.py", "srv/app.py")
             .file("etc/os-release", b"ID=test\n").bytes())
    summary = _apply(helper, img, mode, _feed(compress(layer, "gzip")),
                     "--diff-id", "sha256:" + hashlib.sha256(layer).hexdigest(),
                     *(["--gzip"] if inflated_by else []))
    assert summary["inflated_by"] == inflated_by
    assert summary["files"] == 2 and summary["hardlinks"] == 1
    # applied by the namespace's root, which is UID_BASE on this host
    assert summary["uid_map"] == f"0 {UID_BASE} {UID_COUNT}"
    assert summary["seccomp_filters"] == 2  # DENIED from the start, DENIED_APPLYING on top
    assert _debugfs(img, "cat /srv/app.py") == "print('hi')\n"
    st = _stat(img, "/srv/app.py")
    assert "User:  1000   Group:  1000" in st and "Mode:  04755" in st, st
    assert "Links: 2" in st
    assert "Fast link dest: \"app.py\"" in _stat(img, "/srv/latest")
    assert "Mode:  0750" in _stat(img, "/srv")
    st = _stat(img, "/")
    assert "User:     0   Group:     0" in st and "Mode:  0755" in st, st
    assert "Filesystem volume name:   aenv-root" in _debugfs(img, "stats")
    assert subprocess.run(["e2fsck", "-fn", str(img)], capture_output=True,
                          check=False).returncode == 0  # a clean filesystem


def test_a_layer_over_a_layer_replaces_entries_with_their_own_owners_and_modes(
        helper: ConfinedHelper, tmp_path: Path) -> None:
    """The second layer goes through fuse2fs (apply.py), where a file is created before any
    stat and a chown or chmod that would change nothing is skipped: whatever was at a name,
    the new entry's owner, mode and content are what the image holds."""
    img = _image(tmp_path)
    lower = (LayerTar().file("srv/a", b"lower\n", uid=1000, gid=1000, mode=0o600)
             .dir("srv/d", uid=1000, gid=1000).file("srv/d/inner", b"x")
             .file("srv/f", b"file\n", uid=7, gid=7).file("srv/same", b"old\n", mode=0o644)
             .bytes())
    upper = (LayerTar().file("srv/a", b"upper\n", uid=0, gid=0, mode=0o4711)
             .file("srv/d", b"now a file\n", uid=5, gid=6, mode=0o640)
             .symlink("srv/f", "a").file("srv/same", b"new\n", mode=0o644)
             .file("srv/new", b"n\n", uid=0, gid=0, mode=0o444).bytes())
    for layer in (lower, upper):
        helper.run(img, ["apply"], _feed(layer))
    assert _debugfs(img, "cat /srv/a") == "upper\n"
    st = _stat(img, "/srv/a")
    assert "User:     0   Group:     0" in st and "Mode:  04711" in st, st
    st = _stat(img, "/srv/d")
    assert "Type: regular" in st and "User:     5   Group:     6" in st, st
    assert "Mode:  0640" in st and _debugfs(img, "cat /srv/d") == "now a file\n"
    assert "Fast link dest: \"a\"" in _stat(img, "/srv/f")
    assert _debugfs(img, "cat /srv/same") == "new\n" and "Mode:  0644" in _stat(img, "/srv/same")
    assert "Mode:  0444" in _stat(img, "/srv/new")  # written through an fd made read-only
    assert subprocess.run(["e2fsck", "-fn", str(img)], capture_output=True,
                          check=False).returncode == 0


def test_xattrs_reach_the_image_and_acls_through_populate(helper: ConfinedHelper,
                                                          tmp_path: Path, mode: str) -> None:
    img = _image(tmp_path, mib=64)
    acl = struct.pack("<I", 2) + b"".join(  # POSIX ACL xattr: user 1000 r-x besides the mode
        struct.pack("<HHI", tag, perm, qid) for tag, perm, qid in
        ((1, 7, 0xFFFFFFFF), (2, 5, 1000), (4, 5, 0xFFFFFFFF), (0x10, 5, 0xFFFFFFFF),
         (0x20, 4, 0xFFFFFFFF)))
    cap = bytes.fromhex("0100000200040000") + bytes(12)  # cap_net_bind_service, v2
    layer = LayerTar().dir("srv").file("srv/a", b"x", mode=0o755, xattrs={
        "system.posix_acl_access": acl, "user.note": b"hello", "security.capability": cap})
    summary = _apply(helper, img, mode, _feed(layer.bytes()))
    listed = _debugfs(img, "ea_list /srv/a")
    assert 'user.note (5) = "hello"' in listed
    assert "security.capability (20) = 01 00 00 02 00 04 00 00" in listed
    if mode != "apply":  # in ext4's own ACL format: user_obj rwx, user 1000 r-x, ...
        # (mke2fs -d - keeps only security.capability: debugfs writes the others after)
        assert summary.get("fixups", 0) == (mode == "streamed")
        assert ("system.posix_acl_access (28) = 01 00 00 00 01 00 07 00 02 00 05 00 "
                "e8 03 00 00" in listed), listed
        assert not summary["warnings"]
    else:  # fuse2fs (1.47.0 and 1.47.2) refuses ACLs: said, not silently lost
        assert "xattr system.posix_acl_access not set" in str(summary["warnings"])


def test_a_diff_id_mismatch_fails(helper: ConfinedHelper, tmp_path: Path, mode: str) -> None:
    img = _image(tmp_path)
    layer = LayerTar().file("a", b"x").bytes()
    with pytest.raises(BuildFailed, match="diff id"):
        _apply(helper, img, mode, _feed(layer), "--diff-id", "sha256:" + "0" * 64)


def test_a_corrupt_gzip_fails_with_what_igzip_said(helper: ConfinedHelper, tmp_path: Path,
                                                   mode: str) -> None:
    """A gzip stream cut short or damaged: igzip's error, not the tar reader's (a tar cut
    short is all the reader sees); the image's files stay outside the target."""
    img = _image(tmp_path)
    layer = LayerTar().file("srv/big", os.urandom(1 << 20)).file("srv/after", b"x").bytes()
    gz = compress(layer, "gzip")
    damaged = gz[:len(gz) // 2] + bytes(b ^ 0xFF for b in gz[len(gz) // 2:len(gz) // 2 + 64]) \
        + gz[len(gz) // 2 + 64:]
    for broken in (gz[:len(gz) // 2], damaged):
        with pytest.raises(BuildFailed, match="the layer's gzip stream is corrupt: igzip"):
            _apply(helper, img, mode, _feed(broken), "--gzip")
    # and the same helper, given the whole stream, applies it
    assert _apply(helper, img, mode, _feed(gz), "--gzip")["inflated_by"] == "igzip"
    assert _debugfs(img, "cat /srv/after") == "x"


def test_a_hostile_layer_is_contained(helper: ConfinedHelper, tmp_path: Path, mode: str) -> None:
    img = _image(tmp_path)
    canary = Path("/tmp/aenv-confined-canary")
    canary.unlink(missing_ok=True)
    layer = (LayerTar()
             .file("../../../../tmp/aenv-confined-canary", b"climbed")      # names that climb
             .symlink("out", "/tmp").file("out/aenv-confined-canary", b"via link")
             .dir("etc").symlink("hostetc", "/etc")
             .file("hostetc/aenv-confined-canary", b"via /etc")
             .node("dev/sda", tarfile.BLKTYPE, 8, 0)                         # a device
             .bytes())
    summary = _apply(helper, img, mode, _feed(layer))
    assert not canary.exists() and not Path("/etc/aenv-confined-canary").exists()
    assert summary["skipped"] == 1 and "device node skipped" in str(summary["warnings"])
    # what climbed or followed a link landed inside the image
    assert _debugfs(img, "cat /tmp/aenv-confined-canary") == "via link"
    assert _debugfs(img, "cat /etc/aenv-confined-canary") == "via /etc"
    # a hard link to a host path names a path of the image, where there is none
    with pytest.raises(BuildFailed, match="hard link target /etc/shadow does not exist"):
        _apply(helper, img, mode, _feed(LayerTar().hardlink("x", "/etc/shadow").bytes()))


def test_a_file_bigger_than_the_disk_fails_clearly(helper: ConfinedHelper,
                                                   tmp_path: Path, mode: str) -> None:
    img = _image(tmp_path, mib=32)
    info = tarfile.TarInfo("huge")
    info.size = 10 << 30  # 10 GiB of zeros, streamed (never in memory)

    def feed(stdin: IO[bytes]) -> None:
        stdin.write(info.tobuf(format=tarfile.PAX_FORMAT))
        zeros = bytes(1 << 20)
        for _ in range(info.size >> 20):
            stdin.write(zeros)

    with pytest.raises(BuildFailed, match="No space left on device"):
        _apply(helper, img, mode, feed)
    assert img.stat().st_size == 32 << 20  # the image file did not grow


def test_a_host_without_fuse2fs_is_told_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # a host without the package, as `which` sees it (installing and removing it here
    # would change the machine the other tests run on)
    real = shutil.which
    monkeypatch.setattr(shutil, "which",
                        lambda cmd, **kw: None if cmd == "fuse2fs" else real(cmd, **kw))
    with pytest.raises(BuildFailed, match="apt-get install fuse2fs"):
        ConfinedHelper()


# What each filter refuses, in a process of its own (a filter cannot be taken off): run as
# root here, without the filters every call below would succeed.
SECCOMP_PROBE = r"""
import ctypes, errno, json, os, sys
from host.images import syscallfilter
libc = ctypes.CDLL(None, use_errno=True)
def call(fn, *args):
    rc = fn(*args)
    return 0 if rc >= 0 else ctypes.get_errno()
def probe():
    out = {"unshare_user": call(libc.unshare, 0x10000000),  # CLONE_NEWUSER
           "ptrace": call(libc.ptrace, 16, 0x7FFFFFFF, 0, 0),  # ATTACH, no such pid: ESRCH
           "keyctl": call(libc.syscall, 250, 0, 0, 0, 0)}     # KEYCTL_GET_KEYRING_ID
    if sys.argv[2] == "applying":  # no fork to try it in: exec here (success ends the probe)
        try:
            os.execv("/bin/true", ["/bin/true"])
        except PermissionError:
            out["exec"] = errno.EPERM
        try:
            if os.fork() == 0:
                os._exit(0)
            out["fork"] = 0
        except PermissionError:
            out["fork"] = errno.EPERM
        import threading  # threads are clones too, and still work
        t = threading.Thread(target=lambda: out.update(thread=1))
        t.start()
        t.join()
    else:
        pid = os.fork()
        if pid == 0:
            try:
                os.execv("/bin/true", ["/bin/true"])
            finally:
                os._exit(13)
        out["exec"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # 0: /bin/true ran
        out["fork"] = 0
    with open(sys.argv[1] + "/f", "w") as f:  # files still work
        f.write("ok")
    out["file"] = open(sys.argv[1] + "/f").read()
    return out
stage = sys.argv[2]
if stage != "none":
    libc.prctl(38, 1, 0, 0, 0)
    syscallfilter.deny_syscalls(syscallfilter.DENIED, namespaces=True)
if stage == "applying":
    syscallfilter.deny_syscalls(syscallfilter.DENIED_APPLYING, processes=False)
print(json.dumps(probe()))
"""


@pytest.mark.parametrize("stage", ["start", "applying"])
def test_the_seccomp_filters_refuse_what_the_helper_never_needs(tmp_path: Path,
                                                                stage: str) -> None:
    def probe(stage: str) -> dict[str, object]:
        out = subprocess.run([sys.executable, "-c", SECCOMP_PROBE, str(tmp_path), stage],
                             capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[2]).stdout
        return json.loads(out.splitlines()[-1])

    got = probe(stage)
    assert got["unshare_user"] == errno.EPERM and got["keyctl"] == errno.EPERM
    assert got["ptrace"] == errno.EPERM
    assert got["file"] == "ok"
    if stage == "applying":
        assert got["fork"] == errno.EPERM and got["exec"] == errno.EPERM
        assert got["thread"] == 1
    else:  # fuse2fs is started under the first filter: fork and exec still work
        assert got["fork"] == 0 and got["exec"] == 0


def test_without_filters_the_probe_calls_succeed(tmp_path: Path) -> None:
    """The probe's calls are refused by the filters, not by this host."""
    out = subprocess.run([sys.executable, "-c", SECCOMP_PROBE, str(tmp_path), "none"],
                         capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    got = json.loads(out.splitlines()[-1])
    assert got["unshare_user"] == 0 and got["ptrace"] == errno.ESRCH
    assert got["keyctl"] != errno.EPERM and got["exec"] == 0
