"""The durable store of sealed layers and snapshot manifests: `posix_fs` or `oss` (S3).

Layers live under `layers/<hex>.lsmt`, manifests under `manifests/<name>.json`, and other
immutable files (memory snapshots) under `files/<key>`. All are made visible atomically:
posix_fs writes a temp file (or hard-links one), fsyncs and renames; oss uploads with a
multipart upload (an object appears only when the upload completes) and a manifest with one
PUT, after everything it names. So a crash never leaves half a snapshot visible.

What comes back from `oss` is checked (integrity.py): a layer is uploaded after its chunk
sums (`layers/<hex>.sums.json`), which the chunk cache checks every fetched chunk against;
`put_file` returns the sha256 of the file's content, which `fetch_file(sha256=)` checks.

Each repository counts the bytes it moves (`transferred`, read by the host's metrics):
copies and network transfers, not the hard links posix_fs makes on one filesystem.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol, cast
from urllib.parse import parse_qs, urlparse

from .errors import IntegrityError, LayerNotFoundError, RepositoryConfigError, RepositoryError
from .integrity import ChunkSums, HashingReader, retry_once, sums_of_file


def _hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexpart


def _check_name(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad manifest name {name!r}")
    return name


def _check_key(key: str) -> str:
    """A file key: relative, `/`-separated, no empty, `.` or `..` parts, no dot-files."""
    parts = key.split("/")
    if not key or any(not p or p.startswith(".") for p in parts):
        raise ValueError(f"bad file key {key!r}")
    return key


class Transferred:
    """Bytes a repository object moved to (upload) and from (download) its backend since
    it was opened. Thread-safe: repository calls run in worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.upload_bytes = 0
        self.download_bytes = 0

    def uploaded(self, n: int) -> None:
        if n > 0:  # boto3 progress callbacks report a retried part's bytes negative
            with self._lock:
                self.upload_bytes += n

    def downloaded(self, n: int) -> None:
        if n > 0:
            with self._lock:
                self.download_bytes += n


