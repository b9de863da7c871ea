"""The overlaybd LSMT layer format: header/trailer, 16-byte index entries, sealed layers.

Layout of a sealed layer file (all integers little-endian, sizes in 512-byte sectors):

    header  4096 B   magic, flags (is_header=1, data file, sealed=0), uuids, virtual size
    data    n*512 B  appended (over)written data; may hold unreferenced garbage
    index   k*16 B   sorted SegmentMappings, padded to 4 KiB with invalid mappings
    trailer 4096 B   like the header with is_header=0, sealed=1, index_offset, index_size

A writable upper (upper.py) is the same data file without index and trailer, plus an index
journal; `seal_data_file` turns such a file into a sealed layer in place. The file's sha256
is kept incrementally while it is appended, so the digest is free.
"""

from __future__ import annotations

import hashlib
import os
import struct
import uuid as uuidlib
from dataclasses import dataclass, replace
from pathlib import Path

from .appender import Appender
from .blob import Blob, FileBlob
from .errors import LayerFormatError
from .index import ZERO, SegmentIndex

SECTOR = 512
SPACE = 4096  # header and trailer size
MAGIC0 = b"LSMT\x00\x01\x02\x00"
MAGIC1 = bytes.fromhex("657E63D294440 84CA2D2C8EC4FCFAE8A".replace(" ", ""))
HT_STRUCT = struct.Struct("<8s16sIIQQQ37s37sHBB256s")
HT_SIZE = HT_STRUCT.size  # 390, the `size` field
FLAG_HEADER = 1 << 0
FLAG_DATA_FILE = 1 << 1
FLAG_SEALED = 1 << 2
FLAG_GC = 1 << 3
FLAG_SPARSE_RW = 1 << 4
FLAG_INFO_VALID = 1 << 5
MAX_OFFSET = (1 << 50) - 1  # also the INVALID_OFFSET of padding entries
MAX_LENGTH = (1 << 14) - 1  # sectors per index entry
MAX_MOFFSET = (1 << 55) - 1
ENTRY = struct.Struct("<QQ")
MAX_RO_INDEX_ENTRIES = 1_000_000 * 16  # generous; overlaybd caps RO indexes at 1M entries
DATA_FILE = "data.lsmt"
JOURNAL_FILE = "index.lsmt"

assert HT_SIZE == 390


@dataclass(frozen=True, slots=True)
class HeaderTrailer:
    """One decoded header or trailer."""

    is_header: bool
    is_data_file: bool
    sealed: bool
    index_offset: int  # bytes
    index_size: int  # number of 16-byte entries, padding included
    virtual_size: int  # bytes
    uuid: str
    parent_uuid: str = ""
    version: int = 1
    sub_version: int = 1
    user_tag: bytes = b""
    flags_extra: int = 0

    @property
    def flags(self) -> int:
        f = self.flags_extra
        f |= FLAG_HEADER if self.is_header else 0
        f |= FLAG_DATA_FILE if self.is_data_file else 0
        f |= FLAG_SEALED if self.sealed else 0
        return f

    def pack(self) -> bytes:
        if len(self.user_tag) > 256:
            raise ValueError("user_tag longer than 256 bytes")
        raw = HT_STRUCT.pack(
            MAGIC0, MAGIC1, HT_SIZE, self.flags, self.index_offset, self.index_size,
            self.virtual_size, _uuid_field(self.uuid), _uuid_field(self.parent_uuid), 0,
            self.version, self.sub_version, self.user_tag,
        )
        return raw + bytes(SPACE - HT_SIZE)

    @classmethod
    def unpack(cls, buf: bytes, *, what: str = "header") -> HeaderTrailer:
        if len(buf) < SPACE:
            raise LayerFormatError(f"{what} truncated: {len(buf)} of {SPACE} bytes")
        (m0, m1, size, flags, ioff, isize, vsize, u, pu, _r, ver, subver, tag) = (
            HT_STRUCT.unpack_from(buf)
        )
        if m0 != MAGIC0 or m1 != MAGIC1:
            raise LayerFormatError(f"{what}: wrong magic {m0[:8]!r} (not an LSMT file)")
        if size != HT_SIZE:
            raise LayerFormatError(f"{what}: header size field {size}, expected {HT_SIZE}")
        return cls(
            is_header=bool(flags & FLAG_HEADER), is_data_file=bool(flags & FLAG_DATA_FILE),
            sealed=bool(flags & FLAG_SEALED), index_offset=ioff, index_size=isize,
            virtual_size=vsize, uuid=_uuid_str(u), parent_uuid=_uuid_str(pu), version=ver,
            sub_version=subver, user_tag=tag.rstrip(b"\x00"),
            flags_extra=flags & ~(FLAG_HEADER | FLAG_DATA_FILE | FLAG_SEALED),
        )


