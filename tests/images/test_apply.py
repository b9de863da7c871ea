"""apply.py on the host against temp dirs: OCI whiteouts and opaque directories, links,
nodes, owners, modes, mtimes, xattrs, and every way a layer could write outside its root."""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from host.images import APPLY_SCRIPT, APPLY_SCRIPTS
from host.images.apply import apply_layer
from host.images.layertar import ApplyError, DiffIdMismatch, clean_name

from .ocibuild import LayerTar, compress

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (owners, devices)")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the root holding a sentinel no layer may touch."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "sentinel").write_text("keep")
    return d


def apply(root: Path, *layers: bytes, gz: bool = False) -> list[dict[str, object]]:
    out = []
    for i, layer in enumerate(layers):
        path = root.parent / (f"layer{i}.tar" + (".gz" if gz else ""))
        path.write_bytes(compress(layer, "gzip") if gz else layer)
        out.append(apply_layer(str(path), str(root)))
    return out


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def assert_outside_untouched(outside: Path) -> None:
    assert sorted(os.listdir(outside)) == ["sentinel"]
    assert (outside / "sentinel").read_text() == "keep"


# --- plain content ---------------------------------------------------------------------

def test_files_dirs_symlinks_modes_mtimes(root: Path) -> None:
    layer = (LayerTar().dir("etc", mode=0o755, mtime=1_600_000_000.5)
             .file("etc/motd", b"hello\n", mode=0o640, mtime=1_600_000_001.25)
             .file("usr/bin/tool", b"#!/bin/sh\n", mode=0o4755)   # parents not in the tar
             .symlink("etc/link", "motd")
             .dir("private", mode=0o700)
             .file("private/secret", b"s", mode=0o600).bytes())
    [summary] = apply(root, layer)
    assert (root / "etc/motd").read_bytes() == b"hello\n"
    assert stat.S_IMODE((root / "etc/motd").stat().st_mode) == 0o640
    assert stat.S_IMODE((root / "usr/bin/tool").stat().st_mode) == 0o4755
    assert stat.S_IMODE((root / "usr").stat().st_mode) == 0o755   # made for the path
    assert os.readlink(root / "etc/link") == "motd"
    assert stat.S_IMODE((root / "private").stat().st_mode) == 0o700
    assert (root / "etc/motd").stat().st_mtime_ns == 1_600_000_001_250_000_000
    # a directory's mtime survives the children written into it afterwards
    assert (root / "etc").stat().st_mtime_ns == 1_600_000_000_500_000_000
    assert summary["diff_id"] == "sha256:" + hashlib.sha256(layer).hexdigest()
    assert (summary["files"], summary["dirs"], summary["symlinks"]) == (3, 2, 1)


def test_gzip_layer_has_the_diff_id_of_its_tar(root: Path) -> None:
    layer = LayerTar().file("a", b"x" * 100_000).bytes()
    [summary] = apply(root, layer, gz=True)
    assert summary["diff_id"] == "sha256:" + hashlib.sha256(layer).hexdigest()
    assert (root / "a").read_bytes() == b"x" * 100_000


def test_empty_layer(root: Path) -> None:
    layer = LayerTar().bytes()   # only the end-of-archive blocks, as `RUN true` makes
    [summary] = apply(root, layer)
    assert summary["entries"] == 0 and tree(root) == set()
    assert summary["diff_id"] == "sha256:" + hashlib.sha256(layer).hexdigest()


def test_expected_diff_id_mismatch_raises(root: Path, tmp_path: Path) -> None:
    path = tmp_path / "l.tar"
    path.write_bytes(LayerTar().file("a", b"1").bytes())
    with pytest.raises(DiffIdMismatch, match="expected sha256:0+"):
        apply_layer(str(path), str(root), expect_diff_id="sha256:" + "0" * 64)


