"""Test helpers: layer tars built with `tarfile`, and OCI image layouts written by hand
(blobs, manifests, indexes, index.json), pushed to a test registry with skopeo."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA = {"none": OCI_LAYER, "gzip": OCI_LAYER + "+gzip", "zstd": OCI_LAYER + "+zstd"}
BUSYBOX = Path("/bin/busybox")


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class LayerTar:
    """An uncompressed layer tar under construction (PAX format, fixed mtimes)."""

    def __init__(self, mtime: float = 1_700_000_000) -> None:
        self._buf = io.BytesIO()
        self.tar = tarfile.open(  # noqa: SIM115 (closed by bytes())
            fileobj=self._buf, mode="w", format=tarfile.PAX_FORMAT)
        self.mtime = mtime

    def _info(self, name: str, kind: bytes, *, mode: int, uid: int, gid: int,
              mtime: float | None, xattrs: dict[str, bytes] | None) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.mode = mode
        ti.uid, ti.gid = uid, gid
        ti.mtime = self.mtime if mtime is None else mtime
        if xattrs:
            ti.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape")
                              for k, v in xattrs.items()}
        return ti

    def file(self, name: str, data: bytes = b"", *, mode: int = 0o644, uid: int = 0,
             gid: int = 0, mtime: float | None = None,
             xattrs: dict[str, bytes] | None = None) -> LayerTar:
        ti = self._info(name, tarfile.REGTYPE, mode=mode, uid=uid, gid=gid, mtime=mtime,
                        xattrs=xattrs)
        ti.size = len(data)
        self.tar.addfile(ti, io.BytesIO(data))
        return self

    def dir(self, name: str, *, mode: int = 0o755, uid: int = 0, gid: int = 0,
            mtime: float | None = None, xattrs: dict[str, bytes] | None = None) -> LayerTar:
        self.tar.addfile(self._info(name, tarfile.DIRTYPE, mode=mode, uid=uid, gid=gid,
                                    mtime=mtime, xattrs=xattrs))
        return self

    def symlink(self, name: str, target: str, *, uid: int = 0, gid: int = 0) -> LayerTar:
        ti = self._info(name, tarfile.SYMTYPE, mode=0o777, uid=uid, gid=gid, mtime=None,
                        xattrs=None)
        ti.linkname = target
        self.tar.addfile(ti)
        return self

    def hardlink(self, name: str, target: str, *, mode: int = 0o644) -> LayerTar:
        ti = self._info(name, tarfile.LNKTYPE, mode=mode, uid=0, gid=0, mtime=None,
                        xattrs=None)
        ti.linkname = target
        self.tar.addfile(ti)
        return self

    def node(self, name: str, kind: bytes, major: int = 0, minor: int = 0, *,
             mode: int = 0o666) -> LayerTar:
        ti = self._info(name, kind, mode=mode, uid=0, gid=0, mtime=None, xattrs=None)
        ti.devmajor, ti.devminor = major, minor
        self.tar.addfile(ti)
        return self

    def whiteout(self, path: str) -> LayerTar:
        head, _, name = path.rpartition("/")
        return self.file(f"{head}/.wh.{name}" if head else f".wh.{name}")

    def opaque(self, directory: str) -> LayerTar:
        return self.file(f"{directory.rstrip('/')}/.wh..wh..opq")

    def bytes(self) -> bytes:
        self.tar.close()
        return self._buf.getvalue()


def busybox_layer(hostname: bytes = b"busybox\n") -> bytes:
    """/bin/busybox (static) and a symlink per applet: a whole userland, no libc
    (`hostname`, in /etc/hostname: another layer of the same userland)."""
    layer = LayerTar().dir("bin").file("bin/busybox", BUSYBOX.read_bytes(), mode=0o755)
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for applet in sorted(set(applets) - {"busybox"}):
        layer.symlink(f"bin/{applet}", "busybox")
    return layer.dir("etc").file("etc/hostname", hostname).bytes()


def compress(tar: bytes, compression: str) -> bytes:
    if compression == "gzip":
        return gzip.compress(tar, compresslevel=1, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=1).compress(tar)
    return tar


@dataclass
class BuiltImage:
    """A manifest written to a layout: its descriptor, layers and diff ids."""

    manifest: dict[str, Any]
    config_digest: str
    layer_digests: list[str]
    diff_ids: list[str]

    @property
    def digest(self) -> str:
        return str(self.manifest["digest"])


@dataclass
class OciLayout:
    """An OCI image layout directory written by hand."""

    root: Path
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))

    def blob(self, data: bytes, media_type: str) -> dict[str, Any]:
        digest = sha(data)
        (self.root / "blobs" / "sha256" / digest[7:]).write_bytes(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def image(self, layers: list[bytes], *, config: dict[str, Any] | None = None,
              os: str = "linux", arch: str = "amd64", compression: str = "gzip",
              layer_media_type: str | None = None) -> BuiltImage:
        descs = [self.blob(compress(t, compression), layer_media_type or MEDIA[compression])
                 for t in layers]
        diff_ids = [sha(t) for t in layers]
        doc = {"architecture": arch, "os": os, "config": config or {},
               "rootfs": {"type": "layers", "diff_ids": diff_ids}}
        cfg = self.blob(json.dumps(doc, sort_keys=True).encode(),
                        "application/vnd.oci.image.config.v1+json")
        media_type = "application/vnd.oci.image.manifest.v1+json"
        manifest = {"schemaVersion": 2, "mediaType": media_type, "config": cfg, "layers": descs}
        desc = self.blob(json.dumps(manifest, sort_keys=True).encode(), media_type)
        return BuiltImage(desc, cfg["digest"], [d["digest"] for d in descs], diff_ids)

    def index(self, entries: list[tuple[BuiltImage, str, str]]) -> dict[str, Any]:
        """An image index of (image, os, arch) entries, in that order."""
        manifests = [{**img.manifest, "platform": {"os": os, "architecture": arch}}
                     for img, os, arch in entries]
        media_type = "application/vnd.oci.image.index.v1+json"
        doc = {"schemaVersion": 2, "mediaType": media_type, "manifests": manifests}
        return self.blob(json.dumps(doc, sort_keys=True).encode(), media_type)

    def tag(self, name: str, descriptor: dict[str, Any]) -> str:
        self.tags[name] = {**descriptor,
                           "annotations": {"org.opencontainers.image.ref.name": name}}
        (self.root / "index.json").write_text(json.dumps(
            {"schemaVersion": 2, "manifests": list(self.tags.values())}))
        return f"oci:{self.root}:{name}"


def push(source: str, dest: str, *, all_images: bool = False, fmt: str | None = None,
         authfile: Path | None = None) -> None:
    """skopeo copy a layout tag to a registry on 127.0.0.1 (plain HTTP)."""
    argv = [shutil.which("skopeo") or "skopeo", "--insecure-policy", "copy", "-q",
            "--dest-tls-verify=false"]
    if all_images:
        argv += ["--all", "--preserve-digests"]
    elif fmt is None:
        argv.append("--preserve-digests")
    if fmt:
        argv += ["--format", fmt]
    if authfile:
        argv += ["--dest-authfile", str(authfile)]
    subprocess.run([*argv, source, f"docker://{dest}"], check=True, capture_output=True,
                   timeout=120)
