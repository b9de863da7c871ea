"""filesystem.Filesystem through the real Python SDK (sync + async) and raw Connect calls.

envd runs as root with default user `user`; everything is created under a fresh
directory in /home/user that each test removes again.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pwd
import struct
import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, FileNotFoundException, FileType, Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException

from tests.envd.test_http_endpoints import private_envd

USER = pwd.getpwnam("user")
UNARY = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
STREAM = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}


@pytest.fixture(scope="module")
def envd_instance():
    """A private envd for this module: parallel suites restart the shared 49983 instance."""
    with private_envd() as instance:
        yield instance


@pytest.fixture(scope="module")
def envd_url(envd_instance):
    return envd_instance[0]


@pytest.fixture
def sbx(sdk_env):
    return Sandbox.create()


def mkdir_user(path: Path) -> Path:
    path.mkdir()
    os.chown(path, USER.pw_uid, USER.pw_gid)
    return path


def envelope(msg: dict, flags: int = 0) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(data)) + data


def read_envelopes(buf: bytes) -> list[tuple[int, dict]]:
    out = []
    while len(buf) >= 5:
        flags, n = struct.unpack(">BI", buf[:5])
        out.append((flags, json.loads(buf[5:5 + n])))
        buf = buf[5 + n:]
    return out


def basic(user: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


# ---------------------------------------------------------------- unary RPCs

def test_list_stat_exists_and_depth(sbx, envd_url, home_dir):
    (home_dir / "d1" / "d2").mkdir(parents=True)
    (home_dir / "d1" / "d2" / "deep.txt").write_text("x")
    (home_dir / "top.txt").write_text("hello")
    os.symlink(home_dir / "top.txt", home_dir / "link")

    names = {e.name for e in sbx.files.list(str(home_dir))}
    assert names == {"d1", "top.txt", "link"}
    # depth 0 (the SDK refuses to send it) is treated as 1; paths are absolute
    r = httpx.post(f"{envd_url}/filesystem.Filesystem/ListDir", headers=UNARY,
                   json={"path": str(home_dir), "depth": 0})
    assert {e["path"] for e in r.json()["entries"]} == {str(home_dir / n) for n in names}
    deep = {e.path for e in sbx.files.list(str(home_dir), depth=3)}
    assert str(home_dir / "d1" / "d2" / "deep.txt") in deep
    assert str(home_dir / "d1" / "d2" / "deep.txt") not in {
        e.path for e in sbx.files.list(str(home_dir), depth=2)}

    info = sbx.files.get_info(str(home_dir / "top.txt"))
    assert (info.type, info.size, info.owner, info.permissions) == (FileType.FILE, 5, "root",
                                                                    "-rw-r--r--")
    link = sbx.files.get_info(str(home_dir / "link"))
    # E2B reports a link's target type (tests/envd/test_parity_envd.py has the details)
    assert link.type == FileType.FILE
    assert link.symlink_target == str(home_dir / "top.txt")
    # relative and ~ paths resolve against the user's home
    rel = home_dir.relative_to(USER.pw_dir)
    assert sbx.files.get_info(f"{rel}/top.txt").path == str(home_dir / "top.txt")
    assert sbx.files.get_info(f"~/{rel}").type == FileType.DIR
    assert sbx.files.exists(str(home_dir / "top.txt"))
    assert not sbx.files.exists(str(home_dir / "nope"))


def test_not_found_and_not_a_dir(sbx, home_dir):
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(str(home_dir / "missing"))
    with pytest.raises(FileNotFoundException):
        sbx.files.list(str(home_dir / "missing"))
    (home_dir / "f").write_text("x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.list(str(home_dir / "f"))


def test_make_dir_chowns_and_reports_existing(sbx, home_dir):
    target = home_dir / "a" / "b" / "c"
    assert sbx.files.make_dir(str(target)) is True
    assert sbx.files.make_dir(str(target)) is False  # already_exists
    for p in (home_dir / "a", home_dir / "a" / "b", target):
        st = p.stat()
        assert (st.st_uid, st.st_gid) == (USER.pw_uid, USER.pw_gid), p
    (home_dir / "file").write_text("x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.make_dir(str(home_dir / "file"))


def test_make_dir_as_root_is_owned_by_root(sbx, home_dir):
    assert sbx.files.make_dir(str(home_dir / "r"), user="root") is True
    assert (home_dir / "r").stat().st_uid == 0


def test_permission_denied_as_user(sbx, home_dir):
    target = f"/etc/envd-test-{uuid.uuid4().hex[:6]}"
    with pytest.raises(SandboxException) as exc:
        sbx.files.make_dir(target)
    assert "permission" in str(exc.value).lower()
    assert not os.path.exists(target)
    with pytest.raises(SandboxException):
        sbx.files.list("/root")
    # root may do both
    assert sbx.files.make_dir(target, user="root") is True
    os.rmdir(target)


def test_rename_and_remove(sbx, home_dir):
    (home_dir / "m1.txt").write_text("1")
    entry = sbx.files.rename(str(home_dir / "m1.txt"), str(home_dir / "new" / "m1.txt"))
    assert entry.path == str(home_dir / "new" / "m1.txt") and entry.type == FileType.FILE
    assert (home_dir / "new" / "m1.txt").read_text() == "1"
    assert not (home_dir / "m1.txt").exists()
    with pytest.raises(FileNotFoundException):
        sbx.files.rename(str(home_dir / "gone"), str(home_dir / "x"))
    (home_dir / "new" / "sub").mkdir()
    sbx.files.remove(str(home_dir / "new"))
    assert not (home_dir / "new").exists()
    sbx.files.remove(str(home_dir / "new"))  # already gone: done, no error (issue 14 #2)
    sbx.files.remove(str(home_dir / "never" / "was"))
    assert not (home_dir / "new").exists()


def test_unknown_user_is_unauthenticated(envd_url, home_dir):
    r = httpx.post(f"{envd_url}/filesystem.Filesystem/Stat", headers={**UNARY, **basic("nobody-x")},
                   json={"path": str(home_dir)})
    assert r.status_code == 401
    assert r.json()["code"] == "unauthenticated" and "nobody-x" in r.json()["message"]


def test_symlink_wire_fields(envd_url, home_dir):
    # as E2B's envd: a link it cannot resolve is UNSPECIFIED (omitted), its target is its
    # own path, and there is no isSymlink (more in test_parity_envd.py)
    os.symlink("/nonexistent-target", home_dir / "dangling")
    r = httpx.post(f"{envd_url}/filesystem.Filesystem/Stat", headers=UNARY,
                   json={"path": str(home_dir / "dangling")})
    entry = r.json()["entry"]
    assert "type" not in entry and "isSymlink" not in entry
    assert entry["symlinkTarget"] == str(home_dir / "dangling")


# ---------------------------------------------------------------- watchers

def test_watch_dir_polling(sbx, home_dir):
    mkdir_user(home_dir / "sub")
    handle = sbx.files.watch_dir(str(home_dir), recursive=True)
    try:
        sbx.files.write(str(home_dir / "sub" / "watched.txt"), "x")
        (home_dir / "plain.txt").write_text("y")
        os.remove(home_dir / "plain.txt")
        events = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            events += handle.get_new_events()
            kinds = {(e.name, e.type.name) for e in events}
            if ("plain.txt", "REMOVE") in kinds:
                break
            time.sleep(0.1)
        kinds = {(e.name, e.type.name) for e in events}
        assert ("sub/watched.txt", "CREATE") in kinds
        assert ("sub/watched.txt", "WRITE") in kinds
        assert ("plain.txt", "CREATE") in kinds and ("plain.txt", "REMOVE") in kinds
        assert not any(".envd-upload-" in e.name for e in events)  # temp files stay hidden
        assert handle.get_new_events() == []  # cleared by the previous poll
    finally:
        handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()  # removed watcher -> not_found


def test_watcher_errors(envd_url, home_dir):
    base = f"{envd_url}/filesystem.Filesystem"
    r = httpx.post(f"{base}/GetWatcherEvents", headers=UNARY, json={"watcherId": "nope"})
    assert (r.status_code, r.json()["code"]) == (404, "not_found")
    r = httpx.post(f"{base}/RemoveWatcher", headers=UNARY, json={"watcherId": "nope"})
    assert (r.status_code, r.json()["code"]) == (404, "not_found")
    r = httpx.post(f"{base}/CreateWatcher", headers=UNARY, json={"path": str(home_dir / "x")})
    assert r.json()["code"] == "not_found"
    (home_dir / "f").write_text("")
    r = httpx.post(f"{base}/CreateWatcher", headers=UNARY, json={"path": str(home_dir / "f")})
    assert r.json()["code"] == "invalid_argument"


def test_watch_dir_stream_errors_and_keepalive(envd_url, home_dir):
    url = f"{envd_url}/filesystem.Filesystem/WatchDir"
    for path, code in ((home_dir / "missing", "not_found"), (home_dir / "f", "invalid_argument")):
        (home_dir / "f").write_text("")
        r = httpx.post(url, headers=STREAM, content=envelope({"path": str(path)}))
        assert r.status_code == 200
        [(flags, end)] = read_envelopes(r.content)
        assert flags == 2 and end["error"]["code"] == code

    headers = {**STREAM, "Keepalive-Ping-Interval": "0.2", "Connect-Timeout-Ms": "1500"}
    (home_dir / "d").mkdir()
    with httpx.Client(timeout=10) as client:
        r = client.post(url, headers=headers,
                        content=envelope({"path": str(home_dir / "d"), "includeEntry": True}))
    frames = read_envelopes(r.content)
    assert frames[0] == (0, {"start": {}})
    assert sum(1 for f, m in frames if m == {"keepalive": {}}) >= 3
    flags, end = frames[-1]
    assert flags == 2 and end["error"]["code"] == "deadline_exceeded"


def _inotify_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                n += 1
        except OSError:
            pass
    return n


def test_watch_dir_stream_ends_on_disconnect(envd_instance, home_dir):
    envd_url, proc = envd_instance
    pid = proc.pid
    before = _inotify_fds(pid)
    with httpx.Client(timeout=10) as client, client.stream(
        "POST", f"{envd_url}/filesystem.Filesystem/WatchDir",
        headers={**STREAM, "Keepalive-Ping-Interval": "50"},
        content=envelope({"path": str(home_dir)}),
    ) as r:
        chunks = r.iter_raw()  # keep a reference: a collected iterator closes the response
        assert read_envelopes(next(chunks))[0] == (0, {"start": {}})
        assert _inotify_fds(pid) == before + 1
    # The client left with the watch idle: envd must notice well before the 50 s keepalive.
    deadline = time.monotonic() + 3
    while _inotify_fds(pid) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _inotify_fds(pid) == before


async def test_async_watch_dir_stream(sdk_env, home_dir):
    sbx = await AsyncSandbox.create()
    events = []
    handle = await sbx.files.watch_dir(str(home_dir), events.append, recursive=True,
                                       include_entry=True, timeout=30)
    try:
        mkdir_user(home_dir / "nested")
        # envd adds the new subdirectory's watch before it reports the directory's CREATE
        for _ in range(100):
            if any(e.name == "nested" for e in events):
                break
            await asyncio.sleep(0.05)
        await sbx.files.write(str(home_dir / "nested" / "async.txt"), "abc")
        for _ in range(100):  # stat for include_entry races a rename that follows too fast
            if any(e.name == "nested/async.txt" and e.type.name == "WRITE" for e in events):
                break
            await asyncio.sleep(0.05)
        await sbx.files.rename(str(home_dir / "nested" / "async.txt"), str(home_dir / "moved.txt"))
        for _ in range(50):
            if any(e.name == "moved.txt" for e in events):
                break
            await asyncio.sleep(0.1)
    finally:
        await handle.stop()
    by_key = {(e.name, e.type.name): e for e in events}
    assert ("nested", "CREATE") in by_key
    written = by_key[("nested/async.txt", "WRITE")]
    assert written.entry is not None and written.entry.size == 3
    assert ("nested/async.txt", "RENAME") in by_key
    assert by_key[("moved.txt", "CREATE")].entry.path == str(home_dir / "moved.txt")
