"""The host's end of guests' mounts (host/volumes/guestserver.py, posix.py) spoken to as a
hostile guest would: paths and symlinks aimed at the host, setuid bits, oversized
messages, volumes it did not mount, retried mutations."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import stat
import struct
import subprocess
import threading
from pathlib import Path

import pytest

from envd.volumes import wire
from envd.volumes.client import HostClient, RemoteError
from host.volumes.guestserver import GuestServer, ReplayCache


@pytest.fixture
def served(tmp_path):
    """(client of volume 'v', the volume's directory, a host directory outside it)."""
    data = tmp_path / "data"
    data.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host")
    loop = asyncio.new_event_loop()
    server = GuestServer("sbx", {"v": data}, replays=ReplayCache(),
                         min_free_bytes=0)
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    port = sock.getsockname()[1]
    loop.run_until_complete(server.start(sock))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield HostClient("127.0.0.1", port, "v"), data, outside, port
    asyncio.run_coroutine_threadsafe(server.aclose(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def call(client, op, path, payload=b"", **args):
    return client.call(op, path, payload, **args)


def test_posix_operations(served):
    c, data, _, _ = served
    call(c, "create", "/f", mode=0o644, uid=1000, gid=1000, excl=True)
    assert call(c, "write", "/f", b"hello world", offset=0)[0]["size"] == 11
    assert call(c, "read", "/f", size=5, offset=6)[1] == b"world"
    s = os.stat(data / "f")
    assert (s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode)) == (1000, 1000, 0o644)
    with pytest.raises(RemoteError) as e:
        call(c, "create", "/f", mode=0o644, uid=0, gid=0, excl=True)
    assert e.value.errno == errno.EEXIST
    call(c, "mkdir", "/d", mode=0o755, uid=0, gid=0)
    call(c, "rename", "/f", new="/d/g")
    assert sorted(call(c, "readdir", "/d")[0]["names"]) == ["g"]
    call(c, "truncate", "/d/g", size=3)
    assert (data / "d" / "g").read_bytes() == b"hel"
    call(c, "utimens", "/d/g", atime=10**18, mtime=2 * 10**18)
    assert os.stat(data / "d" / "g").st_mtime_ns == 2 * 10**18
    call(c, "link", "/d/g", new="/h")
    assert os.stat(data / "h").st_nlink == 2
    call(c, "unlink", "/h")
    with pytest.raises(RemoteError) as e:
        call(c, "rmdir", "/d")
    assert e.value.errno == errno.ENOTEMPTY
    assert call(c, "statfs", "/")[0]["bsize"] > 0
    assert stat.S_ISDIR(call(c, "getattr", "/")[0]["attr"]["mode"])


def test_no_setuid_or_setgid_on_the_host(served):
    c, data, _, _ = served
    call(c, "create", "/x", mode=0o6755, uid=0, gid=0, excl=True)
    assert stat.S_IMODE(os.stat(data / "x").st_mode) == 0o755
    call(c, "chmod", "/x", mode=0o4777)
    assert stat.S_IMODE(os.stat(data / "x").st_mode) == 0o777
    call(c, "mkdir", "/sticky", mode=0o3777, uid=0, gid=0)
    assert stat.S_IMODE(os.stat(data / "sticky").st_mode) == 0o1777   # sticky is harmless


def test_symlinks_and_dotdot_stay_inside(served):
    c, data, outside, _ = served
    call(c, "symlink", "/out", target=str(outside), uid=0, gid=0)
    call(c, "symlink", "/up", target="../../../../..", uid=0, gid=0)
    assert os.readlink(data / "out") == str(outside)          # stored as the guest wrote it
    for path in ("/out/secret", f"/up{outside}/secret", "/../outside/secret",
                 "/../../../" + str(outside) + "/secret"):
        with pytest.raises(RemoteError) as e:
            call(c, "read", path, size=100, offset=0)
        assert e.value.errno == errno.ENOENT, path
    # writes through them land inside the volume or fail, never outside
    (data / str(outside).lstrip("/")).mkdir(parents=True)
    call(c, "create", "/out/planted", mode=0o644, uid=0, gid=0, excl=True)
    assert not (outside / "planted").exists()
    assert (data / str(outside).lstrip("/") / "planted").exists()
    # operations on the link itself never reach what it names
    call(c, "chown", "/out", uid=1234, gid=1234)
    assert os.stat(outside).st_uid != 1234
    call(c, "unlink", "/out")
    assert (outside / "secret").read_text() == "host"


def test_writes_stop_under_the_hosts_disk_floor(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    from host.volumes.posix import VolumeOps
    ops = VolumeOps(data, min_free_bytes=1 << 62)     # more than any disk has free
    for op, args in (("create", {"mode": 0o644, "uid": 0, "gid": 0}),
                     ("mkdir", {"mode": 0o755, "uid": 0, "gid": 0})):
        with pytest.raises(OSError) as e:
            ops.call({"op": op, "path": "/x", **args}, b"")
        assert e.value.errno == errno.ENOSPC
    assert list(data.iterdir()) == []
    ops.close()


def test_only_mounted_volumes(served):
    _, _, _, port = served
    stranger = HostClient("127.0.0.1", port, "not-mine")
    with pytest.raises(RemoteError) as e:
        stranger.call("getattr", "/")
    assert e.value.errno == errno.EACCES


def test_oversized_and_garbage_messages_drop_the_connection(served):
    c, _, _, port = served
    for junk in (struct.pack(">II", wire.MAX_HEADER + 1, 0),
                 struct.pack(">II", 10, wire.MAX_PAYLOAD + 1),
                 struct.pack(">II", 5, 0) + b"nope!"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(junk)
            assert s.recv(100) == b""      # closed, nothing read past the bound
    assert call(c, "getattr", "/")[0]["attr"]      # the server still serves


def test_a_retried_mutation_is_answered_not_redone(served):
    c, data, _, port = served
    call(c, "mkdir", "/once", mode=0o755, uid=0, gid=0)
    message = wire.encode({"id": 42, "op": "rename", "vol": "v", "path": "/once",
                           "new": "/twice"})
    answers = []
    for _ in range(2):      # the same request twice, as after a broken connection
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(message)
            head, _ = wire.sizes(s.recv(wire.PREFIX_SIZE))
            answers.append(wire.decode_header(s.recv(head)))
    assert answers == [{"errno": 0}, {"errno": 0}]      # not ENOENT the second time
    assert (data / "twice").is_dir() and not Path(data / "once").exists()


def test_the_guest_and_the_firewall_agree_on_the_port():
    from host.network.sandbox import GUEST_SERVICE_PORT
    assert wire.PORT == GUEST_SERVICE_PORT


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="FUSE mounts need root and /dev/fuse")
def test_envd_init_mounts_once_and_refuses_bad_mounts(served, tmp_path):
    """envd's /init (`aenvVolumeMounts`): bad entries are a 400 that mounts nothing; a good
    one is mounted and served; /init again (every resume, retries) leaves it alone; a
    mount whose process died is mounted again by envd's watchdog."""
    import time

    import httpx

    from envd.volumes.mounts import mounted_paths
    from tests.envd.test_http_endpoints import private_envd

    _, data, _, port = served
    point = tmp_path / "mnt" / "v"
    good = {"name": "v", "path": str(point), "address": f"127.0.0.1:{port}"}
    try:
        with private_envd() as (url, _):
            for bad in ({**good, "path": "relative"}, {**good, "path": f"{point}/../x"},
                        {**good, "path": "/"}, {**good, "name": "a/b"},
                        {**good, "address": "host.example:1"}, "not-an-object"):
                r = httpx.post(f"{url}/init", json={"aenvVolumeMounts": [bad]}, timeout=30)
                assert r.status_code == 400, (bad, r.text)
            r = httpx.post(f"{url}/init", json={"aenvVolumeMounts": [good] * 17}, timeout=30)
            assert r.status_code == 400
            assert str(point) not in mounted_paths()
            assert httpx.post(f"{url}/init", json={"aenvVolumeMounts": [good]},
                              timeout=60).status_code == 204
            assert str(point) in mounted_paths()
            (point / "hello").write_text("through envd's mount")
            assert (data / "hello").read_text() == "through envd's mount"
            before = (point / "hello").stat().st_ino
            for _ in range(2):
                assert httpx.post(f"{url}/init", json={"aenvVolumeMounts": [good]},
                                  timeout=60).status_code == 204
            assert list(mounted_paths()).count(str(point)) == 1
            assert (point / "hello").stat().st_ino == before
            # the mount's process killed (as the OOM killer would): envd mounts it again
            pid = int(subprocess.run(["pgrep", "-f", f"volume-mount v {point} "], check=True,
                                     capture_output=True, text=True).stdout.split()[0])
            os.kill(pid, 9)
            deadline = time.monotonic() + 30
            while True:
                try:
                    (point / "again").write_text("after the watchdog")
                    break
                except OSError:       # ENOTCONN until the new process has mounted it
                    assert time.monotonic() < deadline, "not mounted again in 30 s"
                    time.sleep(0.2)
            assert (data / "again").read_text() == "after the watchdog"
        # envd gone (no watchdog any more): under the mount the directory is immutable, so
        # a write between two mounts fails instead of landing beside the volume
        _unmount(point)
        with pytest.raises(PermissionError):
            (point / "beside").write_text("x")
    finally:
        _unmount(point)
        subprocess.run(["chattr", "-i", str(point)], check=False)   # pytest removes it


def _unmount(point: Path) -> None:
    import time

    from envd.volumes.mounts import mounted_paths

    subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)
    deadline = time.monotonic() + 10
    while str(point) in mounted_paths():
        assert time.monotonic() < deadline, f"{point} still mounted"
        time.sleep(0.05)
