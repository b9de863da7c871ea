"""Compaction: several sealed layers of a stack written as one, with the same content.

A sandbox paused and resumed many times seals a layer at each pause; its stack (and every
manifest naming it) would grow without bound, and so would the files a restore opens and
the data the collector can never free (overwritten blocks of old layers). Merging the
sandbox's own layers into one keeps the chain short. Only a contiguous run at the top of
the sealed layers is merged: the layers below it (a template's, a fork source's) are
shared with other stacks and are never copied.

The merged layer maps exactly what the run maps, newest first: data extents are copied,
zeroed extents stay zeroed (they hide the layers below the run), unmapped sectors stay
unmapped (they fall through to the layers below). It gets the run's top uuid, so the
upper above it keeps a valid parent.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .index import ZERO
from .lsmt import SECTOR, LayerWriter, SealedLayer
from .stack import merge_layers

CHUNK = 4 << 20  # bytes copied per read: bounded memory whatever the extent's size


def write_merged(run: list[SealedLayer], path: Path) -> str:
    """Write the layers `run` (bottom first) as one sealed layer at `path`; its digest.
    The file is complete and fsynced when this returns; a failure removes it."""
    if not run:
        raise ValueError("nothing to merge")
    top = run[-1]
    writer = LayerWriter(path, top.virtual_size, uuid=top.uuid,
                         parent_uuid=run[0].trailer.parent_uuid)
    try:
        for ext in merge_layers(run):
            start, length = ext.start * SECTOR, (ext.end - ext.start) * SECTOR
            if ext.tag == ZERO:
                writer.zero(start, length)
                continue
            blob = run[ext.tag].blob
            for at in range(0, length, CHUNK):
                n = min(CHUNK, length - at)
                writer.write(start + at, blob.pread(ext.moff * SECTOR + at, n))
        return writer.finish()
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(writer.fd)
        path.unlink(missing_ok=True)
        raise
