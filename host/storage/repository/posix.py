"""`posix_fs`: a repository in a directory (possibly on a shared filesystem)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from ..errors import LayerNotFoundError, RepositoryError
from ..integrity import ChunkSums, retry_once
from .base import Transferred, check_key, check_name, check_sha256, digest_hex
from .files import atomic, copy_sparse, hash_file, link_or_copy


class PosixFsRepository:
    """A directory (possibly on a shared filesystem)."""

    backend = "posix_fs"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.transferred = Transferred()
        (self.root / "layers").mkdir(parents=True, exist_ok=True)
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)

    @property
    def layers_dir(self) -> Path:
        """Where the sealed layers are, `<hex>.lsmt` (the block server's collection
        sweeps it when this node owns the repository)."""
        return self.root / "layers"

    def _layer(self, digest: str) -> Path:
        return self.layers_dir / f"{digest_hex(digest)}.lsmt"

    def has_layer(self, digest: str) -> bool:
        return self._layer(digest).exists()

    def local_path(self, digest: str) -> Path | None:
        p = self._layer(digest)
        return p if p.exists() else None

    def layer_size(self, digest: str) -> int:
        try:
            return self._layer(digest).stat().st_size
        except FileNotFoundError as exc:
            raise LayerNotFoundError(f"layer {digest} not in {self.root}") from exc

    def read_layer(self, digest: str, offset: int, length: int) -> bytes:
        try:
            with open(self._layer(digest), "rb") as f:
                data = os.pread(f.fileno(), length, offset)
        except FileNotFoundError as exc:
            raise LayerNotFoundError(f"layer {digest} not in {self.root}") from exc
        self.transferred.downloaded(len(data))
        return data

    def put_layer(self, digest: str, path: str | os.PathLike[str]) -> None:
        dst = self._layer(digest)
        if dst.exists():
            return
        # sealed layers are immutable: share the bytes
        self.transferred.uploaded(link_or_copy(Path(path), dst))

    def layer_sums(self, digest: str) -> ChunkSums | None:
        return None  # read in place (local_path), never through the chunk cache

    def put_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        dst = self.root / "manifests" / f"{check_name(name)}.json"
        body = json.dumps(manifest, sort_keys=True)
        with atomic(dst) as tmp, open(tmp, "w") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        self.transferred.uploaded(len(body))

    def get_manifest(self, name: str) -> dict[str, Any]:
        try:
            text = (self.root / "manifests" / f"{check_name(name)}.json").read_text()
        except FileNotFoundError as exc:
            raise RepositoryError(f"no manifest {name!r} in {self.root}") from exc
        self.transferred.downloaded(len(text))
        doc: dict[str, Any] = json.loads(text)
        return doc

    def list_manifests(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "manifests").glob("*.json"))

    def delete_manifest(self, name: str) -> None:
        (self.root / "manifests" / f"{check_name(name)}.json").unlink(missing_ok=True)

    # Files are immutable once put: a hard link shares the bytes when source and repository
    # are on one filesystem (a pause's memory diff is then "uploaded" in microseconds).

    def _file(self, key: str) -> Path:
        return self.root / "files" / check_key(key)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> str | None:
        dst = self._file(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        self.transferred.uploaded(link_or_copy(Path(path), dst))
        return None  # usually a hard link: hashing would read what was never copied

    def fetch_file(self, key: str, dest: str | os.PathLike[str], *,
                   sha256: str | None = None) -> None:
        src = self._file(key)
        if not src.exists():
            raise LayerNotFoundError(f"file {key} not in {self.root}")
        dst = Path(dest)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if sha256 is None:
            self.transferred.downloaded(link_or_copy(src, dst))
            return

        def attempt() -> None:
            with atomic(dst) as tmp:
                tmp.unlink()
                try:
                    os.link(src, tmp)
                except OSError:
                    self.transferred.downloaded(copy_sparse(src, tmp))
                check_sha256(key, hash_file(tmp), sha256)

        retry_once(f"file {key}", attempt)

    def has_file(self, key: str) -> bool:
        return self._file(key).is_file()

    def delete_layer(self, digest: str) -> int:
        path = self._layer(digest)
        try:
            st = path.stat()
            path.unlink()
        except FileNotFoundError:
            return 0
        return st.st_blocks * 512 if st.st_nlink == 1 else 0  # a hard link frees nothing

    def delete_files(self, prefix: str) -> int:
        target = self.root / "files" / check_key(prefix.rstrip("/"))
        freed = 0
        for f in (target.rglob("*") if target.is_dir() else [target]):
            with contextlib.suppress(OSError):
                st = f.lstat()
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:  # a hard link frees nothing
                    freed += st.st_blocks * 512
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
        return freed

