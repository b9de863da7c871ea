"""The private-RAM preload (host/vmm/qemu/private_ram.c, preload.py), in a real process:
it opens the named base file read-only whatever the caller asks, turns a hole punched
into it into a no-op, and leaves every other file alone, so a discard of a copy-on-write
mapping (MADV_DONTNEED) falls back to the base's pages and the base never changes. The
VM-level proof (a jailed QEMU returning freed guest memory) is in
tests/runtime/test_confinement.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from host.vmm.qemu.preload import preload_env, private_ram_preload

PROBE = r"""
import ctypes, json, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
out = {}
for name in sys.argv[1:]:
    fd = os.open(name, os.O_RDWR)
    flags = int(open(f"/proc/self/fdinfo/{fd}").read().split("flags:")[1].split()[0], 8)
    rc = libc.fallocate(fd, PUNCH, ctypes.c_long(0), ctypes.c_long(4096))
    m = mmap.mmap(fd, 8192, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    m[4096:4101] = b"dirty"           # a private copy of the second page
    m.madvise(mmap.MADV_DONTNEED, 4096, 4096)  # what QEMU's discard does next
    out[name] = {"accmode": flags & 3, "punch": rc, "after": bytes(m[4096:4101]).decode()}
    m.close(); os.close(fd)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = private_ram_preload(tmp_path_factory.mktemp("lib"))
    assert built is not None, "the preload did not build (is cc installed?)"
    return built


def _probe(env: dict[str, str], *files: Path) -> dict[str, dict[str, object]]:
    res = subprocess.run([sys.executable, "-c", PROBE, *map(str, files)], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def test_the_base_is_opened_read_only_and_never_punched(lib: Path, tmp_path: Path) -> None:
    base, other = tmp_path / "base.mem", tmp_path / "other.mem"
    for f in (base, other):
        f.write_bytes(b"B" * 8192)
    base.chmod(0o444)
    out = _probe(preload_env(lib, base), base, other)
    # the base: read-only, the punch a no-op, the discarded page its file's again
    assert out[str(base)] == {"accmode": os.O_RDONLY, "punch": 0, "after": "BBBBB"}
    assert base.read_bytes() == b"B" * 8192
    # any other file is untouched by the preload: opened as asked, punched for real
    assert out[str(other)] == {"accmode": os.O_RDWR, "punch": 0, "after": "BBBBB"}
    assert other.read_bytes()[:4096] == bytes(4096)


def test_without_the_preload_the_punch_reaches_the_base(tmp_path: Path) -> None:
    """What it prevents: QEMU's discard of a writable private file mapping."""
    base = tmp_path / "base.mem"
    base.write_bytes(b"B" * 8192)
    _probe(dict(os.environ), base)
    assert base.read_bytes()[:4096] == bytes(4096)


def test_the_preload_is_built_once_per_source(lib: Path) -> None:
    assert private_ram_preload(lib.parent) == lib
    assert lib.stat().st_mode & 0o755 == 0o755  # loaded by jailed QEMUs, any uid
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # no temp file left
