"""What an image is once pulled: `Image`, `ImageConfig`, `Layer`, read from the OCI cache.

Manifests, indexes and configs are parsed here with their media types checked; layer
chain ids follow the OCI image spec:

    chainID(L0) = diffID(L0)
    chainID(Ln) = sha256(chainID(Ln-1) + " " + diffID(Ln))

so two images whose first n layers have the same diff ids share their first n chain ids
(the key of the block layers the runtime builds from them). `open_layer()` gives the
runtime a layer as the guest's apply.py takes it (plain tar or gzip; zstd decompressed
here with `zstandard`), checking the blob digest as it is read.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .blobs import CHUNK, VerifyingReader, blob_path, read_blob, verify_blob
from .errors import ImageCorrupt, UnsupportedImage

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_SCHEMA1 = "application/vnd.docker.distribution.manifest.v1+json"

INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
CONFIG_TYPES = frozenset({OCI_CONFIG, DOCKER_CONFIG})
LAYER_COMPRESSION = {
    "application/vnd.oci.image.layer.v1.tar": "none",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
}


@dataclass(frozen=True)
class Layer:
    """One layer blob of an image, bottom first."""

    digest: str          # of the blob as stored (compressed)
    media_type: str
    compression: str     # "none" | "gzip" | "zstd"
    size: int
    diff_id: str         # sha256 of the uncompressed tar (from the config)
    chain_id: str        # identity of this layer and all below it
    path: Path           # the blob in the cache


@dataclass(frozen=True)
class ImageConfig:
    """The runtime part of an image config (`config` in the OCI image config)."""

    env: tuple[str, ...] = ()            # "KEY=value", in order
    working_dir: str = ""                # "" means "/"
    user: str = ""                       # "" means root; may be "uid[:gid]" or "name[:group]"
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    exposed_ports: tuple[str, ...] = ()  # "8080/tcp"
    labels: dict[str, str] = field(default_factory=dict)
    stop_signal: str = ""

    def env_map(self) -> dict[str, str]:
        """`env` as a dict (a later duplicate wins, as in Docker)."""
        out: dict[str, str] = {}
        for item in self.env:
            key, _, value = item.partition("=")
            if key:
                out[key] = value
        return out


@dataclass(frozen=True)
class Image:
    """A pulled image for one platform, ready to import."""

    reference: str           # as given, e.g. "busybox"
    name: str                # normalised, e.g. "docker.io/library/busybox:latest"
    source: str              # what was contacted, e.g. "127.0.0.1:5000/library/busybox"
    digest: str              # the platform manifest's digest at the registry
    index_digest: str | None  # the index it was picked from, if any
    manifest_digest: str     # the manifest as stored in the cache (differs from `digest`
    #                          when skopeo converted a Docker v2 manifest to OCI)
    config_digest: str
    os: str
    architecture: str
    config: ImageConfig
    layers: tuple[Layer, ...]
    layout: Path             # OCI layout dir (its blobs in the shared blob dir)

    @property
    def chain_id(self) -> str | None:
        """Chain id of the top layer (None for an image without layers)."""
        return self.layers[-1].chain_id if self.layers else None

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """The OCI chain id of each layer, given the diff ids bottom first."""
    out: list[str] = []
    for diff_id in diff_ids:
        if not out:
            out.append(diff_id)
        else:
            out.append("sha256:" + hashlib.sha256(
                f"{out[-1]} {diff_id}".encode()).hexdigest())
    return out


def parse_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ImageCorrupt(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ImageCorrupt(f"{what} is not a JSON object")
    return doc


def manifest_kind(doc: dict[str, Any], what: str) -> str:
    """"index" or "manifest"; UnsupportedImage for schema 1 and non-image artifacts."""
    media_type = doc.get("mediaType")
    if doc.get("schemaVersion") == 1 or media_type == DOCKER_SCHEMA1:
        raise UnsupportedImage(f"{what} is a Docker schema 1 manifest (deprecated); "
                               "push it again with a current Docker or skopeo")
    if media_type in INDEX_TYPES or (media_type is None and "manifests" in doc):
        return "index"
    if media_type in MANIFEST_TYPES or (media_type is None and "layers" in doc):
        return "manifest"
    raise UnsupportedImage(f"{what} has unsupported media type {media_type!r}")


def select_platform(index: dict[str, Any], *, os: str, arch: str, variant: str | None,
                    what: str) -> dict[str, Any]:
    """The descriptor of the first index entry for os/arch[/variant]."""
    seen: list[str] = []
    for desc in index.get("manifests") or []:
        if not isinstance(desc, dict):
            continue
        plat = desc.get("platform") or {}
        name = "/".join(str(p) for p in (plat.get("os"), plat.get("architecture"),
                                         plat.get("variant")) if p)
        seen.append(name or "unknown")
        if plat.get("os") != os or plat.get("architecture") != arch:
            continue
        if variant is not None and plat.get("variant") not in (variant, None):
            continue
        if desc.get("mediaType") in INDEX_TYPES:
            continue  # nested indexes: not produced by any common tool
        return desc
    want = f"{os}/{arch}" + (f"/{variant}" if variant else "")
    raise UnsupportedImage(f"{what} has no {want} image (it has: "
                           f"{', '.join(seen) or 'nothing'})")


def check_layers(manifest: dict[str, Any], what: str) -> list[dict[str, Any]]:
    """The manifest's layer descriptors, each of a media type we can apply."""
    layers = manifest.get("layers")
    config = manifest.get("config")
    if not isinstance(layers, list) or not isinstance(config, dict):
        raise ImageCorrupt(f"{what} has no config or layers")
    if config.get("mediaType") not in CONFIG_TYPES:
        raise UnsupportedImage(f"{what} is not a container image (config media type "
                               f"{config.get('mediaType')!r})")
    for desc in layers:
        media_type = desc.get("mediaType") if isinstance(desc, dict) else None
        if media_type not in LAYER_COMPRESSION:
            raise UnsupportedImage(f"{what} has a layer of unsupported media type "
                                   f"{media_type!r}")
    return layers


