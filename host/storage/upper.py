"""A stack's writable upper: an overlaybd LSMT data file plus its index journal.

The data file is a sealed layer's first part (header, appended data; lsmt.py) without
index and trailer; the journal (`index.lsmt`, an LSMT "index file") is a header with
type=index, then 16-byte SegmentMappings appended in write order, later entries winning.
`flush` fsyncs the data first, then the journal entries, so a journal entry never points at
data that is not durable. Sealing appends the upper's own index and a trailer to its data
file (`lsmt.seal_data_file`): O(index), no data copy, and the file becomes a sealed layer.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

from host.durable import fsync_dir

from .appender import Appender
from .errors import LayerFormatError
from .index import ZERO, SegmentIndex
from .lsmt import (
    DATA_FILE,
    ENTRY,
    JOURNAL_FILE,
    MAX_LENGTH,
    SECTOR,
    SPACE,
    HeaderTrailer,
    new_uuid,
    pack_entry,
    seal_data_file,
    unpack_entries,
)


class Upper:
    """The writable top layer of a stack: a data file plus an index journal, in one directory.

    Each write appends its data, then its journal entries, to the files at once (no fsync):
    a block server process that dies keeps every write it acknowledged, in the kernel's
    page cache. That matters because a VM's NBD client reconnects and resends what it
    had in flight, a flush included, to the restarted server: had the entries waited in
    memory for the flush, the resent flush would confirm writes that were gone. `flush`
    makes them durable on disk (data first, then the journal); after a host crash an
    unflushed entry may point past the data that reached the disk: `open` drops the
    journal from there, as a disk loses unflushed writes.
    """

    def __init__(self, directory: Path, info: HeaderTrailer, data_fd: int, journal_fd: int,
                 out: Appender, index: SegmentIndex) -> None:
        self.dir = directory
        self.info = info
        self.data_fd = data_fd
        self.journal_fd = journal_fd
        self.out = out
        self.index = index
        self._unsynced = False  # journal entries written since the last flush
        self._journal_pos = os.fstat(journal_fd).st_size
        self.size = out.pos  # Blob protocol: bytes readable

    @property
    def virtual_size(self) -> int:
        return self.info.virtual_size

    @property
    def dirty(self) -> bool:
        return self._unsynced

    @classmethod
    def create(cls, directory: str | os.PathLike[str], virtual_size: int, *,
               parent_uuid: str = "") -> Upper:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=False)
        info = HeaderTrailer(is_header=True, is_data_file=True, sealed=False, index_offset=0,
                             index_size=0, virtual_size=virtual_size, uuid=new_uuid(),
                             parent_uuid=parent_uuid)
        jinfo = replace(info, is_data_file=False, index_offset=SPACE)
        for name, ht in ((DATA_FILE, info), (JOURNAL_FILE, jinfo)):
            with open(d / name, "wb") as f:
                f.write(ht.pack())
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(d)
        return cls.open(d)

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> Upper:
        """Reopen an upper (after a clean stop or a crash): replay the journal."""
        d = Path(directory)
        try:
            data_fd = os.open(d / DATA_FILE, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise LayerFormatError(f"{d}: upper data file missing") from exc
        journal_fd = os.open(d / JOURNAL_FILE, os.O_RDWR | os.O_CLOEXEC)
        try:
            head = os.pread(data_fd, SPACE, 0)
            info = HeaderTrailer.unpack(head, what=f"{d}/{DATA_FILE}: header")
            jhead = HeaderTrailer.unpack(os.pread(journal_fd, SPACE, 0),
                                         what=f"{d}/{JOURNAL_FILE}: header")
            if jhead.is_data_file or jhead.sealed or jhead.index_offset != SPACE:
                raise LayerFormatError(f"{d}/{JOURNAL_FILE}: not an unsealed index file")
            size = os.fstat(data_fd).st_size
            if size % SECTOR:  # a torn unflushed append: pad so appends stay aligned
                os.pwrite(data_fd, bytes(SECTOR - size % SECTOR), size)
                size += SECTOR - size % SECTOR
            jsize = os.fstat(journal_fd).st_size
            jsize_whole = SPACE + (jsize - SPACE) // ENTRY.size * ENTRY.size
            if jsize_whole != jsize:  # torn journal append (crash mid-flush): drop the tail
                os.ftruncate(journal_fd, jsize_whole)
            index = SegmentIndex()
            vsec = info.virtual_size // SECTOR
            raw = os.pread(journal_fd, jsize_whole - SPACE, SPACE)
            for i, (off, length, moff, zeroed) in enumerate(unpack_entries(raw)):
                if off + length > vsec:
                    raise LayerFormatError(f"{d}: journal entry at sector {off} is past the "
                                           f"end of the disk")
                if not zeroed and (moff + length) * SECTOR > size:
                    # unflushed: its data never reached the disk (a host crash); it and
                    # every later entry are dropped, as a disk loses unflushed writes
                    os.ftruncate(journal_fd, SPACE + i * ENTRY.size)
                    break
                index.insert(off, off + length, ZERO if zeroed else 0, 0 if zeroed else moff)
        except BaseException:
            os.close(data_fd)
            os.close(journal_fd)
            raise
        out = Appender(data_fd, size, hashlib.sha256())
        out.overwritten()  # hashed lazily, at the first seal
        return cls(d, info, data_fd, journal_fd, out, index)

    # --- Blob protocol (reads of the upper's own data) ---
    def pread(self, offset: int, length: int) -> bytes:
        return os.pread(self.data_fd, length, offset)

    def pieces(self, offset: int, length: int) -> list[tuple[int, int, int, bool]]:
        return [(self.data_fd, offset, length, False)]

    def is_local(self, offset: int, length: int) -> bool:
        return True

    # --- writes ---
    def write(self, sector: int, data: bytes | bytearray | memoryview) -> list[tuple[int, int, int]]:
        """Append sector-aligned data for `sector`; returns [(start, end, moff)] extents."""
        view = memoryview(data)
        out = []
        entries = []
        step = MAX_LENGTH * SECTOR // 4096 * 4096
        for i in range(0, len(view), step):
            piece = view[i:i + step]
            at = self.out.append(piece) // SECTOR
            n = len(piece) // SECTOR
            s = sector + i // SECTOR
            self.index.insert(s, s + n, 0, at)
            entries.append(pack_entry(s, n, at, False))
            out.append((s, s + n, at))
        self.size = self.out.pos
        self._journal(entries)
        return out

    def overwrite(self, moff: int, data: bytes | bytearray | memoryview) -> None:
        """Rewrite data already appended at data sector `moff` in place (same mapping).

        Overwriting freshly allocated file pages costs far more than appending on ext4, so
        a rewrite of blocks the upper already holds goes in place. Like any unflushed block
        write it may be torn by a crash; flushed data stays intact. It invalidates the
        running digest, which `seal` then recomputes from the file (or takes from a rehash
        made beside the writer: `Appender.rehash_beside`)."""
        at = moff * SECTOR
        if at < SPACE or at + len(data) > self.out.pos:
            raise ValueError("overwrite outside the upper's data")
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self.data_fd, view[done:], at + done)
        self.out.overwritten()

    def zero(self, sector: int, nsectors: int) -> None:
        s, end = sector, sector + nsectors
        entries = []
        while s < end:
            n = min(MAX_LENGTH, end - s)
            entries.append(pack_entry(s, n, 0, True))
            s += n
        self.index.insert(sector, end, ZERO, 0)
        self._journal(entries)

    def _journal(self, entries: list[bytes]) -> None:
        """Append `entries` to the journal file now (durable at the next flush)."""
        raw = b"".join(entries)
        done = 0
        while done < len(raw):
            done += os.pwrite(self.journal_fd, raw[done:], self._journal_pos + done)
        self._journal_pos += len(raw)
        self._unsynced = True

    def flush(self) -> None:
        """Make every write so far durable: data first, then the journal entries."""
        os.fsync(self.data_fd)
        if self._unsynced:
            os.fsync(self.journal_fd)
            self._unsynced = False

    def seal(self, *, user_tag: bytes = b"") -> str:
        """Turn the data file into a sealed layer in place (index + trailer); returns digest.

        The upper must not be written afterwards; reopen DATA_FILE as a SealedLayer."""
        self.flush()
        digest = seal_data_file(self.out, self.index, replace(self.info, user_tag=user_tag))
        self.size = self.out.pos
        return digest

    def close(self) -> None:
        for fd in (self.data_fd, self.journal_fd):
            if fd >= 0:
                os.close(fd)
        self.data_fd = self.journal_fd = -1

