"""The e2b SDK's `Volume` against the real service (a NodeOrchestrator over the fake
runtime: volumes need no VM): create / connect / list / destroy and every file operation,
with E2B's statuses for bad input."""

from __future__ import annotations

import os
import stat

import httpx
import pytest
from e2b import Volume
from e2b.exceptions import NotFoundException, VolumeException
from e2b.volume.types import VolumeFileType

from .conftest import API_KEY, ServerThread
from .template_service import DOMAIN, NodeService, node_service  # noqa: F401 (fixture)


@pytest.fixture
def svc(node_service: NodeService, monkeypatch):  # noqa: F811 - the imported fixture
    """The service, with the SDK pointed at it: the API and the volume content API (the
    SDK reaches the latter at E2B_VOLUME_API_URL, else https://api.<domain>)."""
    monkeypatch.setenv("E2B_API_URL", node_service.url)
    monkeypatch.setenv("E2B_VOLUME_API_URL", node_service.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_DOMAIN", DOMAIN)
    for var in ("E2B_DEBUG", "E2B_SANDBOX_URL", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return node_service


def test_volume_lifecycle_and_files(svc):
    vol = Volume.create("data-1")
    assert vol.name == "data-1" and vol.token
    assert [v.name for v in Volume.list()] == ["data-1"]
    info = Volume.get_info(vol.volume_id)
    assert (info.volume_id, info.name) == (vol.volume_id, "data-1") and info.token

    # files, as E2B makes them: 9090:9090, 0666 / 0777, parents only with force
    entry = vol.write_file("/notes/a.txt", "hello", force=True)
    assert (entry.type, entry.path, entry.size) == (VolumeFileType.FILE, "/notes/a.txt", 5)
    assert (entry.uid, entry.gid, entry.mode) == (9090, 9090, 0o666)
    assert vol.get_info("/notes").mode == 0o777
    assert vol.read_file("/notes/a.txt") == "hello"
    assert vol.read_file("notes/a.txt", format="bytes") == b"hello"
    assert b"".join(vol.read_file("/notes/a.txt", format="stream")) == b"hello"
    with pytest.raises(VolumeException):
        vol.write_file("/notes/a.txt", "again")            # exists, no force: 409
    assert vol.write_file("/notes/a.txt", "again", force=True).size == 5
    with pytest.raises(NotFoundException):
        vol.write_file("/missing/b.txt", "x")              # no parent, no force: 404

    d = vol.make_dir("/x/y/z", force=True, uid=1000, gid=1000, mode=0o750)
    assert (d.type, d.uid, d.gid, d.mode) == (VolumeFileType.DIRECTORY, 1000, 1000, 0o750)
    with pytest.raises(VolumeException):
        vol.make_dir("/x/y/z")                             # exists: 409
    assert vol.make_dir("/x/y/z", force=True).mode == 0o750   # kept as it was

    listed = vol.list("/", depth=3)
    assert [e.path for e in listed] == ["/notes", "/notes/a.txt", "/x", "/x/y", "/x/y/z"]
    assert [e.path for e in vol.list("/")] == ["/notes", "/x"]
    assert vol.exists("/x/y") and not vol.exists("/nope")

    meta = vol.update_metadata("/notes/a.txt", uid=1000, gid=1001, mode=0o4755)
    assert (meta.uid, meta.gid, meta.mode) == (1000, 1001, 0o755)   # no setuid on the host

    vol.remove("/x")
    assert not vol.exists("/x/y/z")
    with pytest.raises(NotFoundException):
        vol.remove("/x")

    # a new connection gets a new token, for this volume only
    again = Volume.connect(vol.volume_id)
    assert again.read_file("/notes/a.txt") == "again"

    assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False          # 404
    assert Volume.list() == []
    left = [p.name for p in svc.node.volumes.root.iterdir() if not p.name.startswith(".")]
    assert left == [] and list((svc.node.volumes.root / ".names").iterdir()) == []
    with pytest.raises((NotFoundException, VolumeException)):   # its token died with it
        again.read_file("/notes/a.txt")


def test_bad_input(svc):
    vol = Volume.create("v")
    with pytest.raises(VolumeException, match="already exists"):
        Volume.create("v")
    for name in ("", "a b", "../x", "x" * 251):
        with pytest.raises(VolumeException):
            Volume.create(name)
    with pytest.raises(NotFoundException):
        Volume.get_info("00000000-0000-4000-8000-000000000000")
    h = {"X-API-Key": API_KEY}
    r = httpx.get(f"{svc.url}/volumes/not-a-uuid", headers=h)
    assert (r.status_code, r.json()["message"]) == (400, "Invalid volume ID")
    r = httpx.get(f"{svc.url}/volumes", headers={"X-API-Key": "e2b_wrong"})
    assert r.status_code == 401

    base = f"{svc.url}/volumecontent/{vol.volume_id}"
    bearer = {"Authorization": f"Bearer {vol.token}"}
    # the content API takes the volume's token only: none, a forged one, another volume's
    other = Volume.create("other")
    for headers in ({}, {"Authorization": "Bearer v1.x.1.y"}, h,
                    {"Authorization": f"Bearer {other.token}"}):
        r = httpx.get(f"{base}/dir", params={"path": "/"}, headers=headers)
        assert r.status_code == 401, headers
        assert set(r.json()) >= {"code", "message"}
    assert httpx.get(f"{base}/dir", params={"path": "/"}, headers=bearer).status_code == 200
    # required query, bounds, root
    assert httpx.get(f"{base}/path", headers=bearer).status_code == 400
    r = httpx.get(f"{base}/dir", params={"path": "/", "depth": 11}, headers=bearer)
    assert r.status_code == 400
    r = httpx.delete(f"{base}/path", params={"path": "/"}, headers=bearer)
    assert (r.status_code, r.json()["message"]) == (400, "cannot delete root")
    vol.write_file("/f", "x")
    r = httpx.get(f"{base}/dir", params={"path": "/f"}, headers=bearer)
    assert r.status_code == 400
    r = httpx.put(f"{base}/file", params={"path": "/f/g", "force": "true"}, headers=bearer,
                  content=b"x")
    assert r.status_code == 400 and "is a file" in r.json()["message"]
    # `..` stops at the volume's root
    assert vol.write_file("/../../../escaped", "in", force=True).path == "/escaped"
    assert (svc.node.volumes.data_dir(vol.volume_id) / "escaped").read_text() == "in"


def test_symlinks_stay_inside_the_volume(svc, tmp_path):
    """What a guest leaves in a volume (symlinks to host paths) resolves inside it."""
    vol = Volume.create("links")
    data = svc.node.volumes.data_dir(vol.volume_id)
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    secret.chmod(0o600)
    os.symlink(str(tmp_path), data / "out")           # absolute: to the host's dir
    os.symlink("../../../../../..", data / "up")      # relative, climbing
    os.symlink(str(secret), data / "s")
    with pytest.raises(NotFoundException):
        vol.read_file("/out/secret")
    with pytest.raises(NotFoundException):
        vol.read_file("/s")
    assert vol.get_info("/s").target == str(secret) and vol.get_info("/s").type == "symlink"
    # writes through them land inside the volume, never on the host
    with pytest.raises(NotFoundException):      # /out leads to a directory the volume lacks
        vol.write_file("/out/planted", "x", force=True)
    vol.make_dir(str(tmp_path), force=True)
    vol.write_file("/out/planted", "x", force=True)
    vol.write_file(f"/up{tmp_path}/planted2", "y", force=True)
    assert not (tmp_path / "planted").exists() and not (tmp_path / "planted2").exists()
    assert (data / tmp_path.relative_to("/") / "planted").read_text() == "x"
    # chmod through a symlink never reaches its target
    vol.update_metadata("/s", mode=0o777)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_text() == "host secret"
    # removing a symlink to a directory removes the link, not what it points to
    vol.remove("/out")
    assert tmp_path.exists() and secret.exists()


def test_volumes_survive_a_restart(tmp_path):
    key = {"X-API-Key": API_KEY}
    first = NodeService(tmp_path / "state")
    with ServerThread(first, lifespan="on") as srv:
        made = httpx.post(f"{srv.url}/volumes", json={"name": "keep"}, headers=key).json()
        vid, token = made["volumeID"], made["token"]
        bearer = {"Authorization": f"Bearer {token}"}
        r = httpx.put(f"{srv.url}/volumecontent/{vid}/file", params={"path": "/a"},
                      content=b"kept", headers=bearer)
        assert r.status_code == 201
    first.close_store()
    # an upload cut off by a crash: left in staging, swept at a start once old enough that
    # no node sharing the volumes can still be writing it
    staging = tmp_path / "state" / "volumes" / vid / "staging"
    (staging / ".aenv-upload-deadbeef").write_bytes(b"partial")
    os.utime(staging / ".aenv-upload-deadbeef", (1, 1))
    (staging / ".aenv-upload-fresh").write_bytes(b"in flight elsewhere")
    second = NodeService(tmp_path / "state")
    with ServerThread(second, lifespan="on") as srv:
        listed = httpx.get(f"{srv.url}/volumes", headers=key).json()
        assert listed == [{"volumeID": vid, "name": "keep"}]
        r = httpx.get(f"{srv.url}/volumecontent/{vid}/file", params={"path": "/a"},
                      headers=bearer)   # the old token still works
        assert r.content == b"kept"
    second.close_store()
    assert [p.name for p in staging.iterdir()] == [".aenv-upload-fresh"]