def _uuid_field(s: str) -> bytes:
    raw = s.encode()
    if len(raw) > 36:
        raise ValueError(f"uuid too long: {s!r}")
    return raw


def _uuid_str(raw: bytes) -> str:
    return raw.split(b"\x00", 1)[0].decode("ascii", "replace")


def pack_entry(offset: int, length: int, moffset: int, zeroed: bool, tag: int = 0) -> bytes:
    """One 16-byte SegmentMapping (offset:50 length:14 | moffset:55 zeroed:1 tag:8)."""
    return ENTRY.pack(offset | (length << 50), moffset | (int(zeroed) << 55) | (tag << 56))


def unpack_entries(buf: bytes) -> list[tuple[int, int, int, bool]]:
    """(offset, length, moffset, zeroed) of each entry, padding entries dropped."""
    out = []
    for w0, w1 in ENTRY.iter_unpack(buf[: len(buf) // 16 * 16]):
        offset = w0 & MAX_OFFSET
        if offset == MAX_OFFSET:
            continue
        out.append((offset, w0 >> 50, w1 & MAX_MOFFSET, bool((w1 >> 55) & 1)))
    return out


def index_entries(index: SegmentIndex, *, pad: bool) -> bytes:
    """The on-disk entries of an index (extents split to MAX_LENGTH), padded to 4 KiB."""
    parts = []
    runs: list[list[int]] = []  # [start, end, moff, zeroed], adjacent extents coalesced
    for ext in index:
        z = int(ext.tag == ZERO)
        if runs and runs[-1][1] == ext.start and runs[-1][3] == z and (
                z or runs[-1][2] + runs[-1][1] - runs[-1][0] == ext.moff):
            runs[-1][1] = ext.end
        else:
            runs.append([ext.start, ext.end, 0 if z else ext.moff, z])
    for start, end, moff, z in runs:
        s, m = start, moff
        while s < end:
            n = min(MAX_LENGTH, end - s)
            parts.append(pack_entry(s, n, 0 if z else m, bool(z)))
            s += n
            m += n
    if pad:
        per_page = SPACE // ENTRY.size
        parts.extend([pack_entry(MAX_OFFSET, 0, 0, False)] * (-len(parts) % per_page))
    return b"".join(parts)


def digest_of_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def new_uuid() -> str:
    return str(uuidlib.uuid4())


class SealedLayer:
    """A read-only LSMT layer: its trailer, header and own index, read through a blob."""

    def __init__(self, blob: Blob, trailer: HeaderTrailer, index: SegmentIndex,
                 *, digest: str | None = None) -> None:
        self.blob = blob
        self.trailer = trailer
        self.index = index
        self.digest = digest

    @property
    def virtual_size(self) -> int:
        return self.trailer.virtual_size

    @property
    def uuid(self) -> str:
        return self.trailer.uuid

    @classmethod
    def open(cls, blob: Blob, *, digest: str | None = None, name: str = "layer") -> SealedLayer:
        """Parse and validate a sealed layer; LayerFormatError says what is wrong."""
        size = blob.size
        if size < 2 * SPACE:
            raise LayerFormatError(f"{name}: truncated ({size} bytes, need header + trailer)")
        header = HeaderTrailer.unpack(blob.pread(0, SPACE), what=f"{name}: header")
        if not header.is_header:
            raise LayerFormatError(f"{name}: first 4 KiB is not a header")
        t = HeaderTrailer.unpack(blob.pread(size - SPACE, SPACE), what=f"{name}: trailer")
        if t.is_header or not t.is_data_file or not t.sealed:
            raise LayerFormatError(f"{name}: trailer missing or layer not sealed (truncated?)")
        trailer_off = size - SPACE
        nbytes = t.index_size * ENTRY.size
        if t.index_offset < SPACE or t.index_offset % SECTOR:
            raise LayerFormatError(f"{name}: bad index offset {t.index_offset}")
        if t.index_offset + nbytes > trailer_off:
            raise LayerFormatError(
                f"{name}: index [{t.index_offset}, +{nbytes}) runs past the trailer at {trailer_off}"
            )
        if t.virtual_size % SECTOR:
            raise LayerFormatError(f"{name}: virtual size {t.virtual_size} not sector-aligned")
        index = SegmentIndex()
        vsec = t.virtual_size // SECTOR
        data_end = t.index_offset // SECTOR
        prev_end = 0
        for off, length, moff, zeroed in unpack_entries(blob.pread(t.index_offset, nbytes)):
            if length == 0:
                raise LayerFormatError(f"{name}: empty index entry at sector {off}")
            if off < prev_end:
                raise LayerFormatError(f"{name}: index not sorted/overlapping at sector {off}")
            if off + length > vsec:
                raise LayerFormatError(f"{name}: index entry at sector {off} past virtual size")
            if not zeroed and (moff < SPACE // SECTOR or moff + length > data_end):
                raise LayerFormatError(
                    f"{name}: index entry at sector {off} points past data "
                    f"(data sectors [{moff}, {moff + length}), data ends at {data_end})"
                )
            index.insert(off, off + length, ZERO if zeroed else 0, 0 if zeroed else moff)
            prev_end = off + length
        return cls(blob, t, index, digest=digest)

    @classmethod
    def open_path(cls, path: str | os.PathLike[str], *, digest: str | None = None) -> SealedLayer:
        blob = FileBlob(path)
        try:
            return cls.open(blob, digest=digest, name=str(path))
        except BaseException:
            blob.close()
            raise

    def close(self) -> None:
        self.blob.close()


class LayerWriter:
    """Writes a sealed layer from scratch (used by conversion and tests)."""

    def __init__(self, path: str | os.PathLike[str], virtual_size: int, *,
                 uuid: str | None = None, parent_uuid: str = "", user_tag: bytes = b"") -> None:
        if virtual_size % SECTOR:
            raise ValueError("virtual_size must be a multiple of 512")
        self.path = Path(path)
        self.info = HeaderTrailer(is_header=True, is_data_file=True, sealed=False,
                                  index_offset=0, index_size=0, virtual_size=virtual_size,
                                  uuid=uuid or new_uuid(), parent_uuid=parent_uuid,
                                  user_tag=user_tag)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.out = Appender(self.fd, 0, hashlib.sha256())
        self.out.append(self.info.pack())
        self.index = SegmentIndex()

    def write(self, offset: int, data: bytes) -> None:
        """Data for byte `offset` (both sector-aligned)."""
        if offset % SECTOR or len(data) % SECTOR:
            raise ValueError("LayerWriter.write needs sector-aligned offset and length")
        at = self.out.append(data)
        s = offset // SECTOR
        self.index.insert(s, s + len(data) // SECTOR, 0, at // SECTOR)

    def zero(self, offset: int, length: int) -> None:
        s = offset // SECTOR
        self.index.insert(s, s + length // SECTOR, ZERO, 0)

    def finish(self) -> str:
        """Write index and trailer, fsync, close; returns the layer digest."""
        digest = seal_data_file(self.out, self.index, self.info)
        os.close(self.fd)
        return digest


def seal_data_file(out: Appender, index: SegmentIndex, info: HeaderTrailer) -> str:
    """Append index + trailer to a data file being written through `out`; fsync; digest."""
    out.digest_state()
    index_offset = out.pos
    entries = index_entries(index, pad=True)
    out.append(entries)
    trailer = replace(info, is_header=False, sealed=True, index_offset=index_offset,
                      index_size=len(entries) // ENTRY.size)
    out.append(trailer.pack())
    os.fsync(out.fd)
    return "sha256:" + out.hasher.hexdigest()