@pytest.mark.parametrize(("data", "match"), [
    (compress(LayerTar().file("a").bytes(), "zstd"), "zstd"),
    (b"not a tar at all" * 100, "invalid layer tar"),
    (gzip.compress(b"\x00" * 10)[:-6], "invalid layer tar"),
])
def test_unreadable_layers_raise(root: Path, tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "l"
    path.write_bytes(data)
    with pytest.raises(ApplyError, match=match):
        apply_layer(str(path), str(root))


def test_replacing_file_by_dir_and_dir_by_file(root: Path) -> None:
    lower = LayerTar().file("x", b"file").dir("y").file("y/inner", b"i").bytes()
    upper = LayerTar().dir("x").file("x/now-a-dir", b"d").file("y", b"now a file").bytes()
    apply(root, lower, upper)
    assert (root / "x/now-a-dir").read_bytes() == b"d"
    assert (root / "y").read_bytes() == b"now a file"


def test_dir_entry_over_existing_dir_keeps_lower_content(root: Path) -> None:
    lower = LayerTar().dir("d", mode=0o755).file("d/old", b"o").bytes()
    upper = LayerTar().dir("d", mode=0o750).file("d/new", b"n").bytes()
    apply(root, lower, upper)
    assert tree(root) == {"d", "d/old", "d/new"}
    assert stat.S_IMODE((root / "d").stat().st_mode) == 0o750


# --- whiteouts -------------------------------------------------------------------------

def test_whiteouts_delete_lower_files_and_dirs(root: Path) -> None:
    lower = (LayerTar().file("keep", b"k").file("gone", b"g").dir("dir")
             .file("dir/deep/file", b"f").file("sub/x", b"x").bytes())
    upper = (LayerTar().whiteout("gone").whiteout("dir").whiteout("sub/x")
             .whiteout("never-existed").bytes())
    [_, summary] = apply(root, lower, upper)
    assert tree(root) == {"keep", "sub"}
    assert summary["whiteouts"] == 4


def test_whiteout_never_hides_its_own_layer(root: Path) -> None:
    lower = LayerTar().file("a", b"lower").file("b", b"lower").bytes()
    # a: whiteout after the new file; b: whiteout before it (the usual order)
    upper = (LayerTar().file("a", b"upper").whiteout("a")
             .whiteout("b").file("b", b"upper").bytes())
    apply(root, lower, upper)
    assert (root / "a").read_bytes() == b"upper"
    assert (root / "b").read_bytes() == b"upper"
    assert not any(".wh." in p for p in tree(root))


def test_whiteout_of_a_dir_this_layer_added_to_hides_only_the_lower_part(root: Path) -> None:
    lower = LayerTar().file("d/old", b"o").bytes()
    upper = LayerTar().file("d/new", b"n").whiteout("d").bytes()
    apply(root, lower, upper)
    assert tree(root) == {"d", "d/new"}


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_whiteout_of_dot_names_is_ignored(root: Path, name: str) -> None:
    lower = LayerTar().file("d/f", b"f").bytes()
    upper = LayerTar().file(f"d/.wh.{name}").bytes()
    [_, summary] = apply(root, lower, upper)
    assert tree(root) == {"d", "d/f"}
    assert summary["warnings"]


@pytest.mark.parametrize("marker_first", [True, False])
def test_opaque_dir_hides_all_lower_content(root: Path, marker_first: bool) -> None:
    lower = (LayerTar().dir("d").file("d/a", b"a").file("d/sub/b", b"b").file("d/sub/c", b"c")
             .file("other/z", b"z").bytes())
    upper = LayerTar().dir("d")
    if marker_first:
        upper.opaque("d")
    upper.file("d/new", b"n").file("d/sub/c", b"c2").file("d/fresh/x", b"x")
    if not marker_first:
        upper.opaque("d")
    apply(root, lower, upper.bytes())
    assert tree(root) == {"d", "d/new", "d/sub", "d/sub/c", "d/fresh", "d/fresh/x",
                          "other", "other/z"}
    assert (root / "d/sub/c").read_bytes() == b"c2"


def test_opaque_dir_without_other_entries_empties_it(root: Path) -> None:
    lower = LayerTar().file("d/a", b"a").file("d/b/c", b"c").bytes()
    apply(root, lower, LayerTar().opaque("d").bytes())
    assert tree(root) == {"d"}


def test_aufs_metadata_is_skipped(root: Path) -> None:
    layer = (LayerTar().dir(".wh..wh.plnk").file(".wh..wh.plnk/123.456", b"x")
             .file(".wh..wh.aufs").file("real", b"r").bytes())
    apply(root, layer)
    assert tree(root) == {"real"}


# --- links and nodes -------------------------------------------------------------------

def test_hardlinks_within_and_across_layers(root: Path) -> None:
    lower = LayerTar().file("bin/tool", b"T", mode=0o755).bytes()
    upper = (LayerTar().hardlink("bin/alias", "bin/tool")
             .file("lib/data", b"D").hardlink("lib/data2", "lib/data")
             .hardlink("lib/data", "lib/data").bytes())   # a link to itself: no-op
    [_, summary] = apply(root, lower, upper)
    assert os.path.samestat((root / "bin/alias").stat(), (root / "bin/tool").stat())
    assert os.path.samestat((root / "lib/data2").stat(), (root / "lib/data").stat())
    assert (root / "lib/data").read_bytes() == b"D"
    assert summary["hardlinks"] == 2


def test_hardlink_replaces_existing_file_and_links_symlinks_not_targets(root: Path) -> None:
    lower = LayerTar().file("t", b"target").symlink("s", "t").file("dest", b"old").bytes()
    upper = LayerTar().hardlink("dest", "t").hardlink("s2", "s").bytes()
    apply(root, lower, upper)
    assert (root / "dest").read_bytes() == b"target"
    assert os.path.islink(root / "s2") and os.readlink(root / "s2") == "t"


@pytest.mark.parametrize("target", ["missing", "dir", "/"])
def test_hardlink_to_missing_or_directory_fails(root: Path, target: str) -> None:
    layer = LayerTar().dir("dir").hardlink("l", target).bytes()
    with pytest.raises(ApplyError):
        apply(root, layer)


def test_fifo(root: Path) -> None:
    apply(root, LayerTar().node("run/fifo", tarfile.FIFOTYPE, mode=0o620).bytes())
    st = (root / "run/fifo").lstat()
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o620


@ROOT_ONLY
def test_device_nodes(root: Path) -> None:
    layer = (LayerTar().node("dev/null", tarfile.CHRTYPE, 1, 3, mode=0o666)
             .node("dev/loop9", tarfile.BLKTYPE, 7, 9, mode=0o660).bytes())
    [summary] = apply(root, layer)
    null, loop = (root / "dev/null").lstat(), (root / "dev/loop9").lstat()
    assert stat.S_ISCHR(null.st_mode) and os.major(null.st_rdev) == 1
    assert os.minor(null.st_rdev) == 3 and stat.S_IMODE(null.st_mode) == 0o666
    assert stat.S_ISBLK(loop.st_mode) and os.minor(loop.st_rdev) == 9
    assert summary["devices"] == 2


@ROOT_ONLY
def test_numeric_owners_and_setuid_kept_after_chown(root: Path) -> None:
    layer = (LayerTar().dir("home/u", uid=1234, gid=5678, mode=0o750)
             .file("home/u/f", b"x", uid=1234, gid=5678, mode=0o6755)
             .symlink("home/u/l", "f", uid=1234, gid=42).bytes())
    apply(root, layer)
    for rel, (uid, gid) in {"home/u": (1234, 5678), "home/u/f": (1234, 5678),
                            "home/u/l": (1234, 42)}.items():
        st = (root / rel).lstat()
        assert (st.st_uid, st.st_gid) == (uid, gid), rel
    assert stat.S_IMODE((root / "home/u/f").stat().st_mode) == 0o6755


def _user_xattrs_supported(path: Path) -> bool:
    probe = path / ".xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return False
        raise
    finally:
        probe.unlink()


def test_xattrs_from_pax_headers(root: Path) -> None:
    if not _user_xattrs_supported(root):
        pytest.skip("the test filesystem has no user.* xattrs")
    binary = bytes(range(256))
    layer = (LayerTar().dir("d", xattrs={"user.dir": b"on a dir"})
             .file("d/f", b"x", xattrs={"user.text": b"hello", "user.binary": binary})
             .bytes())
    apply(root, layer)
    assert os.getxattr(root / "d", "user.dir") == b"on a dir"
    assert os.getxattr(root / "d/f", "user.text") == b"hello"
    assert os.getxattr(root / "d/f", "user.binary") == binary


# --- nothing escapes the root ----------------------------------------------------------

def test_clean_name() -> None:
    assert clean_name("./a/b/") == (["a", "b"], False)
    assert clean_name("/etc/passwd") == (["etc", "passwd"], True)
    assert clean_name("a/../../b") == (["b"], True)
    assert clean_name("a/./b/../c") == (["a", "c"], False)


def test_absolute_and_dotdot_names_stay_inside(root: Path, outside: Path) -> None:
    layer = (LayerTar().file("/abs", b"1").file("../../../outside/sentinel", b"pwned")
             .file("a/../../b", b"2").bytes())
    [summary] = apply(root, layer)
    assert (root / "abs").read_bytes() == b"1"
    assert (root / "outside/sentinel").read_bytes() == b"pwned"
    assert (root / "b").read_bytes() == b"2"
    assert summary["neutralised"] == 3
    assert_outside_untouched(outside)


@pytest.mark.parametrize("split_layers", [False, True])
def test_symlinked_parents_resolve_inside_the_root(root: Path, outside: Path,
                                                   split_layers: bool) -> None:
    links = (LayerTar().symlink("rel", "../outside").symlink("abs", str(outside))
             .symlink("up", "../../../../..").symlink("chain", "rel"))
    writes = (LayerTar() if split_layers else links)
    writes.file("rel/sentinel", b"pwned1").file("abs/sentinel", b"pwned2")
    writes.file("up/outside/sentinel", b"pwned3").file("chain/new", b"pwned4")
    writes.dir("abs/newdir").whiteout("rel/sentinel")
    layers = [links.bytes(), writes.bytes()] if split_layers else [links.bytes()]
    apply(root, *layers)
    assert_outside_untouched(outside)
    # `..` stops at the root: rel -> /outside, abs -> <root><outside>
    assert (root / "outside/sentinel").read_bytes() == b"pwned3"
    assert (root / "outside/new").read_bytes() == b"pwned4"
    inner = root / str(outside).lstrip("/")
    assert (inner / "sentinel").read_bytes() == b"pwned2"
    assert (inner / "newdir").is_dir()


def test_whiteout_and_opaque_through_symlinks_stay_inside(root: Path, outside: Path) -> None:
    lower = LayerTar().symlink("esc", str(outside)).symlink("esc2", "../outside").bytes()
    upper = (LayerTar().whiteout("esc/sentinel").whiteout("esc2/sentinel")
             .opaque("esc").opaque("esc2").bytes())
    apply(root, lower, upper)
    assert_outside_untouched(outside)


def test_a_file_replaces_a_symlink_instead_of_writing_through_it(root: Path,
                                                                  outside: Path) -> None:
    lower = (LayerTar().symlink("f", str(outside / "sentinel"))
             .symlink("d", str(outside)).bytes())
    upper = LayerTar().file("f", b"pwned").dir("d").hardlink("h", "f").bytes()
    apply(root, lower, upper)
    assert_outside_untouched(outside)
    assert (root / "f").read_bytes() == b"pwned" and not (root / "f").is_symlink()
    assert (root / "d").is_dir() and not (root / "d").is_symlink()


def test_hardlink_targets_resolve_inside_the_root(root: Path, outside: Path) -> None:
    for target in (str(outside / "sentinel"), "../outside/sentinel"):
        with pytest.raises(ApplyError, match="does not exist"):
            apply(root, LayerTar().hardlink("h", target).bytes())
    with pytest.raises(ApplyError, match="does not exist"):
        apply(root, LayerTar().symlink("esc", str(outside)).hardlink("h", "esc/sentinel")
              .bytes())
    assert os.stat(outside / "sentinel").st_nlink == 1


def test_symlink_loop_is_an_error(root: Path) -> None:
    with pytest.raises(ApplyError, match="too many levels"):
        apply(root, LayerTar().symlink("a", "b").symlink("b", "a").file("a/x").bytes())


def test_file_under_a_regular_file_is_an_error(root: Path) -> None:
    with pytest.raises(ApplyError, match="not a directory"):
        apply(root, LayerTar().file("f", b"").file("f/x", b"").bytes())


# --- as a script, with the system python ----------------------------------------------

def _python3() -> str:
    """Debian's python3 (as in the guest) when present, else this interpreter."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def test_script_runs_standalone_from_a_file_and_stdin(root: Path, tmp_path: Path) -> None:
    layer = LayerTar().file("hello", b"world").symlink("h", "hello").bytes()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    gz = tmp_path / "layer.tar.gz"
    gz.write_bytes(compress(layer, "gzip"))
    for module in APPLY_SCRIPTS:   # copied alone with its modules, as into the helper
        (tmp_path / module.name).write_bytes(module.read_bytes())
    script = tmp_path / "apply.py"
    run = subprocess.run([_python3(), "-E", "-s", str(script), "--diff-id", diff_id, str(gz),
                          str(root)], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["diff_id"] == diff_id
    assert (root / "hello").read_bytes() == b"world"

    second = tmp_path / "root2"
    second.mkdir()
    piped = subprocess.run([_python3(), "-E", "-s", str(script), "-", str(second)], input=layer,
                           capture_output=True, timeout=60, check=False)
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["diff_id"] == diff_id
    assert os.readlink(second / "h") == "hello"


def test_script_exit_codes(root: Path, tmp_path: Path) -> None:
    layer = tmp_path / "l.tar"
    layer.write_bytes(LayerTar().file("a").bytes())
    mismatch = subprocess.run([_python3(), "-E", "-s", str(APPLY_SCRIPT), "--diff-id",
                               "sha256:" + "1" * 64, str(layer), str(root)],
                              capture_output=True, text=True, timeout=60, check=False)
    assert mismatch.returncode == 3 and "expected sha256:111" in mismatch.stderr
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"garbage" * 200)
    invalid = subprocess.run([_python3(), "-E", "-s", str(APPLY_SCRIPT), str(bad), str(root)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert invalid.returncode == 1 and "invalid layer tar" in invalid.stderr
    usage = subprocess.run([_python3(), "-E", "-s", str(APPLY_SCRIPT)], capture_output=True,
                           timeout=60, check=False)
    assert usage.returncode == 2


@pytest.mark.parametrize("module", APPLY_SCRIPTS, ids=lambda p: p.name)
def test_script_imports_only_the_standard_library(module: Path) -> None:
    """Beside the stdlib only its sibling modules (the `host` package is the fallback of an
    import, not used where it runs standalone: the test above runs the copies alone)."""
    import ast

    tree_ = ast.parse(module.read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree_)
             if isinstance(node, ast.Import) for alias in node.names}
    names |= {str(node.module).split(".")[0] for node in ast.walk(tree_)
              if isinstance(node, ast.ImportFrom) and node.level == 0}
    siblings = {p.stem for p in APPLY_SCRIPTS}
    assert names <= set(sys.stdlib_module_names) | {"__future__", "host"} | siblings, names
