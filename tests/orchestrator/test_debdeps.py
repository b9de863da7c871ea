"""host/builtin/debdeps.py: the Debian packages of a built-in template, resolved by the
real apt against an image's own dpkg status and unpacked with dpkg-deb.

The end-to-end path (R and Java kernels in a VM) is tests/e2e/test_code_interpreter.py;
here the pieces: apt's simulated install parsed into archive names, the fix-ups done in
place of maintainer scripts, and a whole tree for a small package."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from host.builtin import debdeps


def test_archive_names_from_simulated_install_lines() -> None:
    assert debdeps._deb_name(
        "Inst libpng16-16 (1.6.39-2+deb12u5 Debian:12.15/oldstable [amd64])") == \
        "libpng16-16_1.6.39-2+deb12u5_amd64.deb"
    # an epoch is escaped in apt's file names
    assert debdeps._deb_name("Inst x11-common (1:7.7+23 Debian:12.15/oldstable [all])") == \
        "x11-common_1%3a7.7+23_all.deb"


def test_fixups_merge_usr_link_alternatives_and_r_environ(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "lib/x86_64-linux-gnu/blas").mkdir(parents=True)
    (root / "lib/x86_64-linux-gnu/blas/libblas.so.3").write_text("blas")
    (root / "usr/lib/jvm/java-17-openjdk-amd64/bin").mkdir(parents=True)
    (root / "usr/lib/jvm/java-17-openjdk-amd64/bin/java").write_text("java")
    (root / "usr/lib/R/etc").mkdir(parents=True)
    (root / "usr/lib/R/etc/Renviron.ucf").write_text("R_HOME=x\n")
    for fixup in debdeps.FIXUPS:
        fixup(root)
    assert not (root / "lib").exists()            # moved under usr/: / has symlinks there
    assert (root / "usr/lib/x86_64-linux-gnu/blas/libblas.so.3").read_text() == "blas"
    assert (root / "usr/lib/x86_64-linux-gnu/libblas.so.3").readlink() == \
        Path("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3")
    assert (root / "usr/bin/java").readlink() == \
        Path("/usr/lib/jvm/java-17-openjdk-amd64/bin/java")
    assert not (root / "usr/bin/jshell").is_symlink()    # no target, no link
    assert (root / "etc/R/Renviron").read_text() == "R_HOME=x\n"


def test_guest_status_of_a_non_image_is_a_clear_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.ext4"
    junk.write_bytes(b"\0" * 4096)
    with pytest.raises(debdeps.DebDepsError, match="cannot read the dpkg status"):
        asyncio.run(debdeps.guest_status(junk))


def test_tree_of_a_small_package_against_an_image(tmp_path: Path) -> None:
    """A real ext4 holding this machine's dpkg status without `unzip`: the tree holds
    unzip's files (under usr/, with its package list) and nothing the status has."""
    stanzas = Path("/var/lib/dpkg/status").read_text().strip().split("\n\n")
    kept = [p for p in stanzas if not p.startswith("Package: unzip\n")]
    src = tmp_path / "src"
    (src / "var/lib/dpkg").mkdir(parents=True)
    (src / "var/lib/dpkg/status").write_text("\n\n".join(kept) + "\n")
    image = tmp_path / "image.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(src), str(image), "16M"], check=True,
                   capture_output=True)
    tree = asyncio.run(debdeps.ensure_tree(["unzip"], image, tmp_path / "cache"))
    assert (tree / "usr/bin/unzip").is_file()
    listed = (tree / "usr/share/aenv/debdeps.list").read_text().split()
    assert any(name.startswith("unzip_") for name in listed)
    assert listed == [n for n in listed if n.startswith("unzip_")]   # libc6 etc. are there
    assert not (tree / "usr/share/doc").exists()
    # cached: the same inputs give the same tree without apt
    assert asyncio.run(debdeps.ensure_tree(["unzip"], image, tmp_path / "cache")) == tree
