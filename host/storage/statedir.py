"""The block server's state directory, every write to it durable before it counts:

    layers/<hex>.lsmt        sealed layers made or imported on this node
    uppers/<id>/             writable uppers (data.lsmt + index.lsmt journal)
    stacks/<name>.json       stack manifests {layers, upper, virtual_size}, written atomically

A seal renames the upper's data into layers/ and then rewrites the manifest; the marker
file it leaves in the upper between the two lets recovery finish a seal cut by a crash.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from host.durable import fsync_dir, fsync_file, write_atomic

from .export import StackExport
from .lsmt import DATA_FILE, SealedLayer, digest_of_file
from .repository import digest_hex
from .upper import Upper

SEALED_MARKER = "sealed-as"


class StateDir:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.layers = self.root / "layers"
        self.uppers = self.root / "uppers"
        self.stacks = self.root / "stacks"

    def prepare(self) -> None:
        for d in (self.layers, self.uppers, self.stacks):
            d.mkdir(parents=True, exist_ok=True)

    # --- layers ---
    def layer_path(self, digest: str) -> Path:
        return self.layers / f"{digest_hex(digest)}.lsmt"

    def placer(self, upper_dir: Path) -> Callable[[str, Path], Path]:
        """What a seal calls to move the upper's data file into layers/ as `digest`."""

        def place(digest: str, data_file: Path) -> Path:
            marker = upper_dir / SEALED_MARKER
            marker.write_text(digest)
            fsync_file(marker)
            return self.install(data_file, digest)

        return place

    def import_file(self, path: str | os.PathLike[str]) -> str:
        """Validate a sealed layer file and copy it into layers/ (once); its digest."""
        SealedLayer.open_path(path).close()
        digest = digest_of_file(path)
        dst = self.layer_path(digest)
        if not dst.exists():
            tmp = dst.with_suffix(".tmp")
            shutil.copyfile(path, tmp)
            fsync_file(tmp)
            self.install(tmp, digest)
        return digest

    def merge_target(self) -> Path:
        """A temp file in layers/ for a compaction to write (`install` renames it)."""
        return self.layers / f"compact-{uuid.uuid4().hex}.tmp"

    def install(self, src: Path, digest: str) -> Path:
        """`src` (a complete, fsynced layer file on this filesystem) renamed into layers/
        as `digest`, durably: the directory fsynced after."""
        dst = self.layer_path(digest)
        os.replace(src, dst)
        fsync_dir(dst.parent)
        return dst

    # --- uppers ---
    @staticmethod
    def new_upper_id(stack: str) -> str:
        return f"{stack}-{uuid.uuid4().hex[:12]}"

    def upper_dir(self, upper_id: str) -> Path:
        return self.uppers / upper_id

    def new_upper(self, stack: str, virtual_size: int, parent_uuid: str) -> tuple[str, Upper]:
        upper_id = self.new_upper_id(stack)
        return upper_id, Upper.create(self.upper_dir(upper_id), virtual_size,
                                      parent_uuid=parent_uuid)

    def finish_seal(self, upper_dir: Path) -> str | None:
        """The digest of a seal of `upper_dir` cut by a crash after its marker was written
        (None: none was), its layer in layers/ when this returns. Cut before the rename, the
        sealed file (complete and fsynced before the marker) is still in the upper: moved
        now. A marker that is not a digest was cut while being written, before the rename:
        it goes, and the upper opens as it is."""
        marker = upper_dir / SEALED_MARKER
        if not marker.exists():
            return None
        digest = marker.read_text().strip()
        try:
            dst = self.layer_path(digest)
        except ValueError:
            marker.unlink()
            return None
        if not dst.exists() and (upper_dir / DATA_FILE).exists():
            self.install(upper_dir / DATA_FILE, digest)
        return digest

    def remove_orphan_uppers(self, live: set[str]) -> list[str]:
        """Uppers no manifest names, left by a crash between creating an upper and
        recording it (create, clone, seal): nothing refers to them. Their names."""
        gone = [d.name for d in self.uppers.iterdir() if d.name not in live]
        for name in gone:
            shutil.rmtree(self.uppers / name, ignore_errors=True)
        return gone

    # --- stack manifests ---
    def manifests(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.stacks.glob("*.json"))]

    def save(self, exp: StackExport) -> None:
        doc = {"name": exp.name, "layers": exp.stack.layer_digests, "upper": exp.upper_id,
               "virtual_size": exp.size}
        write_atomic(self.stacks / f"{exp.name}.json", json.dumps(doc).encode())

    def forget(self, stack: str) -> None:
        (self.stacks / f"{stack}.json").unlink(missing_ok=True)
