"""The block server's open sealed layers: each digest opened once and shared by every stack
over it, found on this node (layers/), in a posix_fs repository (read in place) or in a
remote one (read lazily through the chunk cache); closed when no stack uses it and no
compaction is copying it."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable

from .blob import Blob, FileBlob
from .cache import ChunkCache
from .collect import counted
from .errors import LayerNotFoundError
from .lsmt import SealedLayer
from .repository import Repository
from .statedir import StateDir


class OpenLayers:
    def __init__(self, state: StateDir, repository: Repository | None,
                 cache: ChunkCache | None) -> None:
        self.state = state
        self.repository = repository
        self.cache = cache
        self._open: dict[str, SealedLayer] = {}
        self._reading: Counter[str] = Counter()  # layers a compaction copies, kept open

    def __len__(self) -> int:
        return len(self._open)

    def open(self, digest: str) -> SealedLayer:
        """The layer with `digest` (may block: it may be read from the repository)."""
        if digest in self._open:
            return self._open[digest]
        blob: Blob
        local = self.state.layer_path(digest)
        if local.exists():
            blob = FileBlob(local)
        elif self.repository is None:
            raise LayerNotFoundError(f"layer {digest} not on this node and no repository")
        elif (path := self.repository.local_path(digest)) is not None:
            blob = FileBlob(path)
        elif self.cache is not None:
            blob = self.cache.blob(self.repository, digest)
        else:
            raise LayerNotFoundError(f"layer {digest}: remote repository needs a cache dir")
        try:
            layer = SealedLayer.open(blob, digest=digest, name=f"layer {digest}")
        except BaseException:
            blob.close()
            raise
        self._open[digest] = layer
        return layer

    def adopt(self, layer: SealedLayer) -> SealedLayer:
        """Keep a layer just made (sealed, merged) open; when one with its digest already
        is (identical content), that one is shared and the new one closed."""
        assert layer.digest is not None
        if (same := self._open.get(layer.digest)) is not None and same is not layer:
            layer.close()
            return same
        self._open[layer.digest] = layer
        return layer

    def reading(self, digests: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        """Keep `digests` open while the block runs (a compaction copying them)."""
        return counted(self._reading, digests)

    def pinned(self) -> set[str]:
        return set(self._reading)

    def release_unused(self, used: set[str]) -> None:
        """Close every layer not in `used` and not being read."""
        keep = used | set(self._reading)
        for digest in [d for d in self._open if d not in keep]:
            self._open.pop(digest).close()

    def close_all(self) -> None:
        for layer in self._open.values():
            layer.close()
        self._open.clear()
