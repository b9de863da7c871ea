"""Image -> LSMT layers in the repository, cached by the ext4 images' digests."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from host.storage.control import BlockServerClient
from host.storage.convert import convert_image
from host.storage.errors import StorageError
from host.vmm.image import GuestImage

_lock = asyncio.Lock()


def _image_layers(image: GuestImage) -> list[tuple[str, Path, Path | None]]:
    """(cache key, ext4 image, base image or None), bottom first: the first manifest layer
    (base.ext4) whole, then the bootable rootfs as a delta over it."""
    m = image.manifest
    layers = m.get("layers") or []
    rootfs_digest = str(m.get("rootfs", {}).get("digest") or "")
    if layers and Path(layers[0]["path"]).is_file():
        base = Path(layers[0]["path"])
        base_key = str(layers[0].get("digest") or base)
        return [(base_key, base, None),
                (f"{rootfs_digest or image.rootfs}^{base_key}", image.rootfs, base)]
    return [(rootfs_digest or str(image.rootfs), image.rootfs, None)]


async def image_layers(image: GuestImage, client: BlockServerClient, cache_file: Path) -> list[str]:
    """LSMT layer digests (bottom first) for `image`, converting and importing the ext4
    images the first time (minutes for a 4 GiB sparse image; cached in `cache_file`)."""
    async with _lock:
        cache: dict[str, Any] = {}
        if cache_file.is_file():
            cache = json.loads(cache_file.read_text())
        out: list[str] = []
        for key, src, base in _image_layers(image):
            digest = cache.get(key)
            if digest is not None:
                # cached for this state dir; make sure this repository has it too (the
                # node may have been pointed at another one): a stat or a HEAD when it does
                try:
                    await client.push(digest)
                except StorageError:  # neither here nor there any more: convert again
                    digest = None
            if digest is None:
                with tempfile.TemporaryDirectory(dir=cache_file.parent,
                                                 prefix=".convert-") as tmp:
                    dest = Path(tmp) / "layer.lsmt"
                    await asyncio.to_thread(convert_image, src, dest, base=base)
                    digest = await client.import_layer(dest, upload=True)
                cache[key] = digest
                tmpf = cache_file.with_suffix(".tmp")
                tmpf.write_text(json.dumps(cache, indent=1))
                os.replace(tmpf, cache_file)
            out.append(str(digest))
        return out
