"""The node-local run cache: repository layers fetched lazily in chunks into a bounded dir.

Each chunk (1 MiB by default) is one file `<root>/<hex>/<index>`, written to a temp name
and renamed, so a chunk file is always whole. An LRU of chunks is trimmed from the high to
the low watermark whenever the cache grows past the high one. Readers hold an open fd on
each chunk they use, so evicting (unlinking) a chunk under a reader is harmless; the next
read of that chunk fetches it again.

A fetched chunk is checked against the layer's chunk sums (integrity.py) before it is
written: a mismatch is fetched once more, then the read fails (IntegrityError, EIO to the
guest) and nothing enters the cache. Layers uploaded before sums were recorded have none:
their chunks are read unchecked (logged once per layer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .errors import IntegrityError, RepositoryError
from .integrity import ChunkSums, retry_once
from .repository import Repository, digest_hex

log = logging.getLogger(__name__)

CHUNK = 1 << 20


@dataclass
class CacheStats:
    hits: int = 0    # lookups served from the cache
    misses: int = 0  # lookups that fetched their chunk (not also counted as hits)
    evictions: int = 0
    fetched_bytes: int = 0
    corrupt: int = 0  # fetched chunks that did not match their sums (not kept)


class ChunkCache:
    """A bounded chunk cache shared by every remote layer on the node."""

    def __init__(self, root: str | os.PathLike[str], *, capacity_bytes: int,
                 high: float = 0.95, low: float = 0.70, chunk_size: int = CHUNK) -> None:
        if not 0 < low < high <= 1:
            raise ValueError("need 0 < low < high <= 1")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.high = high
        self.low = low
        self.chunk_size = chunk_size
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._fetching: dict[tuple[str, int], threading.Lock] = {}
        self.used_bytes = 0
        self._scan()

    def _scan(self) -> None:
        found = []
        for d in self.root.iterdir():
            if not d.is_dir():
                continue
            for f in d.iterdir():
                if f.name.startswith(".tmp"):
                    f.unlink(missing_ok=True)
                elif f.name.isdigit():
                    st = f.stat()
                    found.append((st.st_mtime, (d.name, int(f.name)), st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self.used_bytes += size

    def _path(self, key: tuple[str, int]) -> Path:
        return self.root / key[0] / str(key[1])

    def blob(self, repo: Repository, digest: str, size: int | None = None) -> CachedBlob:
        size = repo.layer_size(digest) if size is None else size
        sums = repo.layer_sums(digest)
        if sums is None:
            log.warning("layer %s has no chunk sums in the repository (uploaded before they "
                        "were recorded): its chunks are not checked", digest)
        elif sums.size != size or self.chunk_size % sums.block:
            raise RepositoryError(f"layer {digest}: its chunk sums ({sums.size} bytes in "
                                  f"{sums.block}-byte blocks) do not fit the layer ({size} "
                                  f"bytes) or the cache's {self.chunk_size}-byte chunks")
        return CachedBlob(self, repo, digest, size, sums)

    def has(self, key: tuple[str, int]) -> bool:
        with self._lock:
            return key in self._lru

    def open_chunk(self, repo: Repository, digest: str, idx: int, length: int,
                   sums: ChunkSums | None = None) -> int:
        """An O_RDONLY fd on chunk `idx` of the layer, fetched first if absent (and checked
        against `sums`)."""
        key = (digest_hex(digest), idx)
        fetched = False
        while True:
            with self._lock:
                if key in self._lru:
                    try:
                        fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        self.used_bytes -= self._lru.pop(key)
                    else:
                        self._lru.move_to_end(key)
                        if not fetched:
                            self.stats.hits += 1
                        return fd
                fetch_lock = self._fetching.setdefault(key, threading.Lock())
            try:
                with fetch_lock:  # one fetch per chunk; the others wait and then hit
                    with self._lock:
                        present = key in self._lru
                    if not present:
                        self._fetch(repo, digest, key, length, sums)
                        fetched = True
            finally:  # also when the fetch failed: the next reader tries again
                with self._lock:
                    self._fetching.pop(key, None)

    def _fetch(self, repo: Repository, digest: str, key: tuple[str, int], length: int,
               sums: ChunkSums | None) -> None:
        offset = key[1] * self.chunk_size

        def attempt() -> bytes:
            data = repo.read_layer(digest, offset, length)
            if len(data) != length:
                raise RepositoryError(f"layer {digest}: short chunk {key[1]} "
                                      f"({len(data)}/{length})")
            if sums is not None:
                try:
                    sums.check(offset, data)
                except IntegrityError:
                    with self._lock:
                        self.stats.corrupt += 1
                    raise
            return data

        data = retry_once(f"layer {digest} chunk {key[1]}", attempt)
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".tmp-{key[1]}-{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        with self._lock:
            self.stats.misses += 1
            self.stats.fetched_bytes += length
            self._lru[key] = length
            self.used_bytes += length
            if self.used_bytes > self.high * self.capacity_bytes:
                self._evict_locked()

    def _evict_locked(self) -> None:
        target = self.low * self.capacity_bytes
        while self._lru and self.used_bytes > target:
            key, size = self._lru.popitem(last=False)
            self.used_bytes -= size
            self.stats.evictions += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(key))


class CachedBlob:
    """A repository layer read through the chunk cache (Blob protocol)."""

    def __init__(self, cache: ChunkCache, repo: Repository, digest: str, size: int,
                 sums: ChunkSums | None = None) -> None:
        self.cache = cache
        self.repo = repo
        self.digest = digest
        self.size = size
        self.sums = sums
        self.path = f"{digest} (cached)"
        self._hex = digest_hex(digest)

    def _chunks(self, offset: int, length: int):  # type: ignore[no-untyped-def]
        cs = self.cache.chunk_size
        pos, end = offset, offset + length
        while pos < end:
            idx = pos // cs
            clen = min(cs, self.size - idx * cs)
            n = min(end, idx * cs + clen) - pos
            if n <= 0:
                raise EOFError(f"{self.digest}: read past end at {pos}")
            yield idx, clen, pos - idx * cs, n
            pos += n

    def pread(self, offset: int, length: int) -> bytes:
        parts = []
        for idx, clen, off, n in self._chunks(offset, length):
            fd = self.cache.open_chunk(self.repo, self.digest, idx, clen, self.sums)
            try:
                parts.append(os.pread(fd, n, off))
            finally:
                os.close(fd)
        return b"".join(parts)

    def pieces(self, offset: int, length: int) -> list[tuple[int, int, int, bool]]:
        out: list[tuple[int, int, int, bool]] = []
        try:
            for idx, clen, off, n in self._chunks(offset, length):
                out.append((self.cache.open_chunk(self.repo, self.digest, idx, clen,
                                                  self.sums), off, n, True))
        except BaseException:
            for fd, *_ in out:
                os.close(fd)
            raise
        return out

    def is_local(self, offset: int, length: int) -> bool:
        return all(self.cache.has((self._hex, idx)) for idx, *_ in self._chunks(offset, length))

    def close(self) -> None:
        pass
