"""GET/POST /files through the real Python SDK and raw HTTP (httpx, sockets).

Covers the wire details of spec §4.5 and the all-or-nothing upload guarantee: a
failed or aborted upload leaves no partial file and the previous content intact.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pwd
import socket
import subprocess
import time
import zlib
from pathlib import Path

import httpx
import pytest
from e2b import FileNotFoundException, Sandbox
from e2b.exceptions import AuthenticationException, InvalidArgumentException, SandboxException

from tests.envd.test_http_endpoints import private_envd

USER = pwd.getpwnam("user")


@pytest.fixture(scope="module")
def envd_url():
    """A private envd for this module: parallel suites restart the shared 49983 instance."""
    with private_envd() as (url, _):
        yield url


@pytest.fixture
def sbx(sdk_env):
    return Sandbox.create()


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".envd-upload-")]


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ---------------------------------------------------------------- SDK round trips

def test_write_read_text_bytes_stream(sbx, home_dir):
    target = home_dir / "dir" / "a.txt"
    info = sbx.files.write(str(target), "hello")
    assert (info.path, info.name) == (str(target), "a.txt")
    assert sbx.files.read(str(target)) == "hello"
    rel = target.relative_to(USER.pw_dir)
    assert sbx.files.read(str(rel), format="bytes") == bytearray(b"hello")
    assert sbx.files.read(f"~/{rel}") == "hello"
    # created file and parents belong to the user
    for p in (target, target.parent):
        assert (p.stat().st_uid, p.stat().st_gid) == (USER.pw_uid, USER.pw_gid)

    blob = os.urandom(3 * 1024 * 1024 + 17)
    sbx.files.write(str(home_dir / "big.bin"), io.BytesIO(blob))  # octet-stream, streamed
    with sbx.files.read(str(home_dir / "big.bin"), format="stream") as stream:
        assert b"".join(stream) == blob
    sbx.files.write(str(home_dir / "empty"), b"")
    assert sbx.files.read(str(home_dir / "empty"), format="bytes") == bytearray()


def test_gzip_both_ways(sbx, home_dir, envd_url):
    text = "zipped " * 5000
    sbx.files.write(str(home_dir / "gz.txt"), text, gzip=True)  # Content-Encoding: gzip
    assert (home_dir / "gz.txt").read_text() == text
    assert sbx.files.read(str(home_dir / "gz.txt"), gzip=True) == text

    raw = httpx.get(f"{envd_url}/files", params={"path": str(home_dir / "gz.txt")},
                    headers={"Accept-Encoding": "gzip"})
    assert raw.headers["content-encoding"] == "gzip"
    assert len(raw.content) == len(text)  # httpx decoded it
    # A transport's generic default gets the plain bytes with a length.
    plain = httpx.get(f"{envd_url}/files", params={"path": str(home_dir / "gz.txt")},
                      headers={"Accept-Encoding": "gzip, deflate, br"})
    assert "content-encoding" not in plain.headers
    assert plain.headers["content-length"] == str(len(text))
    assert plain.headers["content-type"] == "application/octet-stream"
    refused = httpx.get(f"{envd_url}/files", params={"path": str(home_dir / "gz.txt")},
                        headers={"Accept-Encoding": "br, identity;q=0"})
    assert refused.status_code == 406 and refused.json()["code"] == 406


def test_write_files_and_full_path_filenames(sbx, home_dir, envd_url):
    infos = sbx.files.write_files([
        {"path": str(home_dir / "m1.txt"), "data": "1"},
        {"path": str(home_dir / "sub" / "m2.bin"), "data": b"\x00\x01"},
    ])
    assert [i.path for i in infos] == [str(home_dir / "m1.txt"), str(home_dir / "sub" / "m2.bin")]
    assert (home_dir / "sub" / "m2.bin").read_bytes() == b"\x00\x01"

    # Raw multipart: the part filename is a full path and must not be reduced to a basename;
    # parts not named `file` are ignored.
    rel = (home_dir / "deep" / "x.txt").relative_to(USER.pw_dir)
    r = httpx.post(f"{envd_url}/files", files=[
        ("file", (str(home_dir / "nested" / "y.txt"), b"y")),
        ("other", ("ignored.txt", b"ignored")),
        ("file", (str(rel), b"x")),
    ])
    assert r.status_code == 200, r.text
    assert [e["path"] for e in r.json()] == [str(home_dir / "nested" / "y.txt"),
                                            str(home_dir / "deep" / "x.txt")]
    assert r.json()[0] == {"path": str(home_dir / "nested" / "y.txt"), "name": "y.txt",
                           "type": "file"}
    assert (home_dir / "nested" / "y.txt").read_bytes() == b"y"
    assert not (home_dir / "ignored.txt").exists()

    # the `path` query wins over the part filename
    r = httpx.post(f"{envd_url}/files", params={"path": str(home_dir / "query.txt")},
                   files={"file": ("/home/user/elsewhere.txt", b"q")})
    assert r.status_code == 200 and r.json()[0]["path"] == str(home_dir / "query.txt")
    assert not Path("/home/user/elsewhere.txt").exists()


def test_metadata(sbx, home_dir):
    target = str(home_dir / "meta.txt")
    info = sbx.files.write(target, "x", metadata={"Owner": "acc", "run": "1"})
    assert info.metadata == {"owner": "acc", "run": "1"}
    assert sbx.files.get_info(target).metadata == {"owner": "acc", "run": "1"}
    sbx.files.write(target, "y", metadata={"other": "2"})  # replaces the previous set
    assert sbx.files.get_info(target).metadata == {"other": "2"}
    written = sbx.files.write(target, "z")  # no metadata: the overwrite clears it, as E2B
    assert not written.metadata and not sbx.files.get_info(target).metadata
    with pytest.raises(InvalidArgumentException):
        sbx.files.write(target, "x", metadata={"bad key": "v"})  # rejected by the SDK already


def test_overwrite_keeps_mode(sbx, home_dir):
    target = home_dir / "secret"
    sbx.files.write(str(target), "one")
    os.chmod(target, 0o600)
    sbx.files.write(str(target), "two")
    assert target.read_text() == "two" and (target.stat().st_mode & 0o777) == 0o600


# ---------------------------------------------------------------- errors

def test_download_errors(sbx, home_dir, envd_url):
    with pytest.raises(FileNotFoundException):
        sbx.files.read(str(home_dir / "nope"))
    r = httpx.get(f"{envd_url}/files", params={"path": str(home_dir / "nope")})
    assert r.status_code == 404
    assert r.json() == {"code": 404, "message": f"path '{home_dir / 'nope'}' does not exist"}
    r = httpx.get(f"{envd_url}/files", params={"path": str(home_dir)})
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.get(f"{envd_url}/files", params={"path": "/etc/hostname", "username": "no-such-u"})
    assert r.status_code == 401 and "no-such-u" in r.json()["message"]
    with pytest.raises(AuthenticationException):
        sbx.files.read("/etc/hostname", user="no-such-u")
    # /root is not readable by `user`
    r = httpx.get(f"{envd_url}/files", params={"path": "/root/.bashrc"})
    assert r.status_code in (403, 404)


def test_upload_failure_leaves_nothing(sbx, home_dir):
    # Uploads run with envd's rights like E2B's (root-owned places are writable, see
    # test_parity_envd.py); what still fails must leave no file and no new directory.
    (home_dir / "plain").write_text("a file in the way of a directory")
    target = home_dir / "plain" / "x.txt"
    with pytest.raises(InvalidArgumentException) as exc:  # 400
        sbx.files.write(str(target), "nope")
    assert str(target) in str(exc.value)
    assert sorted(p.name for p in home_dir.iterdir()) == ["plain"]
    sbx.files.write(str(home_dir / "ok.txt"), "yes", user="root")
    assert (home_dir / "ok.txt").stat().st_uid == 0


@pytest.mark.parametrize("headers, body, query", [
    ({"Content-Type": "application/octet-stream"}, b"data", {}),                 # no path
    ({"Content-Type": "text/plain"}, b"data", {"path": "x"}),                   # wrong type
    ({}, b"data", {"path": "x"}),                                                # no type
    ({"Content-Type": "multipart/form-data"}, b"--b\r\n", {"path": "x"}),       # no boundary
    ({"Content-Type": "multipart/form-data; boundary=b"},                       # unterminated
     b'--b\r\nContent-Disposition: form-data; name="file"; filename="x"\r\n\r\nabc', {}),
    ({"Content-Type": "multipart/form-data; boundary=b"},                       # garbage
     b"--bXX\r\n\r\n", {}),
    ({"Content-Type": "multipart/form-data; boundary=b"}, b"--b--\r\n", {}),    # no parts
    ({"Content-Type": "multipart/form-data; boundary=b"},                       # no filename
     b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nabc\r\n--b--\r\n', {}),
    ({"Content-Type": "application/octet-stream", "Content-Encoding": "br"}, b"x", {"path": "x"}),
    ({"Content-Type": "application/octet-stream", "X-Metadata-k": b"caf\xe9"}, b"x", {"path": "x"}),
])
def test_bad_uploads_are_400(envd_url, home_dir, headers, body, query):
    if "path" in query:
        query = {"path": str(home_dir / query["path"])}
    r = httpx.post(f"{envd_url}/files", params=query, headers=headers, content=body)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == 400 and r.json()["message"]
    assert list(home_dir.iterdir()) == []


def test_duplicate_destination_and_bad_gzip_keep_old_content(envd_url, home_dir):
    target = home_dir / "keep.txt"
    target.write_text("old")
    r = httpx.post(f"{envd_url}/files", files=[("file", (str(target), b"new1")),
                                                ("file", (str(target), b"new2"))])
    assert r.status_code == 400 and "more than once" in r.json()["message"]
    assert target.read_text() == "old"

    broken = gzip.compress(b"new content" * 1000)[:-20]  # truncated stream
    r = httpx.post(f"{envd_url}/files", params={"path": str(target)}, content=broken,
                   headers={"Content-Type": "application/octet-stream",
                            "Content-Encoding": "gzip"})
    assert r.status_code == 400 and "gzip" in r.json()["message"]
    r = httpx.post(f"{envd_url}/files", params={"path": str(target)}, content=b"not gzip at all",
                   headers={"Content-Type": "application/octet-stream",
                            "Content-Encoding": "gzip"})
    assert r.status_code == 400
    assert target.read_text() == "old"
    assert sorted(p.name for p in home_dir.iterdir()) == ["keep.txt"]


def _raw_upload_then_hang_up(url: str, head: bytes, body_bytes: int, chunk: bytes) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head)
        sent = 0
        while sent < body_bytes:
            sock.sendall(chunk)
            sent += len(chunk)


@pytest.mark.parametrize("kind", ["octet-stream", "multipart-chunked"])
def test_aborted_upload_leaves_old_content(envd_url, home_dir, kind):
    target = home_dir / "big.bin"
    target.write_bytes(b"previous content")
    path = str(target)
    mib = b"\xab" * (1024 * 1024)
    if kind == "octet-stream":
        head = (f"POST /files?path={path} HTTP/1.1\r\nHost: x\r\n"
                "Content-Type: application/octet-stream\r\n"
                f"Content-Length: {64 * len(mib)}\r\n\r\n").encode()
        _raw_upload_then_hang_up(envd_url, head, 8 * len(mib), mib)
    else:
        part = (f'--bnd\r\nContent-Disposition: form-data; name="file"; filename="{path}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n").encode()
        head = (b"POST /files HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                b"Content-Type: multipart/form-data; boundary=bnd\r\n\r\n")
        head += f"{len(part):x}\r\n".encode() + part + b"\r\n"
        _raw_upload_then_hang_up(envd_url, head, 8 * len(mib),
                                 f"{len(mib):x}\r\n".encode() + mib + b"\r\n")
    # envd notices the hang-up and drops its temp file; the old content never changed.
    # (While the upload ran, the temp file was hidden from listings.)
    assert wait_until(lambda: not leftovers(home_dir)), leftovers(home_dir)
    assert target.read_bytes() == b"previous content"
    assert sorted(p.name for p in home_dir.iterdir()) == ["big.bin"]


@pytest.fixture
def tiny_fs(home_dir):
    """A 1 MiB tmpfs mounted inside home_dir, writable by `user` (skips if mount fails)."""
    mnt = home_dir / "tiny"
    mnt.mkdir()
    options = f"size=1m,uid={USER.pw_uid},gid={USER.pw_gid}"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                       capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_no_space_is_507_and_leaves_nothing(sbx, tiny_fs):
    (tiny_fs / "f.bin").write_bytes(b"old")
    with pytest.raises(SandboxException) as exc:
        sbx.files.write(str(tiny_fs / "f.bin"), io.BytesIO(os.urandom(3 * 1024 * 1024)))
    assert type(exc.value).__name__ == "NotEnoughSpaceException" or "507" in str(exc.value)
    assert (tiny_fs / "f.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["f.bin"]


def test_large_roundtrip_checksum(sbx, home_dir, envd_url):
    size = 40 * 1024 * 1024
    src = home_dir / "src.bin"
    with open(src, "wb") as f:
        f.writelines(os.urandom(1024 * 1024) for _ in range(size // (1024 * 1024)))
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    with open(src, "rb") as f:
        sbx.files.write(str(home_dir / "dst.bin"), f)
    assert hashlib.sha256((home_dir / "dst.bin").read_bytes()).hexdigest() == digest
    h = hashlib.sha256()
    with httpx.stream("GET", f"{envd_url}/files", params={"path": str(home_dir / "dst.bin")}) as r:
        assert r.headers["content-length"] == str(size)
        for chunk in r.iter_raw():
            h.update(chunk)
    assert h.hexdigest() == digest
    # gzip download of the same data decodes to the same bytes
    inflater = zlib.decompressobj(31)
    h2 = hashlib.sha256()
    with httpx.stream("GET", f"{envd_url}/files", params={"path": str(home_dir / "dst.bin")},
                      headers={"Accept-Encoding": "gzip"}) as r:
        for chunk in r.iter_raw():
            h2.update(inflater.decompress(chunk))
    assert inflater.eof and h2.hexdigest() == digest


def test_upload_through_symlink_keeps_the_link(sbx, home_dir):
    real = home_dir / "real.txt"
    real.write_text("old")
    os.chown(real, USER.pw_uid, USER.pw_gid)
    os.symlink(real, home_dir / "link.txt")
    info = sbx.files.write(str(home_dir / "link.txt"), "new")
    assert info.path == str(home_dir / "link.txt")
    assert (home_dir / "link.txt").is_symlink() and real.read_text() == "new"


async def test_async_sdk_files(sdk_env, home_dir):
    from e2b import AsyncSandbox

    sbx = await AsyncSandbox.create()
    target = str(home_dir / "a" / "async.txt")
    await sbx.files.write(target, "hello async", metadata={"k": "v"})
    assert await sbx.files.read(target) == "hello async"
    assert await sbx.files.read(target, format="bytes") == bytearray(b"hello async")
    stream = await sbx.files.read(target, format="stream")
    assert b"".join([chunk async for chunk in stream]) == b"hello async"
    await sbx.files.write(str(home_dir / "gz.txt"), "z" * 10000, gzip=True)
    assert await sbx.files.read(str(home_dir / "gz.txt"), gzip=True) == "z" * 10000
    await sbx.files.write_files([{"path": str(home_dir / "m1"), "data": b"1"},
                                 {"path": str(home_dir / "m2"), "data": "2"}])
    assert {e.name for e in await sbx.files.list(str(home_dir))} == {"a", "gz.txt", "m1", "m2"}
    assert (await sbx.files.get_info(target)).metadata == {"k": "v"}
    assert await sbx.files.make_dir(str(home_dir / "d")) is True
    assert await sbx.files.make_dir(str(home_dir / "d")) is False
    moved = await sbx.files.rename(str(home_dir / "m1"), str(home_dir / "d" / "m1"))
    assert moved.path == str(home_dir / "d" / "m1")
    await sbx.files.remove(str(home_dir / "d"))
    assert not await sbx.files.exists(str(home_dir / "d"))
    with pytest.raises(FileNotFoundException):
        await sbx.files.read(str(home_dir / "nope"))


def test_upload_in_progress_is_hidden_from_listings(sbx, envd_url, home_dir):
    host, port = envd_url.removeprefix("http://").split(":")
    path = str(home_dir / "slow.bin")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall((f"POST /files?path={path} HTTP/1.1\r\nHost: x\r\n"
                      "Content-Type: application/octet-stream\r\n"
                      f"Content-Length: {4 * 1024 * 1024}\r\n\r\n").encode())
        sock.sendall(b"\0" * (2 * 1024 * 1024))
        assert wait_until(lambda: bool(leftovers(home_dir)))  # the temp file exists on disk
        assert [e.name for e in sbx.files.list(str(home_dir))] == []
        assert not sbx.files.exists(path)
    assert wait_until(lambda: not leftovers(home_dir))


def test_read_proc_and_sys_files_whose_size_says_nothing(sbx):
    """Issue 14 item 1: procfs files report size 0 and sysfs files a page; the SDK gets
    their content (E2B reads them to EOF)."""
    boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id")
    assert boot_id.strip() == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert len(boot_id.strip()) == 36
    meminfo = sbx.files.read("/proc/meminfo")
    assert meminfo.startswith("MemTotal:") and "MemFree:" in meminfo
    dev = sbx.files.read("/sys/class/net/lo/address")
    assert dev.strip() == "00:00:00:00:00:00"


def test_a_file_that_refuses_reads_is_an_error_status_not_a_cut_response(envd_url):
    """/proc/self/mem opens but every read fails (EIO): envd reads the first block before
    it answers, so the client gets a 400 naming the path instead of a 200 whose body is
    cut off (found by the fuzz run, tests/e2e/test_fuzz.py)."""
    r = httpx.get(f"{envd_url}/files", params={"path": "/proc/self/mem", "username": "root"},
                  timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["message"].startswith("cannot read '/proc/self/mem'")
