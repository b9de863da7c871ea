"""Volume records as files in the volumes directory: two nodes sharing the directory (a
posix_fs repository) see one set of volumes with unique names, and what crashes leave is
swept only once no node can still be making it."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from host.volumes import InvalidVolume, VolumeNameTaken, VolumeNotFound, VolumeRecords
from host.volumes.records import GONE_PREFIX
from host.volumes.service import TOKEN_KEY, Volumes
from host.volumes.tokens import VolumeTokens


def test_two_nodes_share_records_and_names(tmp_path):
    a, b = VolumeRecords(tmp_path / "v"), VolumeRecords(tmp_path / "v")
    rec = a.create("data")
    assert b.get(rec.volume_id) == rec and b.find("data") == rec
    with pytest.raises(VolumeNameTaken):
        b.create("data")
    assert [r.name for r in b.list()] == ["data"]
    b.destroy(rec.volume_id)
    with pytest.raises(VolumeNotFound):
        a.get(rec.volume_id)
    assert a.find("data") is None and a.list() == []
    again = a.create("data")                     # the name is free again
    assert again.volume_id != rec.volume_id


def test_one_name_one_volume_under_a_race(tmp_path):
    nodes = [VolumeRecords(tmp_path / "v") for _ in range(8)]
    won, lost = [], []

    def make(r: VolumeRecords) -> None:
        try:
            won.append(r.create("race"))
        except VolumeNameTaken:
            lost.append(1)

    threads = [threading.Thread(target=make, args=(r,)) for r in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 7
    dirs = [p for p in (tmp_path / "v").iterdir() if not p.name.startswith(".")]
    assert [p.name for p in dirs] == [won[0].volume_id]     # the losers left nothing


def test_bad_names_and_ids(tmp_path):
    r = VolumeRecords(tmp_path / "v")
    for name in ("", "a/b", "..", "a b", "x" * 251, ".names"):
        with pytest.raises(InvalidVolume):
            r.create(name)
    with pytest.raises(InvalidVolume, match="Invalid volume ID"):
        r.get("../../etc")


def test_sweep_removes_only_old_leftovers(tmp_path):
    clock = [10_000.0]
    r = VolumeRecords(tmp_path / "v", clock=lambda: clock[0])
    keep = r.create("keep")
    gone = r.create("gone")
    root = tmp_path / "v"
    # a crash in the middle of a destroy: the directory renamed, the name still there
    (root / gone.volume_id).rename(root / f"{GONE_PREFIX}{gone.volume_id}")
    # a crash in the middle of a create: a directory nobody named
    (root / "00000000-0000-4000-8000-000000000001").mkdir()
    clock[0] = os.stat(root).st_mtime + 10          # young: another node may be at it
    removed = r.sweep()
    assert removed == [f"{GONE_PREFIX}{gone.volume_id}"]
    clock[0] += 7200
    removed = r.sweep()
    assert sorted(removed) == sorted([".names/gone", "00000000-0000-4000-8000-000000000001"])
    assert [v.name for v in r.list()] == ["keep"] and r.get(keep.volume_id) == keep


def test_tokens_are_shared_by_the_nodes_sharing_the_volumes(tmp_path):
    a, b = Volumes(tmp_path / "v"), Volumes(tmp_path / "v")
    rec = a.records.create("t")
    b.tokens.check(a.token(rec), rec.volume_id)      # minted on one node, good on the other
    assert oct((tmp_path / "v" / TOKEN_KEY).stat().st_mode & 0o777) == "0o600"
    other = VolumeTokens(os.urandom(32))
    with pytest.raises(Exception, match="invalid or expired"):
        other.check(a.token(rec), rec.volume_id)


def test_uploads_stop_under_the_disk_floor(tmp_path):
    from host.volumes import VolumeFull

    vols = Volumes(tmp_path / "v", min_free_bytes=1 << 62)    # more than any disk has
    rec = vols.records.create("full")
    files = asyncio.run(vols.files(rec.volume_id, vols.token(rec)))
    upload = files.create("/big")
    with pytest.raises(VolumeFull):
        upload.write(b"x" * 4096)
    upload.abort()
    files.close()
    home = tmp_path / "v" / rec.volume_id
    assert list((home / "staging").iterdir()) == [] and list((home / "data").iterdir()) == []
