"""`pull()`: resolve a reference, fetch the image into the OCI cache, read it back checked.

    1. resolve  parse the reference; a digest reference already in the cache needs no
                network at all. Otherwise `skopeo inspect --raw` fetches the manifest or
                index (its sha256 checked against a pinned digest); from an index the
                entry for the node's platform is picked and fetched by digest. Layer
                media types are checked before anything is downloaded.
    2. download `skopeo copy docker://REPO@<manifest digest> oci:<tmp layout>` with the
                shared blob dir: blobs already cached are not fetched again. Progress
                comes from skopeo's "Copying blob" lines and from blobs landing in the
                cache; the layout is then renamed to `images/<digest hex>/`.
    3. verify   manifest, config and every layer are checked against their digests while
                they are read (`layout.read_image`); a corrupt cached blob is removed
                and the copy done once more.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .blobs import blob_path, read_blob, sha256_digest, write_blob
from .errors import ImageCorrupt, UnsupportedImage
from .layout import (
    Image,
    check_layers,
    manifest_kind,
    parse_json,
    read_image,
    select_platform,
)
from .reference import Reference, parse_reference
from .registry import Credentials, RegistryConfig, Source, resolve_source
from .skopeo import CopyLine, Skopeo

POLL_S = 0.2
STALE_TMP_S = 24 * 3600


@dataclass(frozen=True)
class PullProgress:
    """One progress report. `phase`: "resolve" | "download" | "verify" | "done".
    Counts cover the layer blobs of the platform manifest (0 until it is known); `digest`
    is the blob the event is about, `message` a line fit for a build log."""

    reference: str
    phase: str
    blobs_done: int = 0
    blobs_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    digest: str | None = None
    message: str = ""


ProgressCallback = Callable[[PullProgress], None]


async def pull(reference: str, config: RegistryConfig, *,
               credentials: Credentials | None = None,
               progress: ProgressCallback | None = None,
               verify_layers: bool = True) -> Image:
    """Pull `reference` for `config`'s platform into `config.cache_dir`; returns the image
    with its layers' digests, diff ids and chain ids. Raises an ImageError subclass:
    ImageReferenceError, ImageNotFound, RegistryAuthError, RegistryUnavailable,
    UnsupportedImage or ImageCorrupt. Cancelling it kills skopeo and leaves only complete
    blobs behind. `progress` is called on the event loop and must not block."""
    ref = parse_reference(reference)
    source = resolve_source(ref, config)
    job = _Pull(reference, ref, source, config, credentials, progress)
    return await job.run(verify_layers)


class _Pull:
    def __init__(self, reference: str, ref: Reference, source: Source,
                 config: RegistryConfig, credentials: Credentials | None,
                 progress: ProgressCallback | None) -> None:
        self.reference = reference
        self.ref = ref
        self.source = source
        self.config = config
        self.credentials = credentials
        self.progress = progress
        self.skopeo = Skopeo(config)
        self.hub_without_mirror = ref.is_docker_hub and not config.mirror

    def emit(self, phase: str, **kw: Any) -> None:
        if self.progress is not None:
            self.progress(PullProgress(self.reference, phase, **kw))

    async def run(self, verify_layers: bool) -> Image:
        await asyncio.to_thread(self._prepare_dirs)
        via = f" via mirror {self.source.registry}" if self.source.via_mirror else ""
        self.emit("resolve", message=f"resolving {self.ref}{via}")
        if self.ref.digest is not None:
            cached = await asyncio.to_thread(self._cached_by_digest, self.ref.digest,
                                             verify_layers)
            if cached is not None:
                self.emit("done", **_totals(cached),
                          message=f"{self.ref} is in the cache ({cached.digest})")
                return cached
        digest, index_digest, manifest = await self._resolve()
        image_dir = self.config.images_dir / digest.split(":", 1)[1]
        try:
            image = await self._fetch(digest, index_digest, manifest, image_dir, verify_layers)
        except ImageCorrupt as exc:
            # a damaged cache entry: drop it and fetch it again, once
            await asyncio.to_thread(_discard, image_dir, exc.path)
            image = await self._fetch(digest, index_digest, manifest, image_dir, verify_layers)
        if (image.os, image.architecture) != (self.config.os, self.config.arch):
            raise UnsupportedImage(
                f"image {self.reference!r} is for {image.os}/{image.architecture}, "
                f"this node imports {self.config.os}/{self.config.arch}")
        image = replace(image, reference=self.reference, name=str(self.ref))
        n = len(image.layers)
        self.emit("done", **_totals(image), message=f"pulled {self.ref} ({image.digest}, "
                  f"{n} layer{'' if n == 1 else 's'}, {image.size} bytes)")
        return image

    async def _fetch(self, digest: str, index_digest: str | None, manifest: dict[str, Any],
                     image_dir: Path, verify_layers: bool) -> Image:
        if not image_dir.exists():
            await self._download(digest, index_digest, manifest, image_dir)
        layers = manifest["layers"]
        size = sum(int(d.get("size", 0)) for d in layers)
        self.emit("verify", blobs_done=len(layers), blobs_total=len(layers), bytes_done=size,
                  bytes_total=size, message=f"verifying {digest}")
        return await asyncio.to_thread(read_image, image_dir, self.config.blobs_dir,
                                       verify_layers=verify_layers)

    def _prepare_dirs(self) -> None:
        for d in (self.config.blobs_dir / "sha256", self.config.images_dir,
                  self.config.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        # leftovers of pulls that died with the service
        now = time.time()
        for entry in self.config.tmp_dir.iterdir():
            try:
                if now - entry.lstat().st_mtime > STALE_TMP_S:
                    shutil.rmtree(entry, ignore_errors=True)
            except FileNotFoundError:
                continue

    def _cached_by_digest(self, digest: str, verify_layers: bool) -> Image | None:
        """The image a digest reference names, when the cache has all of it."""
        blobs = self.config.blobs_dir
        if not blob_path(blobs, digest).exists():
            return None
        try:
            doc = parse_json(read_blob(blobs, digest, what="manifest"), f"{self.ref}")
            index_digest = None
            if manifest_kind(doc, f"image {self.reference!r}") == "index":
                index_digest = digest
                desc = select_platform(doc, os=self.config.os, arch=self.config.arch,
                                       variant=self.config.variant,
                                       what=f"image {self.reference!r}")
                digest = str(desc.get("digest"))
            image_dir = self.config.images_dir / digest.split(":", 1)[1]
            if not image_dir.exists():
                return None
            image = read_image(image_dir, blobs, verify_layers=verify_layers)
        except ImageCorrupt:
            return None  # fetch it again
        if index_digest is not None and image.index_digest is None:
            image = replace(image, index_digest=index_digest)
        return replace(image, reference=self.reference, name=str(self.ref))

    async def _inspect(self, tag_or_digest: str) -> bytes:
        return await self.skopeo.inspect_raw(
            self.source, tag_or_digest, reference=self.reference,
            credentials=self.credentials, hub_without_mirror=self.hub_without_mirror)

    async def _resolve(self) -> tuple[str, str | None, dict[str, Any]]:
        """(platform manifest digest, index digest or None, manifest) at the registry."""
        what = f"image {self.reference!r}"
        wanted = self.ref.digest or self.ref.tag or "latest"
        raw = await self._inspect(wanted)
        top = sha256_digest(raw)
        if self.ref.digest is not None and top != self.ref.digest:
            raise ImageCorrupt(f"{self.source.registry} served {top} for {self.ref.digest}")
        doc = parse_json(raw, f"manifest of {what}")
        index_digest: str | None = None
        if manifest_kind(doc, what) == "index":
            index_digest = top
            await asyncio.to_thread(write_blob, self.config.blobs_dir, raw)
            desc = select_platform(doc, os=self.config.os, arch=self.config.arch,
                                   variant=self.config.variant, what=what)
            digest = str(desc.get("digest"))
            raw = await self._inspect(digest)
            if sha256_digest(raw) != digest:
                raise ImageCorrupt(f"{self.source.registry} served {sha256_digest(raw)} "
                                   f"for {digest}")
            doc = parse_json(raw, f"manifest of {what}")
            if manifest_kind(doc, what) != "manifest":
                raise UnsupportedImage(f"{what}: nested image indexes are not supported")
        else:
            digest = top
        check_layers(doc, what)
        # the registry's own form of the manifest, so `name@digest` resolves offline later
        await asyncio.to_thread(write_blob, self.config.blobs_dir, raw)
        return digest, index_digest, doc

    async def _download(self, digest: str, index_digest: str | None,
                        manifest: dict[str, Any], image_dir: Path) -> None:
        layers = manifest["layers"]
        tracker = _Tracker(self, {str(b["digest"]): int(b.get("size", 0)) for b in layers})
        tmp = self.config.tmp_dir / f"pull-{digest[7:19]}-{secrets.token_hex(4)}"
        try:
            tracker.poll(report=False)
            tracker.report("download", None, f"downloading {digest}: {len(layers)} layers, "
                           f"{tracker.done_count} already cached")
            async with asyncio.TaskGroup() as tg:
                poller = tg.create_task(tracker.poll_forever())
                try:
                    await self.skopeo.copy(
                        self.source, digest, tmp, reference=self.reference,
                        credentials=self.credentials,
                        hub_without_mirror=self.hub_without_mirror, on_line=tracker.on_line)
                finally:
                    poller.cancel()
            tracker.poll()
            meta = {"reference": self.reference, "name": str(self.ref),
                    "source": f"{self.source.registry}/{self.source.repository}",
                    "digest": digest, "index_digest": index_digest,
                    "pulled_at": int(time.time())}
            await asyncio.to_thread(_install, tmp, image_dir, meta)
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)


class _Tracker:
    """Turns skopeo's lines and blobs appearing in the cache into PullProgress events."""

    def __init__(self, job: _Pull, sizes: dict[str, int]) -> None:
        self.job = job
        self.sizes = sizes
        self.done: set[str] = set()

    @property
    def done_count(self) -> int:
        return len(self.done)

    def report(self, phase: str, digest: str | None, message: str) -> None:
        self.job.emit(phase, blobs_done=len(self.done), blobs_total=len(self.sizes),
                      bytes_done=sum(self.sizes[d] for d in self.done),
                      bytes_total=sum(self.sizes.values()), digest=digest, message=message)

    def on_line(self, line: CopyLine) -> None:
        verb = "cached" if line.skipped else "copying"
        self.report("download", line.digest, f"{verb} {line.kind} {line.digest}")

    def poll(self, *, report: bool = True) -> None:
        blobs = self.job.config.blobs_dir
        for digest in self.sizes:
            if digest not in self.done and blob_path(blobs, digest).exists():
                self.done.add(digest)
                if report:
                    self.report("download", digest, f"have layer {digest}")

    async def poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            self.poll()


def _totals(image: Image) -> dict[str, int]:
    n = len(image.layers)
    return {"blobs_done": n, "blobs_total": n, "bytes_done": image.size,
            "bytes_total": image.size}


def _install(tmp: Path, image_dir: Path, meta: dict[str, Any]) -> None:
    """Finish the layout in `tmp` and rename it to `image_dir` (a concurrent pull of the
    same digest may have won the race: then its copy stays)."""
    (tmp / "pulled.json").write_text(json.dumps(meta, indent=1))
    try:
        os.rename(tmp, image_dir)
    except OSError:
        if not image_dir.exists():
            raise


def _discard(image_dir: Path, path: Path | None) -> None:
    shutil.rmtree(image_dir, ignore_errors=True)
    if path is not None:
        path.unlink(missing_ok=True)


