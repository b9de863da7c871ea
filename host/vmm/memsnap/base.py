"""The frozen base: a memory file every child maps MAP_PRIVATE, plus its template stream.

The template VM runs with ``memory-backend-file,share=on`` on a scratch file. ``freeze_base``
stops it, saves a ``migrate`` stream with x-ignore-shared (ROM pages + devices; it doubles as
the RAM-section template for every child's device state) and copies the memory file, sparse,
into a read-only ``base.mem`` whose sha256 identifies the base in every diff.

QEMU 7.2 opens mem-path O_RDWR even with share=off and may punch holes in it on discard, so
children must never use balloon, virtio-mem, discard-data or postcopy. ``verify_base`` checks
that the file was not changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from host.durable import write_atomic

from .devstate import parse_ram_prefix, qmp_execute, save_template
from .errors import CorruptSnapshotError, MemSnapError, SnapshotMismatchError

# Guest RAM is root's only: copies 0600, frozen bases read-only 0400.
PRIVATE_MODE = 0o600
# read by every VM of the family, jailed ones too (each as its own uid); the state dir
# above it is root's only
FROZEN_MODE = 0o444

BASE_MANIFEST = "base.json"
_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)


@dataclass(frozen=True)
class BaseImage:
    """A frozen base memory file and its template stream."""

    dir: Path
    mem_path: Path
    template_path: Path
    sha256: bytes
    size: int

    @property
    def id(self) -> str:
        return self.sha256.hex()

    @classmethod
    def load(cls, dir: str | os.PathLike[str]) -> Self:
        d = Path(dir)
        try:
            m = json.loads((d / BASE_MANIFEST).read_text())
            return cls(d, d / m["mem"], d / m["template"], bytes.fromhex(m["sha256"]), int(m["size"]))
        except FileNotFoundError as exc:
            raise MemSnapError(f"no base in {d}: {exc}") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptSnapshotError(f"{d / BASE_MANIFEST}: malformed base manifest: {exc}") from exc


def copy_sparse_hashing(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> tuple[bytes, int]:
    """Copy ``src`` to ``dst`` keeping holes; return (sha256 of the content, size)."""
    h = hashlib.sha256()
    sfd = os.open(src, os.O_RDONLY)
    try:
        size = os.fstat(sfd).st_size
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_MODE)
        try:
            os.fchmod(dfd, PRIVATE_MODE)  # also when `dst` existed, whatever the umask
            os.ftruncate(dfd, size)
            pos = 0
            while pos < size:
                try:
                    data = os.lseek(sfd, pos, os.SEEK_DATA)
                except OSError:  # ENXIO: only a hole is left
                    data = size
                for off in range(pos, data, _CHUNK):  # the hole [pos, data) hashes as zeros
                    h.update(_ZEROS[: min(_CHUNK, data - off)])
                if data >= size:
                    break
                hole = os.lseek(sfd, data, os.SEEK_HOLE)
                off = data
                while off < hole:
                    buf = os.pread(sfd, min(_CHUNK, hole - off), off)
                    if not buf:
                        raise MemSnapError(f"{src} shrank while copying")
                    h.update(buf)
                    if buf.count(0) != len(buf):  # keep all-zero chunks as holes
                        os.pwrite(dfd, buf, off)
                    off += len(buf)
                pos = hole
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return h.digest(), size


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges holding data in a sparse file (SEEK_DATA/SEEK_HOLE)."""
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        out.append((start, end))
        pos = end
    return out


def hash_file(path: str | os.PathLike[str]) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(_CHUNK):
            h.update(buf)
    return h.digest()


async def freeze_base(qmp: Any, mem_path: str | os.PathLike[str], dest_dir: str | os.PathLike[str],
                      *, timeout_s: float = 120.0) -> BaseImage:
    """Stop the share=on template VM, save its template stream and freeze its memory file.

    Leaves the template VM stopped (the caller quits it). Creates ``dest_dir`` with
    ``base.mem`` (mode 0400), ``base.dev`` and ``base.json`` (written last).
    """
    d = Path(dest_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    t0 = time.perf_counter()
    await qmp_execute(qmp, "stop")
    template = d / "base.dev"
    await save_template(qmp, template, timeout_s=timeout_s)
    parse_ram_prefix(template.read_bytes(), name=str(template))  # fail now, not at restore
    return install_base(d, mem_path, template, t0=t0)


def install_base(d: Path, mem_path: str | os.PathLike[str], template: Path, *, t0: float,
                 **extra: object) -> BaseImage:
    """Copy a VM's RAM file (sparse, hashing) into a read-only `d/base.mem` and write
    `base.json` last, naming `template` (in `d`): the frozen base of any driver.
    `extra` goes into the manifest."""
    tmp = d / ".base.mem.tmp"
    try:
        digest, size = copy_sparse_hashing(mem_path, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return commit_base(d, tmp, template, digest, size, **extra,
                       freeze_ms=round((time.perf_counter() - t0) * 1e3, 3))


def commit_base(d: Path, tmp: Path, template: Path, digest: bytes, size: int,
                **extra: object) -> BaseImage:
    """`tmp` (a complete, fsynced RAM file in `d` whose content hashes to `digest`) made the
    read-only `d/base.mem`, then `base.json` written last (the commit point) naming
    `template` (in `d`), with `extra` in it. `tmp` is removed if it cannot be placed."""
    try:
        os.chmod(tmp, FROZEN_MODE)
        os.rename(tmp, d / "base.mem")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    manifest = {
        "version": 1, "mem": "base.mem", "template": template.name, "sha256": digest.hex(),
        "size": size, **extra,
    }
    write_atomic(d / BASE_MANIFEST, json.dumps(manifest, indent=1).encode())
    return BaseImage(d, d / "base.mem", template, digest, size)


def verify_base(base: BaseImage, *, full: bool = False) -> None:
    """Check the base file still has its size (and, if ``full``, its sha256)."""
    try:
        st = os.stat(base.mem_path)
    except FileNotFoundError as exc:
        raise MemSnapError(f"base memory file {base.mem_path} is missing") from exc
    if st.st_size != base.size:
        raise SnapshotMismatchError(f"base {base.mem_path} changed size ({st.st_size} != {base.size})")
    if full and hash_file(base.mem_path) != base.sha256:
        raise SnapshotMismatchError(f"base {base.mem_path} content changed (sha256 mismatch)")