class Repository(Protocol):
    """Where layers and manifests are kept durably."""

    def has_layer(self, digest: str) -> bool: ...
    def layer_size(self, digest: str) -> int: ...
    def read_layer(self, digest: str, offset: int, length: int) -> bytes: ...
    def put_layer(self, digest: str, path: str | os.PathLike[str]) -> None: ...
    def local_path(self, digest: str) -> Path | None: ...
    def layer_sums(self, digest: str) -> ChunkSums | None:
        """What chunks read with `read_layer` are checked against (None: not recorded)."""
        ...
    def put_manifest(self, name: str, manifest: dict[str, Any]) -> None: ...
    def get_manifest(self, name: str) -> dict[str, Any]: ...
    def list_manifests(self) -> list[str]: ...
    def delete_manifest(self, name: str) -> None: ...
    def put_file(self, key: str, path: str | os.PathLike[str]) -> str | None:
        """Store an immutable file; returns the sha256 (hex) of its content when the
        backend computed it while copying (None: the bytes are shared, not copied)."""
        ...
    def fetch_file(self, key: str, dest: str | os.PathLike[str], *,
                   sha256: str | None = None) -> None:
        """Copy a file to `dest` (atomically); with `sha256`, its content must match
        (refetched once, then IntegrityError, and `dest` is not created)."""
        ...
    def has_file(self, key: str) -> bool: ...
    def delete_files(self, prefix: str) -> int:
        """Remove the files under `prefix` (a directory of keys); the bytes that frees."""
        ...
    def delete_layer(self, digest: str) -> int:
        """Remove a layer (and what describes it); the bytes it held (0: it was absent)."""
        ...


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
        return self.layers_dir / f"{_hex(digest)}.lsmt"

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
        self.transferred.uploaded(_link_or_copy(Path(path), dst))

    def layer_sums(self, digest: str) -> ChunkSums | None:
        return None  # read in place (local_path), never through the chunk cache

    def put_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        dst = self.root / "manifests" / f"{_check_name(name)}.json"
        body = json.dumps(manifest, sort_keys=True)
        with _atomic(dst) as tmp, open(tmp, "w") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        self.transferred.uploaded(len(body))

    def get_manifest(self, name: str) -> dict[str, Any]:
        try:
            text = (self.root / "manifests" / f"{_check_name(name)}.json").read_text()
        except FileNotFoundError as exc:
            raise RepositoryError(f"no manifest {name!r} in {self.root}") from exc
        self.transferred.downloaded(len(text))
        doc: dict[str, Any] = json.loads(text)
        return doc

    def list_manifests(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "manifests").glob("*.json"))

    def delete_manifest(self, name: str) -> None:
        (self.root / "manifests" / f"{_check_name(name)}.json").unlink(missing_ok=True)

    # Files are immutable once put: a hard link shares the bytes when source and repository
    # are on one filesystem (a pause's memory diff is then "uploaded" in microseconds).

    def _file(self, key: str) -> Path:
        return self.root / "files" / _check_key(key)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> str | None:
        dst = self._file(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        self.transferred.uploaded(_link_or_copy(Path(path), dst))
        return None  # usually a hard link: hashing would read what was never copied

    def fetch_file(self, key: str, dest: str | os.PathLike[str], *,
                   sha256: str | None = None) -> None:
        src = self._file(key)
        if not src.exists():
            raise LayerNotFoundError(f"file {key} not in {self.root}")
        dst = Path(dest)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if sha256 is None:
            self.transferred.downloaded(_link_or_copy(src, dst))
            return

        def attempt() -> None:
            with _atomic(dst) as tmp:
                tmp.unlink()
                try:
                    os.link(src, tmp)
                except OSError:
                    self.transferred.downloaded(_copy_sparse(src, tmp))
                _check_sha256(key, _hash_file(tmp), sha256)

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
        target = self.root / "files" / _check_key(prefix.rstrip("/"))
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



@contextlib.contextmanager
def _atomic(dst: Path) -> Iterator[Path]:
    """A temp path next to `dst`, renamed over it (and the directory fsynced) on success."""
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=".tmp-")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, dst)
        dfd = os.open(dst.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(1 << 20):
            h.update(buf)
    return h.hexdigest()


def _check_sha256(what: str, got: str, want: str) -> None:
    if got != want:
        raise IntegrityError(f"file {what}: content sha256 {got} does not match the "
                             f"recorded {want}")


def _link_or_copy(src: Path, dst: Path) -> int:
    """Make `dst` an atomic, durable copy of `src`: a hard link when both are on one
    filesystem, else a copy that keeps holes (memory files are mostly zeros). Returns
    the bytes copied (0 for a link)."""
    with _atomic(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            return _copy_sparse(src, tmp)
    return 0


class _SparseWriter:
    """A write-only stream onto a file that leaves all-zero chunks as holes (fetched memory
    files stay as sparse as the originals), hashing what it is given."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.pos = 0
        self.hash = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        n = len(data)
        self.hash.update(data)
        if n and bytes(data).count(0) != n:
            self.f.seek(self.pos)
            self.f.write(data)
        self.pos += n
        return n

    def flush(self) -> None:
        self.f.flush()

    def finish(self) -> None:
        self.f.truncate(self.pos)
        self.f.flush()


def _copy_sparse(src: Path, dst: Path) -> int:
    """Copy `src` to `dst` keeping its holes; returns the data bytes copied."""
    copied = 0
    with open(src, "rb") as f, open(dst, "wb") as out:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos < size:
            try:
                data = os.lseek(f.fileno(), pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            hole = os.lseek(f.fileno(), data, os.SEEK_HOLE)
            f.seek(data)
            out.seek(data)
            left = hole - data
            while left > 0:
                buf = f.read(min(left, 1 << 20))
                if not buf:
                    break
                out.write(buf)
                left -= len(buf)
                copied += len(buf)
            pos = hole
        out.truncate(size)
        out.flush()
        os.fsync(out.fileno())
    return copied


@contextlib.contextmanager
def _map_boto_errors(what: str) -> Iterator[None]:
    """botocore errors become RepositoryError (LayerNotFoundError for a missing object)."""
    from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

    try:
        yield
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NotFound"):
            raise LayerNotFoundError(f"{what}: not found") from exc
        raise RepositoryError(f"{what}: {exc}") from exc
    except BotoCoreError as exc:
        raise RepositoryError(f"{what}: {exc}") from exc


class OssRepository:
    """Any S3-compatible object store through boto3. Endpoint, bucket and region are explicit."""

    backend = "oss"

    def __init__(self, *, bucket: str, region: str | None, endpoint: str | None = None,
                 prefix: str = "", access_key: str | None = None, secret_key: str | None = None,
                 addressing_style: str = "path", multipart_chunk_mib: int = 8) -> None:
        if not bucket:
            raise RepositoryConfigError("oss repository: bucket is required")
        if not region:
            raise RepositoryConfigError(
                "oss repository: region is required (set it explicitly, e.g. region=us-east-1)"
            )
        import boto3  # type: ignore[import-untyped]
        from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]
        from botocore.config import Config  # type: ignore[import-untyped]

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.transferred = Transferred()
        self.s3 = boto3.client(
            "s3", endpoint_url=endpoint, region_name=region, aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=Config(s3={"addressing_style": addressing_style},
                          retries={"max_attempts": 5, "mode": "standard"}),
        )
        chunk = multipart_chunk_mib << 20
        self._transfer = TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk)

    def _key(self, digest: str) -> str:
        return f"{self.prefix}layers/{_hex(digest)}.lsmt"

    def _sums_key(self, digest: str) -> str:
        return f"{self.prefix}layers/{_hex(digest)}.sums.json"

    def has_layer(self, digest: str) -> bool:
        try:
            self.layer_size(digest)
            return True
        except LayerNotFoundError:
            return False

    def local_path(self, digest: str) -> Path | None:
        return None

    def layer_size(self, digest: str) -> int:
        with _map_boto_errors(f"layer {digest}"):
            return int(self.s3.head_object(Bucket=self.bucket, Key=self._key(digest))["ContentLength"])

    def read_layer(self, digest: str, offset: int, length: int) -> bytes:
        with _map_boto_errors(f"layer {digest}"):
            r = self.s3.get_object(Bucket=self.bucket, Key=self._key(digest),
                                   Range=f"bytes={offset}-{offset + length - 1}")
            data = bytes(r["Body"].read())
        self.transferred.downloaded(len(data))
        return data

    def put_layer(self, digest: str, path: str | os.PathLike[str]) -> None:
        if self.has_layer(digest):
            if self.layer_sums(digest) is None:  # uploaded before sums were recorded
                self._put_sums(sums_of_file(path, digest))
            return
        # the sums first: a visible layer always has them (and a file that does not
        # match its digest is refused here, never uploaded)
        self._put_sums(sums_of_file(path, digest))
        # upload_file uses a multipart upload above the threshold: the object becomes
        # visible only when CompleteMultipartUpload succeeds, never half-written
        with _map_boto_errors(f"upload {digest}"):
            self.s3.upload_file(str(path), self.bucket, self._key(digest), Config=self._transfer,
                                Callback=self.transferred.uploaded)

    def _put_sums(self, sums: ChunkSums) -> None:
        body = sums.to_json()
        with _map_boto_errors(f"upload chunk sums of {sums.digest}"):
            self.s3.put_object(Bucket=self.bucket, Key=self._sums_key(sums.digest), Body=body)
        self.transferred.uploaded(len(body))

    def layer_sums(self, digest: str) -> ChunkSums | None:
        try:
            with _map_boto_errors(f"chunk sums of {digest}"):
                raw = self.s3.get_object(Bucket=self.bucket,
                                         Key=self._sums_key(digest))["Body"].read()
        except LayerNotFoundError:
            return None
        self.transferred.downloaded(len(raw))
        return ChunkSums.from_json(raw, digest)

    def put_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        body = json.dumps(manifest, sort_keys=True).encode()
        with _map_boto_errors(f"manifest {name}"):
            self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}manifests/{_check_name(name)}.json",
                               Body=body)
        self.transferred.uploaded(len(body))

    def get_manifest(self, name: str) -> dict[str, Any]:
        try:
            with _map_boto_errors(f"manifest {name}"):
                r = self.s3.get_object(Bucket=self.bucket,
                                       Key=f"{self.prefix}manifests/{_check_name(name)}.json")
                raw = r["Body"].read()
        except LayerNotFoundError as exc:
            raise RepositoryError(f"no manifest {name!r}") from exc
        self.transferred.downloaded(len(raw))
        doc: dict[str, Any] = json.loads(raw)
        return doc

    def delete_manifest(self, name: str) -> None:
        with _map_boto_errors(f"delete manifest {name}"):
            self.s3.delete_object(Bucket=self.bucket,
                                  Key=f"{self.prefix}manifests/{_check_name(name)}.json")

    def _file_key(self, key: str) -> str:
        return f"{self.prefix}files/{_check_key(key)}"

    # Files (memory snapshots: guest RAM, much of it zero pages) are stored zstd-compressed:
    # the transfer is the slow part of resuming on a node that does not have them.

    def put_file(self, key: str, path: str | os.PathLike[str]) -> str:
        import zstandard

        # always uploaded (a retried snapshot may reuse a key); a multipart upload of the
        # compressed stream, so the object appears whole or not at all
        cctx = zstandard.ZstdCompressor(level=3, threads=-1)
        with (open(path, "rb") as f, _map_boto_errors(f"upload {key}")):
            src = HashingReader(f)
            # a read()-only stream is all it needs
            with cctx.stream_reader(cast("IO[bytes]", src)) as packed:
                self.s3.upload_fileobj(packed, self.bucket, self._file_key(key),
                                       Config=self._transfer,
                                       Callback=self.transferred.uploaded)
        return src.hexdigest()

    def fetch_file(self, key: str, dest: str | os.PathLike[str], *,
                   sha256: str | None = None) -> None:
        dst = Path(dest)
        dst.parent.mkdir(parents=True, exist_ok=True)
        retry_once(f"file {key}", lambda: self._fetch_file(key, dst, sha256))

    def _fetch_file(self, key: str, dst: Path, sha256: str | None) -> None:
        import zstandard

        with (_atomic(dst) as tmp, _map_boto_errors(f"file {key}"),
              open(tmp, "wb") as out):
            sparse = _SparseWriter(out)
            sink = cast("IO[bytes]", sparse)  # a write()-only stream is all it needs
            try:
                with zstandard.ZstdDecompressor().stream_writer(sink, closefd=False) as unpack:
                    self.s3.download_fileobj(self.bucket, self._file_key(key), unpack,
                                             Config=self._transfer,
                                             Callback=self.transferred.downloaded)
            except zstandard.ZstdError as exc:  # a damaged object: not a zstd stream
                raise IntegrityError(f"file {key}: cannot decompress it: {exc}") from exc
            if sha256 is not None:  # before the rename: a bad copy never appears
                _check_sha256(key, sparse.hash.hexdigest(), sha256)
            sparse.finish()
            os.fsync(out.fileno())

    def has_file(self, key: str) -> bool:
        try:
            with _map_boto_errors(f"file {key}"):
                self.s3.head_object(Bucket=self.bucket, Key=self._file_key(key))
            return True
        except LayerNotFoundError:
            return False

    def delete_layer(self, digest: str) -> int:
        # the layer first: a visible layer always has its sums (put_layer's order)
        try:
            size = self.layer_size(digest)
        except LayerNotFoundError:
            size = 0
        with _map_boto_errors(f"delete layer {digest}"):
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(digest))
            self.s3.delete_object(Bucket=self.bucket, Key=self._sums_key(digest))
        return size

    def delete_files(self, prefix: str) -> int:
        root = self._file_key(prefix.rstrip("/")) + "/"
        freed = 0
        with _map_boto_errors(f"delete {prefix}"):
            for page in self.s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=root):
                objects = page.get("Contents", [])
                if objects:
                    self.s3.delete_objects(Bucket=self.bucket, Delete={
                        "Objects": [{"Key": o["Key"]} for o in objects]})
                    freed += sum(int(o["Size"]) for o in objects)
        return freed

    def list_manifests(self) -> list[str]:
        names = []
        with _map_boto_errors("list manifests"):
            pages = self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{self.prefix}manifests/")
            for page in pages:
                for obj in page.get("Contents", []):
                    key = obj["Key"].rsplit("/", 1)[1]
                    if key.endswith(".json"):
                        names.append(key[:-5])
        return sorted(names)


def open_repository(spec: str) -> PosixFsRepository | OssRepository:
    """A repository from a spec string.

    `posix_fs:/path` or a plain path → PosixFsRepository;
    `oss://BUCKET/PREFIX?endpoint=URL&region=R[&addressing_style=path]` → OssRepository
    (credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or boto3's usual chain).
    """
    if spec.startswith(("oss://", "s3://")):
        u = urlparse(spec)
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        return OssRepository(bucket=u.netloc, prefix=u.path, endpoint=q.get("endpoint"),
                             region=q.get("region"),
                             addressing_style=q.get("addressing_style", "path"))
    spec = spec.removeprefix("posix_fs:")
    if not spec:
        raise RepositoryConfigError("posix_fs repository: a directory is required")
    return PosixFsRepository(spec)
