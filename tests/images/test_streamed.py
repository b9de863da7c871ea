"""An image's first layer streamed into `mke2fs -d -` (host/images/streamed.py, through the
real confined helper): the ext4 it makes is the one the tree's way makes, entry for entry;
a layer with an entry mke2fs would make differently goes the tree's way, saying why; bad
input fails as clearly as before."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from host.contract import BuildFailed
from host.images.streamed import NotPlain, Plain
from host.runtime.importhelper import MKFS_OPTIONS, UID_BASE, ConfinedHelper, mke2fs_reads_tar

from .ocibuild import LayerTar, compress

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and uid maps need root")

CAP = bytes.fromhex("0100000200040000") + bytes(12)  # cap_net_bind_service, v2


@pytest.fixture
def helper() -> Iterator[ConfinedHelper]:
    if not mke2fs_reads_tar():
        pytest.fail("this host's mke2fs does not read tars (e2fsprogs 1.47.1+ with "
                    "libarchive13): run `make setup`")
    h = ConfinedHelper()
    try:
        yield h
    finally:
        h.close()


def _populate(helper: ConfinedHelper, tmp_path: Path, layer: bytes, *, streamed: bool,
              name: str = "disk", mib: int = 64) -> tuple[Path, dict]:
    img = tmp_path / f"{name}.raw"
    subprocess.run(["mkfs.ext4", "-q", "-F", *MKFS_OPTIONS, str(img), f"{mib}M"], check=True)
    os.chown(img, UID_BASE, UID_BASE)

    def feed(stdin: IO[bytes]) -> None:
        stdin.write(compress(layer, "gzip"))

    summary = helper.populate(img, img.stat().st_size, tmp_path / f"{name}-tree",
                              ["--diff-id", "sha256:" + hashlib.sha256(layer).hexdigest()],
                              feed, streamed=streamed)
    return img, summary


def _tree(img: Path) -> dict[str, tuple]:
    """Every path of the image: (mode, uid, gid, size, links, mtime, symlink target or
    content md5, xattrs), read with debugfs (one run per directory level)."""
    out: dict[str, tuple] = {}
    todo = ["/"]
    while todo:
        d = todo.pop()
        listing = subprocess.run(["debugfs", "-R", f'ls -p "{d}"', str(img)],
                                 capture_output=True, text=True, check=True).stdout
        for line in listing.splitlines():
            fields = line.strip().split("/")  # /ino/mode/uid/gid/name/size/
            if len(fields) < 7 or fields[5] in (".", "..", "lost+found", ""):
                continue
            fields = fields[1:]
            path = f"{d.rstrip('/')}/{fields[4]}"
            mode = int(fields[1], 8)
            stat = subprocess.run(["debugfs", "-R", f'stat "{path}"', str(img)],
                                  capture_output=True, text=True, check=True).stdout
            links = next(w for w in stat.split("Links:")[1].split())
            mtime = stat.split("mtime:")[1].split("--")[0].strip()
            if mode >> 12 == 0o04:
                todo.append(path)
                body = ""
            elif mode >> 12 == 0o12:
                body = stat.split("link dest:")[1].split("\n")[0].strip() \
                    if "link dest:" in stat else "(slow link)"
            else:
                data = subprocess.run(["debugfs", "-R", f'cat "{path}"', str(img)],
                                      capture_output=True, check=True).stdout
                body = hashlib.md5(data).hexdigest()
            xattrs = subprocess.run(["debugfs", "-R", f'ea_list "{path}"', str(img)],
                                    capture_output=True, text=True, check=True).stdout
            out[path] = (oct(mode), fields[2], fields[3], fields[5], links, mtime, body,
                         "\n".join(sorted(x.strip() for x in xattrs.splitlines()[1:])))
    return out


def _debian_like() -> LayerTar:
    """What base layers carry: declared directories first, owners, setuid, hard and
    symbolic links (one longer than an inode holds), a capability, holes, an empty file."""
    return (LayerTar().dir("./").dir("usr").dir("usr/bin").dir("etc")
            .dir("home").dir("home/user", uid=1000, gid=1000, mode=0o750)
            .file("usr/bin/ping", b"\x7fELF" + bytes(5000), mode=0o755,
                  xattrs={"security.capability": CAP})
            .file("usr/bin/passwd", b"pw" * 3000, mode=0o4755)
            .hardlink("usr/bin/passwd2", "usr/bin/passwd", mode=0o4755)
            .symlink("usr/bin/sh", "dash")
            .symlink("etc/long", "/" + "x" * 120)
            .file("etc/shadow", b"root:*:1::::::\n", mode=0o640)
            .file("home/user/.bashrc", b"# hi\n", uid=1000, gid=1000)
            .file("home/user/holes", b"a" + bytes(3 * 4096) + b"b", uid=1000, gid=1000)
            .file("etc/empty", b"")
            .file("etc/caf\u00e9", b"unicode name\n")
            .dir("tmp", mode=0o1777)
            .node("etc/fifo", tarfile.FIFOTYPE, mode=0o600)
            .dir("dev").node("dev/null", tarfile.CHRTYPE, 1, 3))


def test_a_plain_layer_streams_and_makes_what_the_tree_makes(helper: ConfinedHelper,
                                                            tmp_path: Path) -> None:
    layer = _debian_like().bytes()
    streamed, summary = _populate(helper, tmp_path, layer, streamed=True, name="streamed")
    tree, tree_summary = _populate(helper, tmp_path, layer, streamed=False, name="tree")
    assert summary["streamed"] is True and "not_streamed" not in summary
    assert summary["diff_id"] == tree_summary["diff_id"]
    assert summary["tar_bytes"] == len(layer)
    assert (summary["files"], summary["hardlinks"], summary["symlinks"]) == (7, 1, 2)
    assert summary["devices"] == 1
    assert summary["seccomp_filters"] == 2  # read under DENIED and DENIED_APPLYING
    got, want = _tree(streamed), _tree(tree)
    # a device node, as Docker makes it; the tree's way cannot (root of a user namespace)
    assert got.pop("/dev/null")[0] == oct(0o20666) and "/dev/null" not in want
    assert "device node skipped" in str(tree_summary["warnings"])
    assert got == want
    assert "security.capability (20)" in got["/usr/bin/ping"][7]
    assert got["/usr/bin/passwd"][0] == oct(0o104755) and got["/usr/bin/passwd"][4] == "2"
    assert got["/home/user"][1:3] == ("1000", "1000")
    for img in (streamed, tree):
        assert subprocess.run(["e2fsck", "-fn", str(img)], capture_output=True,
                              check=False).returncode == 0
        assert "Filesystem volume name:   aenv-root" in subprocess.run(
            ["debugfs", "-R", "stats", str(img)], capture_output=True, text=True,
            check=True).stdout


@pytest.mark.parametrize(("layer", "why"), [
    (LayerTar().dir("etc").file("etc/.wh.passwd"), "whiteout"),
    (LayerTar().file("etc/passwd", b"x"), "not an earlier directory"),
    (LayerTar().dir("a").symlink("b", "a").file("b/f", b"x"), "not an earlier directory"),
    (LayerTar().dir("a").file("a/f", b"1").file("a/f", b"2"), "comes twice"),
    (LayerTar().dir("a").hardlink("a/l", "a/f").file("a/f", b"x"), "not an earlier file"),
    (LayerTar().dir("a").file("a/f", b"x", mode=0o755).hardlink("a/l", "a/f"),
     "differs from its file's"),
    (LayerTar().dir("a", mode=0o700).dir("./", mode=0o700), "root entry"),
    (LayerTar().dir("a").file("a/../../f", b"x"), "climbs"),
], ids=["whiteout", "no-parent", "under-symlink", "twice", "forward-link", "link-mode",
        "root-0700", "climbs"])
def test_an_entry_mke2fs_would_make_otherwise_goes_through_the_tree(
        helper: ConfinedHelper, tmp_path: Path, layer: LayerTar, why: str) -> None:
    tar = layer.bytes()
    try:
        tree, _ = _populate(helper, tmp_path, tar, streamed=False, name="tree")
    except BuildFailed as exc:  # what the tree's way refuses, it refuses streamed too
        with pytest.raises(BuildFailed) as streamed_exc:
            _populate(helper, tmp_path, tar, streamed=True, name="streamed")
        assert str(streamed_exc.value) == str(exc)
        return
    img, summary = _populate(helper, tmp_path, tar, streamed=True, name="streamed")
    assert why in summary["not_streamed"] and not summary.get("streamed")
    # (a directory the tar does not name is made when applied: its mtime is the clock's)
    assert _undated_dirs(_tree(img)) == _undated_dirs(_tree(tree))


def _undated_dirs(tree: dict[str, tuple]) -> dict[str, tuple]:
    return {p: (*v[:5], "" if v[0].startswith("0o4") else v[5], *v[6:])
            for p, v in tree.items()}


def _seconds(tree: dict[str, tuple]) -> dict[str, tuple]:
    return {p: (*v[:5], v[5].split(":")[0] + ":00000000", *v[6:]) for p, v in tree.items()}


def test_nanosecond_mtimes_and_every_xattr_are_written_after_mke2fs(
        helper: ConfinedHelper, tmp_path: Path) -> None:
    """mke2fs -d - keeps whole seconds and security.capability only: debugfs writes the
    rest after it, as the tree's way makes them (POSIX ACLs in ext4's own format)."""
    acl = bytes.fromhex("02000000" "01000700ffffffff" "02000500e8030000" "04000500ffffffff"
                        "10000500ffffffff" "20000400ffffffff")
    layer = (LayerTar().dir("var").dir("var/log", mtime=1_700_000_000.25)
             .dir("var/log/journal", xattrs={"system.posix_acl_default": acl,
                                             "system.posix_acl_access": acl})
             .file("var/log/a b", b"x", mtime=1_700_000_000.123456789,
                   xattrs={"user.note": b"hi", "trusted.t": b"\x00\xff",
                           "security.capability": CAP})
             .symlink("var/log/link", "a b")).bytes()
    streamed, summary = _populate(helper, tmp_path, layer, streamed=True, name="streamed")
    tree, _ = _populate(helper, tmp_path, layer, streamed=False, name="tree")
    assert summary["streamed"] is True and summary["fixups"] == 3
    got = _tree(streamed)
    # the tree's way keeps whole seconds (mke2fs -d of a directory copies no more) and
    # cannot set trusted.* (it applies as root of a user namespace: a warning says so)
    assert _seconds(got) == _tree(tree) | {"/var/log/a b": (
        *_tree(tree)["/var/log/a b"][:7], got["/var/log/a b"][7])}
    assert "trusted.t (2) = 00 ff" in got["/var/log/a b"][7]
    assert got["/var/log/a b"][5] == f"0x6553f100:{(123456700 << 2):08x}"  # str(float)
    assert got["/var/log"][5] == f"0x6553f100:{(250000000 << 2):08x}"
    assert "system.posix_acl_default (28)" in got["/var/log/journal"][7]
    assert 'user.note (2) = "hi"' in got["/var/log/a b"][7]
    assert _tree(tree)["/var/log/a b"][7].count("\n") == 1  # capability and user.note


def test_what_mke2fs_refuses_goes_through_the_tree_and_fails_there(helper: ConfinedHelper,
                                                                   tmp_path: Path) -> None:
    # a 300-byte name passes the checks; mke2fs stops on it, the tree's way says why
    layer = LayerTar().dir("a").file("a/" + "n" * 300, b"x").bytes()
    with pytest.raises(BuildFailed, match="File name too long"):
        _populate(helper, tmp_path, layer, streamed=True)


def test_a_bad_tar_or_diff_id_fails_clearly_when_streamed(helper: ConfinedHelper,
                                                          tmp_path: Path) -> None:
    layer = _debian_like().bytes()
    with pytest.raises(BuildFailed, match="invalid layer tar"):
        _populate(helper, tmp_path, layer[:len(layer) // 2 + 100], streamed=True)
    img = tmp_path / "d.raw"
    img.write_bytes(b"")
    os.chown(img, UID_BASE, UID_BASE)
    with pytest.raises(BuildFailed, match="diff id"):
        helper.populate(img, 64 << 20, tmp_path / "t", ["--diff-id", "sha256:" + "0" * 64],
                        lambda stdin: stdin.write(layer), streamed=True)


def _info(name: str, kind: bytes = tarfile.REGTYPE, **kw: object) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def test_plain_counts_what_it_lets_through_and_bounds_the_size() -> None:
    check = Plain(max_bytes=8 * 4096)  # every entry takes a block at least
    for ti in (_info("./", tarfile.DIRTYPE, mode=0o755), _info("d", tarfile.DIRTYPE),
               _info("d/f", size=100), _info("d/l", tarfile.LNKTYPE, linkname="d/f"),
               _info("d/s", tarfile.SYMTYPE, linkname="/nowhere"),
               _info("d/c", tarfile.CHRTYPE), _info("d", tarfile.DIRTYPE)):
        check.entry(ti)
    assert check.counts == {"entries": 7, "files": 1, "dirs": 2, "symlinks": 1,
                            "hardlinks": 1, "devices": 1, "fifos": 0, "bytes": 100,
                            "fixups": 0}
    with pytest.raises(NotPlain, match="more than the image's size"):
        check.entry(_info("d/big", size=10 << 30))
    with pytest.raises(NotPlain, match="tar type"):
        Plain(1 << 20).entry(_info("x", b"Z"))  # unknown to both: apply.py decides
