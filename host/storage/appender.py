"""`Appender`: writes a layer's data file at its end while keeping the file's sha256.

A layer is named by the sha256 of its whole file, so sealing needs the digest of
everything appended so far. Appends feed the running hash for free; an in-place
overwrite (an upper rewriting a block it already holds) breaks it, and the next seal
would read the whole file again while the guest is stopped for its snapshot (223 ms for
an upper of 200 MiB, most of a live snapshot). `rehash_beside` recomputes the hash from a
private descriptor while the writer goes on, without its lock, and `adopt` installs the
result under the lock if no overwrite came since: a snapshot starts it before it stops
the guest, and the seal then only hashes what was appended meanwhile.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from .errors import LayerFormatError

CHUNK = 1 << 22


@dataclass(frozen=True)
class Rehashed:
    """The sha256 of bytes [0, end) of an appender's file, as of its `generation`."""

    out: Appender
    generation: int
    end: int
    hasher: hashlib._Hash


def _hash_range(fd: int, h: hashlib._Hash, start: int, end: int,
                stop: Callable[[], bool] = lambda: False) -> bool:
    """Feed bytes [start, end) of `fd` to `h`; False if `stop()` said so or the file
    ended early."""
    pos = start
    while pos < end:
        if stop():
            return False
        chunk = os.pread(fd, min(CHUNK, end - pos), pos)
        if not chunk:
            return False
        h.update(chunk)  # hashlib drops the GIL for large buffers: the writer goes on
        pos += len(chunk)
    return True


class Appender:
    """Appends to a file at its end while keeping the file's running sha256.

    Calls that change the file (`append`, `overwritten`, `digest_state`, `adopt`) are made
    by one writer at a time (the stack's lock); `rehash_beside` may run in another thread
    meanwhile."""

    def __init__(self, fd: int, pos: int, hasher: hashlib._Hash) -> None:
        self.fd = fd
        self.pos = pos
        self.hasher = hasher
        self.hasher_stale = False  # set by in-place overwrites: rehash before use
        self.generation = 0  # in-place overwrites so far: a rehash that saw one is void

    def overwritten(self) -> None:
        """Bytes below `pos` were rewritten in place: the running hash is void."""
        self.hasher_stale = True
        self.generation += 1

    def digest_state(self) -> hashlib._Hash:
        """The running sha256 of bytes [0, pos), recomputed if something was overwritten."""
        if self.hasher_stale:
            h = hashlib.sha256()
            if not _hash_range(self.fd, h, 0, self.pos):
                raise LayerFormatError("data file shrank under the upper")
            self.hasher = h
            self.hasher_stale = False
        return self.hasher

    def append(self, data: bytes | bytearray | memoryview) -> int:
        at = self.pos
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], at + done)
        if not self.hasher_stale:
            self.hasher.update(view)
        self.pos += len(view)
        return at

    def rehash_beside(self, stop: Callable[[], bool] = lambda: False) -> Rehashed | None:
        """Hash the file as it is now from a descriptor of its own, while the writer goes
        on (any thread, no lock). None when the hash is not stale, the file is closed, or
        an overwrite (or `stop()`) came first: the bytes read may be torn."""
        gen, end = self.generation, self.pos
        if not self.hasher_stale:
            return None
        try:
            fd = os.dup(self.fd)  # the writer may close its own; ours stays this file
        except OSError:
            return None
        try:
            h = hashlib.sha256()
            if not _hash_range(fd, h, 0, end, lambda: stop() or self.generation != gen):
                return None
        finally:
            os.close(fd)
        return Rehashed(self, gen, end, h)

    def holds(self, done: Rehashed | None) -> bool:
        """Whether `done` is a rehash of this file that no overwrite has voided since."""
        return done is not None and done.out is self and done.generation == self.generation

    def adopt(self, done: Rehashed | None) -> bool:
        """Take a `rehash_beside` result (as the writer): it holds while no overwrite came
        after it started; the bytes appended since are hashed now."""
        if not self.hasher_stale or not self.holds(done):
            return False
        assert done is not None
        h = done.hasher.copy()
        if not _hash_range(self.fd, h, done.end, self.pos):
            return False
        self.hasher = h
        self.hasher_stale = False
        return True
