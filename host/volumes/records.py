"""`VolumeRecords`: which volumes exist, as files in the volumes directory itself.

    <root>/<volume id>/volume.json   {volume_id, name, created_at}
    <root>/.names/<name>             a symlink to the id: names are unique
    <root>/.token.key                the secret of the volumes' tokens (tokens.py)

No database: with a posix_fs repository the volumes directory lives in it, and every node
of a cluster sharing that repository sees the same volumes, records and bytes; creating
the name's symlink is the one atomic step that makes a volume exist (two nodes creating
one name: one wins), removing it after the directory was renamed away unmakes it. What a
crash leaves (a directory without its name, a name without its directory, a destroyed
volume's bytes) is swept at start, the first two only once old enough that no node can
still be creating them.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from host.private import private_dir, write_private

from .errors import InvalidVolume, VolumeNameTaken, VolumeNotFound

NAME_RE = re.compile(r"[a-zA-Z0-9_-]+")
MAX_NAME = 250
GONE_PREFIX = ".gone-"
NAMES = ".names"
RECORD = "volume.json"
SWEEP_AGE_S = 3600.0


@dataclass(frozen=True)
class VolumeRecord:
    volume_id: str
    name: str
    created_at: float


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name) or len(name) > MAX_NAME:
        raise InvalidVolume(f"Invalid volume name: '{name[:300]}' (letters, digits, '_' "
                            f"and '-', at most {MAX_NAME})")
    return name


def check_id(volume_id: str) -> str:
    try:
        return str(uuid.UUID(volume_id))
    except ValueError:
        raise InvalidVolume("Invalid volume ID") from None


class VolumeRecords:
    """Blocking file operations: async callers run them in a thread."""

    def __init__(self, root: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.root = private_dir(root)
        self.names = private_dir(root / NAMES)
        self.clock = clock

    def _read(self, volume_id: str) -> VolumeRecord | None:
        try:
            data = json.loads((self.root / volume_id / RECORD).read_text())
            return VolumeRecord(str(data["volume_id"]), str(data["name"]),
                                float(data["created_at"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def find(self, name: str) -> VolumeRecord | None:
        """The volume `name` points to, if it is there."""
        volume_id = self._target(name)
        rec = None if volume_id is None else self._read(volume_id)
        return rec if rec is not None and rec.name == name else None

    def create(self, name: str) -> VolumeRecord:
        check_name(name)
        rec = VolumeRecord(str(uuid.uuid4()), name, self.clock())
        home = self.root / rec.volume_id
        home.mkdir(mode=0o700)
        try:
            (home / "staging").mkdir(mode=0o700)
            # the volume's own root: guests write here as their users (files.py), so it is
            # open to all like E2B's (0777); the 0700 directories above keep host users out
            (home / "data").mkdir()
            os.chmod(home / "data", 0o777)
            write_private(home / RECORD, json.dumps(asdict(rec)).encode())
            link = self.names / name
            try:
                os.symlink(rec.volume_id, link)
            except FileExistsError:
                if self.find(name) is not None:
                    raise VolumeNameTaken(name) from None
                os.unlink(link)                 # a name left by a crash: its volume is gone
                os.symlink(rec.volume_id, link)
        except BaseException:
            shutil.rmtree(home, ignore_errors=True)
            raise
        return rec

    def get(self, volume_id: str) -> VolumeRecord:
        rec = self._read(check_id(volume_id))
        # its name must still point to it: one being destroyed or never finished is not there
        if rec is None or self._target(rec.name) != rec.volume_id:
            raise VolumeNotFound(volume_id)
        return rec

    def _target(self, name: str) -> str | None:
        try:
            return os.readlink(self.names / name)
        except OSError:
            return None

    def list(self) -> list[VolumeRecord]:
        out = []
        for link in os.scandir(self.names):
            rec = self.find(link.name)
            if rec is not None:
                out.append(rec)
        return sorted(out, key=lambda r: (r.created_at, r.volume_id))

    def destroy(self, volume_id: str) -> Path:
        """Unmake the volume; returns its bytes' new place, for the caller to remove."""
        rec = self.get(volume_id)
        gone = self.root / f"{GONE_PREFIX}{rec.volume_id}"
        (self.root / rec.volume_id).rename(gone)
        if self.find(rec.name) is None:         # not another volume's since
            try:
                os.unlink(self.names / rec.name)
            except FileNotFoundError:
                pass
        return gone

    def sweep(self) -> builtins.list[str]:
        """Remove what crashes left (see the module docstring); what was removed."""
        removed = []
        old = self.clock() - SWEEP_AGE_S
        named = set()
        for link in os.scandir(self.names):
            rec = self.find(link.name)
            if rec is None and link.stat(follow_symlinks=False).st_mtime < old:
                os.unlink(link.path)
                removed.append(f"{NAMES}/{link.name}")
            elif rec is not None:
                named.add(rec.volume_id)
        for entry in os.scandir(self.root):
            unmade = (entry.is_dir(follow_symlinks=False) and not entry.name.startswith(".")
                      and entry.name not in named
                      and entry.stat(follow_symlinks=False).st_mtime < old)
            if entry.name.startswith(GONE_PREFIX) or unmade:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
            elif entry.name in named:
                staging = Path(entry.path) / "staging"
                for left in os.scandir(staging) if staging.is_dir() else ():
                    if left.stat(follow_symlinks=False).st_mtime < old:
                        os.unlink(left.path)
                        removed.append(f"{entry.name}/staging/{left.name}")
        return removed
