"""Collection of sealed layers nothing needs any more: the block server's side.

The runtime knows what is referenced (every layer a repository document names, what starts
are about to use: `host/runtime/collect.py`); the block server knows what its stacks hold
open. A layer file goes when neither names it and it is older than a grace period: a layer
just sealed or imported is named by no document until its snapshot's manifest is written
(a pause writes it after the seal), so age is what keeps in-flight work safe from a
collection that listed the documents a moment before.

With `repository`, the repository's copies go by the same rule; the runtime asks for that
only where this node owns the repository (the default posix_fs one under its state dir,
whose layers are hard links of the local ones): in a shared repository another node's
stacks may read a layer no document names any more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LAYER_SUFFIX = ".lsmt"
# what a crashed import or seal leaves next to the layers (`.tmp` of import_layer)
PARTIAL_SUFFIXES = (".tmp",)


def layer_hex(digest: str) -> str:
    """A digest's hex part, the layer files' stem (`sha256:<hex>` or `<hex>`). Lenient,
    unlike the repository's `digest_hex`: a keep set holds whatever documents name, and a
    malformed entry must not stop a collection."""
    return digest.split(":", 1)[-1]


@dataclass
class Swept:
    """What one collection removed (or, in a dry run, would remove) from one place.
    `bytes` counts a file's bytes when its last link goes, across the sweeps sharing
    `links`: a posix_fs repository's layer is a hard link of the local one, so removing
    the local one alone frees nothing."""

    files: int = 0
    bytes: int = 0
    digests: list[str] = field(default_factory=list)
    # (dev, inode) -> [links removed by this collection, links it had when first seen]
    links: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    def add(self, digest: str, st: os.stat_result) -> None:
        self.files += 1
        self.digests.append(digest)
        seen = self.links.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink])
        seen[0] += 1
        if seen[0] == seen[1]:
            self.bytes += st.st_blocks * 512

    def add_bytes(self, digest: str, n: int) -> None:
        """A removal whose freed bytes the caller knows (an object store's)."""
        self.files += 1
        self.digests.append(digest)
        self.bytes += n

    def merge(self, other: Swept) -> None:
        """Add what another sweep of the same kind removed."""
        self.files += other.files
        self.bytes += other.bytes
        self.digests += other.digests

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "bytes": self.bytes, "digests": self.digests}


def _candidates(layer_dir: Path) -> Iterator[tuple[str, Path, os.stat_result]]:
    if not layer_dir.is_dir():
        return
    for entry in os.scandir(layer_dir):
        name = entry.name
        if name.endswith(LAYER_SUFFIX):
            stem = name[:-len(LAYER_SUFFIX)]
        elif name.endswith(PARTIAL_SUFFIXES):
            stem = ""  # never referenced: only its age protects it
        else:
            continue
        try:
            yield stem, Path(entry.path), entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue


def sweep_layers(layer_dir: Path, keep: Iterable[str], *, min_age_s: float,
                 dry_run: bool, links: dict[tuple[int, int], list[int]] | None = None,
                 now: float | None = None,
                 first: Callable[[str, os.stat_result], None] | None = None) -> Swept:
    """Remove `layer_dir/<hex>.lsmt` files whose digest `keep` does not name and whose
    mtime is older than `min_age_s`, and partial files as old; returns what went.
    `first(hex, stat)` runs before a layer file goes (the repository's copy of a layer
    this node made: removed first, so a crash between the two leaves the local file, and
    with it the next collection's knowledge that the copy was this node's); if it
    raises, the file stays."""
    kept = {layer_hex(d) for d in keep}
    cutoff = (time.time() if now is None else now) - min_age_s
    out = Swept(links={} if links is None else links)
    for stem, path, st in _candidates(layer_dir):
        if (stem and stem in kept) or st.st_mtime > cutoff:
            continue
        if not dry_run:
            try:
                if stem and first is not None:
                    first(stem, st)
                path.unlink()
            except FileNotFoundError:
                continue
            except Exception as exc:  # noqa: BLE001 - the next collection tries again
                log.warning("layer %s kept: its repository copy could not go: %s", stem, exc)
                continue
        out.add(stem or path.name, st)
    return out


def layer_bytes(layer_dir: Path) -> int:
    """Bytes on disk of the sealed layers in `layer_dir`."""
    return sum(st.st_blocks * 512 for stem, _, st in _candidates(layer_dir) if stem)


@contextlib.contextmanager
def counted(pins: Counter[str], keys: Iterable[str]) -> Iterator[None]:
    """Count `keys` in `pins` while the block runs, on every way out taken back (a key
    leaves `pins` when its count reaches 0): starts' pins of memory dirs and layers,
    compactions' of the layers they copy."""
    held = set(keys)
    pins.update(held)
    try:
        yield
    finally:
        pins.subtract(held)
        for key in held:
            if pins[key] <= 0:
                del pins[key]
