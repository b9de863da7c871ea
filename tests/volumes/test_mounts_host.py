"""Volume mounts end to end without a VM: the real service (NodeOrchestrator over the fake
runtime, whose `listen` is a loopback socket instead of the guest's gateway), the e2b
SDK creating sandboxes with `volume_mounts`, and the guest's side played by the real
mount process (`envd volume-mount`: FUSE, as envd starts it in a guest) on this host.

Runs as root with /dev/fuse (this machine; the VM suite proves it inside guests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Volume
from e2b.exceptions import InvalidArgumentException, SandboxException

from envd.volumes.mounts import mounted_paths
from tests.api.conftest import API_KEY

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                reason="FUSE mounts need root and /dev/fuse")


class Guest:
    """The guest side of one mount: `envd volume-mount` at `path`, served at `port`."""

    def __init__(self, name: str, path: Path, port: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "envd", "volume-mount", name, str(path),
             f"127.0.0.1:{port}"], cwd=Path(__file__).parents[2])
        deadline = time.monotonic() + 20
        while str(path) not in mounted_paths():
            assert self.proc.poll() is None, "the mount process exited"
            assert time.monotonic() < deadline, "not mounted in 20 s"
            time.sleep(0.05)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def guests(tmp_path) -> Iterator[list[Guest]]:
    made: list[Guest] = []
    yield made
    for g in made:
        g.close()
    assert not [p for p in mounted_paths() if p.startswith(str(tmp_path))]


def _init_mounts(svc, sandbox_id: str) -> list[dict]:
    host = svc.runtime.vms[sandbox_id].envd_host
    bodies = [body for h, body, _ in svc.envd.inits if h == host]
    return bodies[-1].get("aenvVolumeMounts", [])


def test_two_sandboxes_share_a_volume_and_survive_pause_and_fork(svc, guests, tmp_path):
    vol = Volume.create("shared")
    vol.write_file("/from-api.txt", "written by the API")
    a = Sandbox.create(volume_mounts={"/mnt/data": vol})
    b = Sandbox.create(volume_mounts={"/mnt/data": "shared"})
    assert a.get_info().volume_mounts == [{"name": "shared", "path": "/mnt/data"}]
    detail = httpx.get(f"{svc.url}/sandboxes/{a.sandbox_id}",
                       headers={"X-API-Key": API_KEY}).json()
    assert detail["volumeMounts"] == [{"name": "shared", "path": "/mnt/data"}]
    # envd is told what to mount and where the host serves it (the gateway, one port)
    init = _init_mounts(svc, a.sandbox_id)
    assert init == [{"name": "shared", "path": "/mnt/data", "address": "192.168.127.1:49982"}]

    ga = Guest("shared", tmp_path / "a", svc.runtime.listening[a.sandbox_id])
    gb = Guest("shared", tmp_path / "b", svc.runtime.listening[b.sandbox_id])
    guests += [ga, gb]
    assert (ga.path / "from-api.txt").read_text() == "written by the API"
    (ga.path / "dir").mkdir()
    (ga.path / "dir" / "note").write_text("from a")
    assert (gb.path / "dir" / "note").read_text() == "from a"      # b sees a's write
    (gb.path / "dir" / "note").write_text("from b, longer")
    assert (ga.path / "dir" / "note").read_text() == "from b, longer"
    assert vol.read_file("/dir/note") == "from b, longer"           # and so does the API
    big = os.urandom(5 << 20)
    (ga.path / "big").write_bytes(big)
    assert (gb.path / "big").read_bytes() == big
    # a guest's file is owned by its caller (root here) with its mode, setuid dropped
    os.chmod(ga.path / "big", 0o4750)
    assert vol.get_info("/big").mode == 0o750

    # pause: the server goes (the guest's calls wait); resume: served again, same mount
    a.pause()
    assert a.sandbox_id not in svc.node.volumes.serving()
    a.connect()
    assert a.sandbox_id in svc.node.volumes.serving()
    ga.close()
    guests.remove(ga)
    ga2 = Guest("shared", tmp_path / "a2", svc.runtime.listening[a.sandbox_id])
    guests.append(ga2)
    assert (ga2.path / "big").read_bytes() == big

    # a fork child mounts the volume too
    children = httpx.post(f"{svc.url}/sandboxes/{b.sandbox_id}/fork", json={"count": 1},
                          headers={"X-API-Key": API_KEY}).json()
    child = children[0]["sandbox"]["sandboxID"]
    assert _init_mounts(svc, child)[0]["name"] == "shared"
    gc = Guest("shared", tmp_path / "c", svc.runtime.listening[child])
    guests.append(gc)
    assert (gc.path / "dir" / "note").read_text() == "from b, longer"

    # killed: nothing served any more
    a.kill()
    assert a.sandbox_id not in svc.node.volumes.serving()


def test_a_guest_reaches_only_its_own_mounts(svc, guests, tmp_path):
    mine_vol = Volume.create("mine")
    other = Volume.create("theirs")
    other.write_file("/secret", "not yours")
    sbx = Sandbox.create(volume_mounts={"/mnt/m": "mine"})
    # the guest names a volume it did not mount: refused (EACCES), whatever it sends
    g = Guest("theirs", tmp_path / "x", svc.runtime.listening[sbx.sandbox_id])
    guests.append(g)
    with pytest.raises(PermissionError):
        os.listdir(g.path)
    # its own mount works, beside
    mine = Guest("mine", tmp_path / "m", svc.runtime.listening[sbx.sandbox_id])
    guests.append(mine)
    (mine.path / "f").write_text("ok")
    assert Volume.connect(mine_vol.volume_id).read_file("/f") == "ok"


def test_bad_mounts_are_refused_with_e2bs_messages(svc):
    Volume.create("v1")
    cases = {
        "/mnt/x": ("nope", "volume mount #0: volume 'nope' not found"),
        "relative": ("v1", "volume mount #0: path must be absolute"),
        "/mnt/../etc": ("v1", "path must not contain any '.' or '..' components"),
        "/mnt/y/": ("v1", "path must not contain any '.' or '..' components"),
    }
    for path, (name, message) in cases.items():
        with pytest.raises((InvalidArgumentException, SandboxException), match="invalid mounts"):
            Sandbox.create(volume_mounts={path: name})
        r = httpx.post(f"{svc.url}/v2/sandboxes", headers={"X-API-Key": API_KEY},
                       json={"templateID": "base", "volumeMounts": [{"name": name,
                                                                     "path": path}]})
        assert r.status_code == 400 and message in r.json()["message"], r.text
    r = httpx.post(f"{svc.url}/v2/sandboxes", headers={"X-API-Key": API_KEY},
                   json={"templateID": "base", "volumeMounts": [
                       {"name": "v1", "path": "/a"}, {"name": "v1", "path": "/a"}]})
    assert r.status_code == 400
    assert "volume mount #1: path '/a' is already used" in r.json()["message"]
    r = httpx.post(f"{svc.url}/v2/sandboxes", headers={"X-API-Key": API_KEY},
                   json={"templateID": "base", "volumeMounts": [
                       {"name": "v1", "path": "/a/b"}, {"name": "v1", "path": "/a"},
                       {"name": "v1", "path": "/ab"}]})
    assert r.status_code == 400
    assert r.json()["message"] == ("invalid mounts:\n\t- volume mount #1: path '/a' overlaps "
                                   "the mount at '/a/b'")
    assert not svc.runtime.vms                      # nothing was started
