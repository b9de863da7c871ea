"""A stack: read-only sealed layers plus one writable upper, merged into one index.

Layer i's extents carry tag i in the merged index and the upper's carry tag len(layers),
so sealing the upper (it becomes layer len(layers)) changes no tag and no offset: the
merged index survives a seal untouched, which is what makes a snapshot O(1) here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .blob import Blob, FileBlob
from .errors import OutOfRangeError
from .index import ZERO, SegmentIndex
from .lsmt import DATA_FILE, SECTOR, SPACE, HeaderTrailer, SealedLayer
from .upper import Upper

LayerPlacer = Callable[[str, Path], Path]  # (digest, sealed data file) -> final path
Piece = tuple[Blob | None, int, int]  # (blob or None for zeros, byte offset in blob, length)


def merge_layers(layers: list[SealedLayer]) -> SegmentIndex:
    """The merged index of a list of layers, bottom first (newer layers win)."""
    merged = SegmentIndex()
    for tag, layer in enumerate(layers):
        merged = merged.overlay(layer.index.retag(tag))
    return merged


class Stack:
    """Layers (bottom first) + upper, with byte-addressed read/write/zero/flush/seal."""

    def __init__(self, name: str, layers: list[SealedLayer], upper: Upper, *,
                 merged: SegmentIndex | None = None) -> None:
        self.name = name
        self.layers = list(layers)
        self.upper = upper
        if merged is None:
            merged = merge_layers(self.layers).overlay(upper.index.retag(len(self.layers)))
        self.merged = merged
        self.blobs: list[Blob] = [layer.blob for layer in self.layers]
        self.blobs.append(upper)

    @property
    def virtual_size(self) -> int:
        return self.upper.virtual_size

    @property
    def layer_digests(self) -> list[str]:
        return [str(layer.digest) for layer in self.layers]

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.virtual_size:
            raise OutOfRangeError(
                f"stack {self.name}: [{offset}, +{length}) past end {self.virtual_size}"
            )

    def pieces(self, offset: int, length: int) -> list[Piece]:
        """Where the bytes of [offset, offset+length) live, merged into maximal pieces."""
        self._check(offset, length)
        end = offset + length
        out: list[Piece] = []

        def add(blob: Blob | None, boff: int, n: int) -> None:
            if out:
                pb, po, pn = out[-1]
                if pb is blob and (blob is None or po + pn == boff):
                    out[-1] = (pb, po, pn + n)
                    return
            out.append((blob, boff, n))

        pos = offset
        for ext in self.merged.lookup(offset // SECTOR, -(-end // SECTOR)):
            a = max(ext.start * SECTOR, offset)
            b = min(ext.end * SECTOR, end)
            if a > pos:
                add(None, 0, a - pos)
            if ext.tag == ZERO:
                add(None, 0, b - a)
            else:
                add(self.blobs[ext.tag], ext.moff * SECTOR + (a - ext.start * SECTOR), b - a)
            pos = b
        if pos < end:
            add(None, 0, end - pos)
        return out

    def read(self, offset: int, length: int) -> bytes:
        parts = []
        for blob, boff, n in self.pieces(offset, length):
            parts.append(bytes(n) if blob is None else blob.pread(boff, n))
        return b"".join(parts)

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        self._check(offset, len(data))
        if not data:
            return
        end = offset + len(data)
        s = offset // SECTOR
        e = -(-end // SECTOR)
        if offset % SECTOR or end % SECTOR:  # read-modify-write of the edge sectors
            buf = bytearray(self.read(s * SECTOR, (e - s) * SECTOR))
            buf[offset - s * SECTOR:end - s * SECTOR] = data
            data = buf
        tag = len(self.layers)
        hit = self.merged.lookup(s, e)
        if len(hit) == 1 and hit[0].tag == tag and hit[0].start == s and hit[0].end == e:
            self.upper.overwrite(hit[0].moff, data)  # already ours: rewrite in place
            return
        for a, b, moff in self.upper.write(s, data):
            self.merged.insert(a, b, tag, moff)

    def write_zeroes(self, offset: int, length: int) -> None:
        """Zero a range: whole sectors become zeroed extents, partial edges are written."""
        self._check(offset, length)
        end = offset + length
        s = -(-offset // SECTOR)
        e = end // SECTOR
        if s >= e:
            self.write(offset, bytes(length))
            return
        if offset < s * SECTOR:
            self.write(offset, bytes(s * SECTOR - offset))
        if end > e * SECTOR:
            self.write(e * SECTOR, bytes(end - e * SECTOR))
        self.upper.zero(s, e - s)
        self.merged.insert(s, e, ZERO, 0)

    trim = write_zeroes

    def flush(self) -> None:
        self.upper.flush()

    def seal(self, layer_path_for: LayerPlacer, new_upper_dir: Path, *,
             user_tag: bytes = b"") -> SealedLayer:
        """Seal the upper into layer N+1 and open an empty upper in `new_upper_dir`.

        `layer_path_for(digest, data_file)` moves the sealed file to its final place and
        returns the path. No data is copied; the merged index is kept as it is."""
        old = self.upper
        digest = old.seal(user_tag=user_tag)
        path = layer_path_for(digest, old.dir / DATA_FILE)
        # the layer keeps the upper's fd: a read that resolved pieces on it before the seal
        # may still be sending from it, so it must stay open (and mean the same file)
        blob = FileBlob(path, fd=old.data_fd)
        old.data_fd = -1
        trailer = HeaderTrailer.unpack(blob.pread(blob.size - SPACE, SPACE), what=str(path))
        layer = SealedLayer(blob, trailer, old.index, digest=digest)
        new = Upper.create(new_upper_dir, old.virtual_size, parent_uuid=old.info.uuid)
        old.close()
        self.layers.append(layer)
        self.blobs[-1] = layer.blob
        self.blobs.append(new)
        self.upper = new
        return layer

    def fork(self, name: str, upper: Upper) -> Stack:
        """A new stack over the same sealed layers (the caller sealed a dirty upper first)."""
        if len(self.upper.index):
            raise ValueError("fork needs an empty upper: seal first")
        return Stack(name, self.layers, upper, merged=self.merged.copy())

    def rebase(self, layers: list[SealedLayer], below: SegmentIndex) -> None:
        """Put `layers` (the same content, fewer files) under the upper; `below` is
        `merge_layers(layers)`, computed by the caller off any lock."""
        self.layers = list(layers)
        self.merged = below.overlay(self.upper.index.retag(len(self.layers)))
        self.blobs = [layer.blob for layer in self.layers]
        self.blobs.append(self.upper)

    def close(self) -> None:
        self.upper.close()

