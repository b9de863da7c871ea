"""Convert a raw disk image (e.g. an ext4 rootfs) into one sealed LSMT layer, and a stack
back into a raw image (`write_raw`).

    python -m host.storage.convert IMAGE OUT [--base BASE_IMAGE] [--repo SPEC] [--user-tag TEXT]

OUT is a file, or a directory that receives `<hex>.lsmt`. All-zero 4 KiB blocks (and
holes of sparse files, found with SEEK_DATA/SEEK_HOLE) are skipped: they read as zeros
from an unmapped extent. With --base, the layer holds only the blocks where IMAGE differs
from BASE_IMAGE: a delta to stack on BASE_IMAGE's layer (this is how the rootfs that
`make image` builds as base.ext4 + in-place layers becomes LSMT layers).
Prints {"digest": ..., "path": ..., "virtual_size": ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

from .lsmt import SECTOR, LayerWriter, digest_of_file
from .repository import open_repository
from .stack import Stack

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


def _merge_regions(*lists: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for lst in lists for r in lst):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def convert_image(src: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                  base: str | os.PathLike[str] | None = None, user_tag: bytes = b"",
                  parent_uuid: str = "") -> tuple[Path, str, int]:
    """Write IMAGE as a sealed layer; returns (path, digest, virtual_size).

    With `base` (the image of the layers below), only the 4 KiB blocks where IMAGE differs
    from `base` go into the layer: changed blocks as data, blocks IMAGE zeroed as zeroed
    extents. Stacked on a layer of `base`, the result reads exactly as IMAGE."""
    src = Path(src)
    size = src.stat().st_size
    vsize = -(-size // SECTOR) * SECTOR
    dest = Path(dest)
    out = dest / f".converting-{os.getpid()}.lsmt" if dest.is_dir() else dest
    writer = LayerWriter(out, vsize, user_tag=user_tag, parent_uuid=parent_uuid)
    fd = os.open(src, os.O_RDONLY)
    bfd = os.open(base, os.O_RDONLY) if base is not None else -1
    try:
        regions = list(_data_regions(fd, size))
        if bfd >= 0:
            bsize = os.fstat(bfd).st_size
            regions = _merge_regions(regions, [(a, min(b, size))
                                               for a, b in _data_regions(bfd, bsize) if a < size])
        for start, end in regions:
            pos = start // BLOCK * BLOCK
            while pos < end:
                n = min(CHUNK, end - pos)
                chunk = os.pread(fd, n, pos)
                if len(chunk) < n:
                    raise OSError(f"{src}: short read at {pos}")
                below = _ZERO_CHUNK[:n]
                if bfd >= 0:
                    below = os.pread(bfd, n, pos)
                    below += bytes(n - len(below))
                if chunk != below:
                    _write_changed_runs(writer, pos, chunk, below)
                pos += n
    finally:
        os.close(fd)
        if bfd >= 0:
            os.close(bfd)
    digest = writer.finish()
    if dest.is_dir():
        final = dest / f"{digest.split(':')[1]}.lsmt"
        os.replace(out, final)
        out = final
    return out, digest, vsize


def write_raw(stack: Stack, path: str | os.PathLike[str]) -> int:
    """Write `stack` as a sparse raw image at the new file `path` (0600): its data extents
    only, holes elsewhere (remote layers read through the chunk cache, as the NBD export
    reads them). Returns the data bytes written; a failure leaves no file."""
    size, written, pos = stack.virtual_size, 0, 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        for blob, boff, n in stack.pieces(0, size):
            done = 0
            while blob is not None and done < n:
                k = min(CHUNK, n - done)
                os.pwrite(fd, blob.pread(boff + done, k), pos + done)
                done += k
            written += done
            pos += n
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    return written


def _write_changed_runs(writer: LayerWriter, base: int, chunk: bytes, below: bytes) -> None:
    """Data runs for blocks that differ from `below` and are not zero; zeroed extents for
    blocks that became zero (only possible over a non-zero `below`)."""
    view = memoryview(chunk)
    run_start, run_kind = -1, ""

    def emit(end: int) -> None:
        if run_kind == "data":
            data = bytes(view[run_start:end])
            data += bytes(-len(data) % SECTOR)  # the image's last partial sector
            writer.write(base + run_start, data)
        elif run_kind == "zero":
            length = end - run_start
            writer.zero(base + run_start, -(-length // SECTOR) * SECTOR)

    for i in range(0, len(chunk), BLOCK):
        block = view[i:i + BLOCK]
        if block == below[i:i + BLOCK]:
            kind = ""
        elif block == _ZERO_BLOCK[:len(block)]:
            kind = "zero"
        else:
            kind = "data"
        if kind != run_kind:
            emit(i)
            run_start, run_kind = i, kind
    emit(len(chunk))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m host.storage.convert",
                                description="Convert a raw/ext4 image into a sealed LSMT layer.")
    p.add_argument("image")
    p.add_argument("out", help="output file, or a directory for <hex>.lsmt")
    p.add_argument("--repo", help="also upload to this repository (posix_fs:/DIR or oss://...)")
    p.add_argument("--base", help="image of the layers below: write only the blocks that differ")
    p.add_argument("--parent-uuid", default="", help="uuid of the layer below (for the header)")
    p.add_argument("--user-tag", default="", help="commit message stored in the trailer")
    args = p.parse_args(argv)
    path, digest, vsize = convert_image(args.image, args.out, base=args.base,
                                        user_tag=args.user_tag.encode(),
                                        parent_uuid=args.parent_uuid)
    if args.repo:
        open_repository(args.repo).put_layer(digest, path)
    assert digest == digest_of_file(path)
    print(json.dumps({"digest": digest, "path": str(path), "virtual_size": vsize}))


if __name__ == "__main__":
    main()