def read_image(layout: Path, blobs_dir: Path, *, verify_layers: bool = True) -> Image:
    """The image in OCI layout `layout` (written by pull), every blob checked against its
    digest: manifest and config always, layers unless `verify_layers` is False."""
    meta = parse_json(_read(layout / "pulled.json"), f"{layout}/pulled.json")
    index = parse_json(_read(layout / "index.json"), f"{layout}/index.json")
    manifests = index.get("manifests") or []
    if len(manifests) != 1 or not isinstance(manifests[0], dict):
        raise ImageCorrupt(f"{layout}/index.json does not name exactly one manifest")
    desc = manifests[0]
    what = f"image {meta.get('reference')!r}"
    manifest_digest = str(desc.get("digest"))
    manifest = parse_json(read_blob(blobs_dir, manifest_digest, size=desc.get("size"),
                                    what="manifest"), f"manifest of {what}")
    if manifest_kind(manifest, what) != "manifest":
        raise ImageCorrupt(f"{layout} holds an index, not a manifest")
    layer_descs = check_layers(manifest, what)
    config_desc = manifest["config"]
    config_digest = str(config_desc.get("digest"))
    config_doc = parse_json(read_blob(blobs_dir, config_digest, size=config_desc.get("size"),
                                      what="config"), f"config of {what}")
    rootfs = config_doc.get("rootfs") or {}
    diff_ids = rootfs.get("diff_ids") or []
    if len(diff_ids) != len(layer_descs):
        raise ImageCorrupt(f"{what}: config lists {len(diff_ids)} diff ids for "
                           f"{len(layer_descs)} layers")
    layers = []
    for desc_, diff_id, chain_id in zip(layer_descs, diff_ids, chain_ids(diff_ids),
                                        strict=True):
        path = blob_path(blobs_dir, str(desc_.get("digest")))
        size = int(desc_.get("size", -1))
        if verify_layers:
            verify_blob(path, desc_["digest"], size)
        layers.append(Layer(digest=desc_["digest"], media_type=desc_["mediaType"],
                            compression=LAYER_COMPRESSION[desc_["mediaType"]], size=size,
                            diff_id=str(diff_id), chain_id=chain_id, path=path))
    return Image(reference=str(meta.get("reference")), name=str(meta.get("name")),
                 source=str(meta.get("source")), digest=str(meta.get("digest")),
                 index_digest=meta.get("index_digest"), manifest_digest=manifest_digest,
                 config_digest=config_digest, os=str(config_doc.get("os", "")),
                 architecture=str(config_doc.get("architecture", "")),
                 config=parse_config(config_doc), layers=tuple(layers), layout=layout)


def parse_config(doc: dict[str, Any]) -> ImageConfig:
    """The `config` section of an image config document."""
    c = doc.get("config") or {}

    def strings(value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        return tuple(str(v) for v in value)

    return ImageConfig(
        env=strings(c.get("Env")), working_dir=str(c.get("WorkingDir") or ""),
        user=str(c.get("User") or ""), entrypoint=strings(c.get("Entrypoint")),
        cmd=strings(c.get("Cmd")), exposed_ports=tuple(sorted(c.get("ExposedPorts") or {})),
        labels={str(k): str(v) for k, v in (c.get("Labels") or {}).items()},
        stop_signal=str(c.get("StopSignal") or ""))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageCorrupt(f"{path} is missing: not a complete pulled image") from None


@contextmanager
def open_layer(layer: Layer) -> Iterator[IO[bytes]]:
    """Layer `layer` as a plain or gzip tar stream, the form apply.py takes; zstd layers
    are decompressed here. The compressed bytes are checked against the layer digest;
    a mismatch raises ImageCorrupt when the end of the stream is read."""
    raw = VerifyingReader(open(layer.path, "rb"), layer.digest, layer.size)  # noqa: SIM115
    try:
        if layer.compression == "zstd":
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(
                    io.BufferedReader(raw, CHUNK), read_across_frames=True) as plain:
                yield plain
                # drain so the digest check runs even when the reader stopped early
                while not plain.closed and plain.read(CHUNK):
                    pass
        else:
            buffered = io.BufferedReader(raw, CHUNK)
            yield buffered
    finally:
        raw.close()
