"""Convert a raw disk image (e.g. an ext4 rootfs) into one sealed LSMT layer.

    python -m host.storage.convert IMAGE OUT [--repo SPEC] [--user-tag TEXT]

OUT is a file, or a directory that receives `<hex>.lsmt`. All-zero 4 KiB blocks (and
holes of sparse files, found with SEEK_DATA/SEEK_HOLE) are skipped: they read as zeros
from an unmapped extent. Prints {"digest": ..., "path": ..., "virtual_size": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .lsmt import SECTOR, LayerWriter, digest_of_file
from .repository import open_repository

BLOCK = 4096
CHUNK = 1 << 20
_ZERO_CHUNK = bytes(CHUNK)
_ZERO_BLOCK = bytes(BLOCK)


def _data_regions(fd: int, size: int):  # type: ignore[no-untyped-def]
    """(start, end) of the regions that may hold data; the whole file without SEEK_DATA."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == 6:  # ENXIO: no data past pos
                return
            yield pos, size
            return
        yield start, min(end, size)
        pos = end


def convert_image(src: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                  user_tag: bytes = b"", parent_uuid: str = "") -> tuple[Path, str, int]:
    """Write IMAGE as a sealed layer; returns (path, digest, virtual_size)."""
    src = Path(src)
    size = src.stat().st_size
    vsize = -(-size // SECTOR) * SECTOR
    dest = Path(dest)
    out = dest / f".converting-{os.getpid()}.lsmt" if dest.is_dir() else dest
    writer = LayerWriter(out, vsize, user_tag=user_tag, parent_uuid=parent_uuid)
    fd = os.open(src, os.O_RDONLY)
    try:
        for start, end in _data_regions(fd, size):
            pos = start // BLOCK * BLOCK
            while pos < end:
                n = min(CHUNK, end - pos)
                chunk = os.pread(fd, n, pos)
                if len(chunk) < n:
                    raise OSError(f"{src}: short read at {pos}")
                if chunk != _ZERO_CHUNK[:n]:
                    _write_nonzero_runs(writer, pos, chunk)
                pos += n
    finally:
        os.close(fd)
    digest = writer.finish()
    if dest.is_dir():
        final = dest / f"{digest.split(':')[1]}.lsmt"
        os.replace(out, final)
        out = final
    return out, digest, vsize


def _write_nonzero_runs(writer: LayerWriter, base: int, chunk: bytes) -> None:
    run_start = -1
    view = memoryview(chunk)
    for i in range(0, len(chunk), BLOCK):
        block = view[i:i + BLOCK]
        zero = block == _ZERO_BLOCK[:len(block)]
        if not zero and run_start < 0:
            run_start = i
        elif zero and run_start >= 0:
            writer.write(base + run_start, bytes(view[run_start:i]))
            run_start = -1
    if run_start >= 0:
        data = bytes(view[run_start:])
        data += bytes(-len(data) % SECTOR)  # the image's last partial sector
        writer.write(base + run_start, data)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m host.storage.convert",
                                description="Convert a raw/ext4 image into a sealed LSMT layer.")
    p.add_argument("image")
    p.add_argument("out", help="output file, or a directory for <hex>.lsmt")
    p.add_argument("--repo", help="also upload to this repository (posix_fs:/DIR or oss://...)")
    p.add_argument("--user-tag", default="", help="commit message stored in the trailer")
    args = p.parse_args(argv)
    path, digest, vsize = convert_image(args.image, args.out, user_tag=args.user_tag.encode())
    if args.repo:
        open_repository(args.repo).put_layer(digest, path)
    assert digest == digest_of_file(path)
    print(json.dumps({"digest": digest, "path": str(path), "virtual_size": vsize}))


if __name__ == "__main__":
    main()
