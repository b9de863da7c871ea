"""`oss`: a repository in any S3-compatible object store, through boto3."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

from ..errors import IntegrityError, LayerNotFoundError, RepositoryConfigError, RepositoryError
from ..integrity import ChunkSums, HashingReader, retry_once, sums_of_file
from .base import Transferred, check_key, check_name, check_sha256, digest_hex
from .files import SparseWriter, atomic


@contextlib.contextmanager
def map_boto_errors(what: str) -> Iterator[None]:
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
        return f"{self.prefix}layers/{digest_hex(digest)}.lsmt"

    def _sums_key(self, digest: str) -> str:
        return f"{self.prefix}layers/{digest_hex(digest)}.sums.json"

    def has_layer(self, digest: str) -> bool:
        try:
            self.layer_size(digest)
            return True
        except LayerNotFoundError:
            return False

    def local_path(self, digest: str) -> Path | None:
        return None

    def layer_size(self, digest: str) -> int:
        with map_boto_errors(f"layer {digest}"):
            return int(self.s3.head_object(Bucket=self.bucket, Key=self._key(digest))["ContentLength"])

    def read_layer(self, digest: str, offset: int, length: int) -> bytes:
        with map_boto_errors(f"layer {digest}"):
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
        with map_boto_errors(f"upload {digest}"):
            self.s3.upload_file(str(path), self.bucket, self._key(digest), Config=self._transfer,
                                Callback=self.transferred.uploaded)

    def _put_sums(self, sums: ChunkSums) -> None:
        body = sums.to_json()
        with map_boto_errors(f"upload chunk sums of {sums.digest}"):
            self.s3.put_object(Bucket=self.bucket, Key=self._sums_key(sums.digest), Body=body)
        self.transferred.uploaded(len(body))

    def layer_sums(self, digest: str) -> ChunkSums | None:
        try:
            with map_boto_errors(f"chunk sums of {digest}"):
                raw = self.s3.get_object(Bucket=self.bucket,
                                         Key=self._sums_key(digest))["Body"].read()
        except LayerNotFoundError:
            return None
        self.transferred.downloaded(len(raw))
        return ChunkSums.from_json(raw, digest)

    def put_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        body = json.dumps(manifest, sort_keys=True).encode()
        with map_boto_errors(f"manifest {name}"):
            self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}manifests/{check_name(name)}.json",
                               Body=body)
        self.transferred.uploaded(len(body))

    def get_manifest(self, name: str) -> dict[str, Any]:
        try:
            with map_boto_errors(f"manifest {name}"):
                r = self.s3.get_object(Bucket=self.bucket,
                                       Key=f"{self.prefix}manifests/{check_name(name)}.json")
                raw = r["Body"].read()
        except LayerNotFoundError as exc:
            raise RepositoryError(f"no manifest {name!r}") from exc
        self.transferred.downloaded(len(raw))
        doc: dict[str, Any] = json.loads(raw)
        return doc

    def delete_manifest(self, name: str) -> None:
        with map_boto_errors(f"delete manifest {name}"):
            self.s3.delete_object(Bucket=self.bucket,
                                  Key=f"{self.prefix}manifests/{check_name(name)}.json")

    def _file_key(self, key: str) -> str:
        return f"{self.prefix}files/{check_key(key)}"

    # Files (memory snapshots: guest RAM, much of it zero pages) are stored zstd-compressed:
    # the transfer is the slow part of resuming on a node that does not have them.

    def put_file(self, key: str, path: str | os.PathLike[str]) -> str:
        import zstandard

        # always uploaded (a retried snapshot may reuse a key); a multipart upload of the
        # compressed stream, so the object appears whole or not at all
        cctx = zstandard.ZstdCompressor(level=3, threads=-1)
        with (open(path, "rb") as f, map_boto_errors(f"upload {key}")):
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

        with (atomic(dst) as tmp, map_boto_errors(f"file {key}"),
              open(tmp, "wb") as out):
            sparse = SparseWriter(out)
            sink = cast("IO[bytes]", sparse)  # a write()-only stream is all it needs
            try:
                with zstandard.ZstdDecompressor().stream_writer(sink, closefd=False) as unpack:
                    self.s3.download_fileobj(self.bucket, self._file_key(key), unpack,
                                             Config=self._transfer,
                                             Callback=self.transferred.downloaded)
            except zstandard.ZstdError as exc:  # a damaged object: not a zstd stream
                raise IntegrityError(f"file {key}: cannot decompress it: {exc}") from exc
            if sha256 is not None:  # before the rename: a bad copy never appears
                check_sha256(key, sparse.hash.hexdigest(), sha256)
            sparse.finish()
            os.fsync(out.fileno())

    def has_file(self, key: str) -> bool:
        try:
            with map_boto_errors(f"file {key}"):
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
        with map_boto_errors(f"delete layer {digest}"):
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(digest))
            self.s3.delete_object(Bucket=self.bucket, Key=self._sums_key(digest))
        return size

    def delete_files(self, prefix: str) -> int:
        root = self._file_key(prefix.rstrip("/")) + "/"
        freed = 0
        with map_boto_errors(f"delete {prefix}"):
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
        with map_boto_errors("list manifests"):
            pages = self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{self.prefix}manifests/")
            for page in pages:
                for obj in page.get("Contents", []):
                    key = obj["Key"].rsplit("/", 1)[1]
                    if key.endswith(".json"):
                        names.append(key[:-5])
        return sorted(names)
