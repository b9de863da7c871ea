"""The blank ext4 under every imported image (host/runtime/imports.py `blank_layer`): made
once per repository with the importer's mkfs options, named by them, so a blank made with
other options (older code) is not reused, and its document goes (its layer then stays only
as long as something made on it does)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from host.runtime.imports import blank_layer
from host.runtime.manifests import ManifestStore
from host.storage import BlockServer
from host.storage.repository import PosixFsRepository


async def test_the_blank_is_named_by_its_mkfs_options_and_an_older_one_is_dropped(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    bs = BlockServer(socket_dir=tmp_path / "s", state_dir=tmp_path / "st",
                     repository=PosixFsRepository(repo))
    await bs.start()
    try:
        manifests = ManifestStore(f"posix_fs:{repo}")
        await manifests.put_doc("ociblank-4096", {"layer": "sha256:" + "0" * 64})
        parts: Any = SimpleNamespace(manifests=manifests, block=SimpleNamespace(client=bs),
                                     blank_lock=asyncio.Lock(),
                                     config=SimpleNamespace(state_dir=tmp_path))
        digest = await blank_layer(parts)
        docs = await manifests.documents("ociblank-")
        assert list(docs) != ["ociblank-4096"] and len(docs) == 1, docs
        (name, doc), = docs.items()
        assert name.startswith("ociblank-4096-") and doc == {"layer": digest}
        assert await blank_layer(parts) == digest  # made once
        # what it is: an ext4 made with the importer's options, without metadata checksums
        raw = tmp_path / "blank.raw"
        await bs.create("b", [digest])
        await bs.export_raw("b", str(raw))
        features = (await asyncio.to_thread(
            subprocess.run, ["dumpe2fs", "-h", str(raw)], capture_output=True, text=True,
            check=True)).stdout
        assert "aenv-root" in features and "metadata_csum" not in features
    finally:
        await bs.aclose()
