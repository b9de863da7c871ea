"""`aenv volume create|ls|rm|put|get|files` against the REST API over a real
NodeOrchestrator (fake runtime: volumes need no VM), served over HTTP
(tests/api/template_service.py); the bytes checked where the service keeps them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from host.cli.rest import ApiClient
from tests.api.conftest import API_KEY

from .conftest import REPO_ROOT, TemplateStack

SIZE = 3 * 1024 * 1024 + 17


def _create(tstack: TemplateStack, name: str) -> str:
    r = tstack.run("volume", "create", name)
    assert r.exit_code == 0, r.output
    return r.stdout.strip()


def _data(tstack: TemplateStack, volume_id: str) -> Path:
    return tstack.svc.node.volumes.data_dir(volume_id)


def test_create_ls_rm(tstack: TemplateStack) -> None:
    vid = _create(tstack, "data-1")
    assert str(uuid.UUID(vid)) == vid
    r = tstack.run("volume", "create", "logs_2", "-o", "json")
    assert r.exit_code == 0, r.output
    made = json.loads(r.stdout)
    assert made["name"] == "logs_2" and made["token"] and made["volumeID"] != vid

    r = tstack.run("volume", "ls")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["VOLUME", "ID", "NAME"]
    assert [line.split() for line in lines[1:]] == [[vid, "data-1"],
                                                     [made["volumeID"], "logs_2"]]
    r = tstack.run("volume", "ls", "-o", "json")
    assert json.loads(r.stdout) == [{"volumeID": vid, "name": "data-1"},
                                    {"volumeID": made["volumeID"], "name": "logs_2"}]

    # by name, then by id (any case)
    r = tstack.run("volume", "rm", "data-1")
    assert (r.exit_code, r.output) == (0, "")
    assert not _data(tstack, vid).exists()
    assert tstack.run("volume", "rm", made["volumeID"].upper()).exit_code == 0
    r = tstack.run("volume", "ls", "-o", "json")
    assert json.loads(r.stdout) == []
    assert tstack.run("volume", "ls").stdout.splitlines() == ["VOLUME ID  NAME"]


def test_unknown_volume_and_taken_name(tstack: TemplateStack, tmp_path: Path) -> None:
    for missing in ("nope", str(uuid.uuid4())):
        r = tstack.run("volume", "rm", missing)
        assert r.exit_code == 4
        assert r.stderr == f"aenv: volume '{missing}' not found (see `aenv volume ls`)\n"
    src = tmp_path / "a.txt"
    src.write_text("a")
    r = tstack.run("volume", "put", "nope", str(src), "/a.txt")
    assert r.exit_code == 4 and "volume 'nope' not found" in r.stderr

    _create(tstack, "data-1")
    r = tstack.run("volume", "create", "data-1")
    assert r.exit_code == 1
    assert r.stderr == "aenv: API error 400: Volume with name 'data-1' already exists\n"
    r = tstack.run("volume", "create", "bad name")
    assert r.exit_code == 1 and "Invalid volume name: 'bad name'" in r.stderr
    assert len(json.loads(tstack.run("volume", "ls", "-o", "json").stdout)) == 1


def test_put_get_round_trip(tstack: TemplateStack, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    vid = _create(tstack, "data-1")
    data = os.urandom(SIZE)
    src = tmp_path / "big.bin"
    src.write_bytes(data)

    # --force makes the missing directory; -o json: the new file's entry
    r = tstack.run("volume", "put", "data-1", str(src), "/in/big.bin", "--force", "-o", "json")
    assert r.exit_code == 0, r.output
    entry = json.loads(r.stdout)
    assert (entry["path"], entry["type"], entry["size"]) == ("/in/big.bin", "file", SIZE)
    assert (entry["uid"], entry["gid"], entry["mode"]) == (9090, 9090, 0o666)
    assert r.stderr == ""  # no terminal: no bar, no summary
    assert (_data(tstack, vid) / "in" / "big.bin").read_bytes() == data

    # to a file (by id), into a directory, to stdout, to the current directory
    dst = tmp_path / "back.bin"
    r = tstack.run("volume", "get", vid, "/in/big.bin", str(dst))
    assert (r.exit_code, r.output) == (0, "")
    assert dst.read_bytes() == data
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert tstack.run("volume", "get", "data-1", "/in/big.bin", str(out_dir)).exit_code == 0
    assert (out_dir / "big.bin").read_bytes() == data
    assert [p.name for p in out_dir.iterdir()] == ["big.bin"]  # no temp file left
    r = tstack.run("volume", "get", "data-1", "/in/big.bin", "-")
    assert r.exit_code == 0 and r.stdout_bytes == data
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert tstack.run("volume", "get", "data-1", "in/big.bin").exit_code == 0
    assert (cwd / "big.bin").read_bytes() == data


def test_put_refuses_an_existing_file_without_force(tstack: TemplateStack,
                                                    tmp_path: Path) -> None:
    vid = _create(tstack, "data-1")
    first, second = os.urandom(SIZE), os.urandom(SIZE)
    src = tmp_path / "f.bin"
    src.write_bytes(first)
    assert tstack.run("volume", "put", "data-1", str(src), "/f.bin").exit_code == 0
    src.write_bytes(second)

    r = tstack.run("volume", "put", "data-1", str(src), "/f.bin")
    assert r.exit_code == 5
    assert r.stderr == ("aenv: API error 409: path '/f.bin' already exists: pass --force "
                        "to replace it\n")
    assert (_data(tstack, vid) / "f.bin").read_bytes() == first
    assert os.listdir(_data(tstack, vid).parent / "staging") == []  # the upload dropped

    r = tstack.run("volume", "put", "data-1", str(src), "/f.bin", "--force")
    assert r.exit_code == 0, r.output
    assert (_data(tstack, vid) / "f.bin").read_bytes() == second

    # no --force: a missing directory is not made
    r = tstack.run("volume", "put", "data-1", str(src), "/no/f.bin")
    assert r.exit_code == 4
    assert r.stderr == ("aenv: API error 404: path '/no/f.bin' not found: its directory "
                        "does not exist (--force makes it)\n")
    assert not (_data(tstack, vid) / "no").exists()


def test_get_of_a_missing_path(tstack: TemplateStack, tmp_path: Path) -> None:
    _create(tstack, "data-1")
    out = tmp_path / "out"
    out.mkdir()
    r = tstack.run("volume", "get", "data-1", "/nope.bin", str(out / "x.bin"))
    assert r.exit_code == 4
    assert r.stderr == ("aenv: API error 404: path '/nope.bin' not found "
                        "(see `aenv volume files`)\n")
    assert list(out.iterdir()) == []  # neither the file nor a temp file
    r = tstack.run("volume", "get", "data-1", "/nope.bin", "-")
    assert r.exit_code == 4 and r.stdout == ""


def test_files_and_put_options(tstack: TemplateStack, tmp_path: Path) -> None:
    vid = _create(tstack, "data-1")
    src = tmp_path / "a.txt"
    src.write_text("hello")
    r = tstack.run("volume", "put", "data-1", str(src), "/d/", "--force", "--mode", "0640",
                   "--uid", "1000", "--gid", "1001")
    assert r.exit_code == 0, r.output
    st = (_data(tstack, vid) / "d" / "a.txt").stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o640, 1000, 1001)
    r = tstack.run("volume", "put", "data-1", str(src), "/a.txt", "--mode", "999")
    assert r.exit_code == 2 and "'999' is not an octal mode" in r.stderr

    r = tstack.run("volume", "files", "data-1")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["TYPE", "MODE", "UID", "GID", "SIZE", "MODIFIED", "PATH"]
    assert len(lines) == 2 and lines[1].split()[:4] == ["directory", "0777", "1000", "1001"]
    assert lines[1].split()[-1] == "/d"
    r = tstack.run("volume", "files", "data-1", "/", "--depth", "2", "-o", "json")
    listed = json.loads(r.stdout)
    assert [(e["path"], e["type"]) for e in listed] == [("/d", "directory"),
                                                        ("/d/a.txt", "file")]
    assert (listed[1]["size"], listed[1]["mode"], listed[1]["uid"]) == (5, 0o640, 1000)
    r = tstack.run("volume", "files", "data-1", "/d", "-o", "json")
    assert [e["name"] for e in json.loads(r.stdout)] == ["a.txt"]
    r = tstack.run("volume", "files", "data-1", "/missing")
    assert r.exit_code == 4 and "path '/missing' not found" in r.stderr


def test_content_goes_with_the_volume_token(tstack: TemplateStack, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The file calls carry the token GET /volumes/{id} gives (not the API key): another
    volume's token is refused, and the message does not blame the API key."""
    _create(tstack, "data-1")
    r = tstack.run("volume", "create", "other", "-o", "json")
    other_token = json.loads(r.stdout)["token"]
    real = ApiClient.volume

    def wrong_token(self: ApiClient, volume_id: str):  # type: ignore[no-untyped-def]
        found = real(self, volume_id)
        return found.model_copy(update={"token": other_token})

    monkeypatch.setattr(ApiClient, "volume", wrong_token)
    r = tstack.run("volume", "files", "data-1")
    assert r.exit_code == 3
    assert r.stderr == ("aenv: API error 401: invalid or expired volume token; get a new one "
                        "with Volume.connect: the volume's token was refused; try again\n")
    monkeypatch.setattr(ApiClient, "volume", real)
    assert tstack.run("volume", "files", "data-1").exit_code == 0


@pytest.mark.skipif(sys.platform != "linux", reason="needs a Linux pty")
def test_progress_bar_on_a_terminal(tstack: TemplateStack, tmp_path: Path) -> None:
    import pty
    import select

    _create(tstack, "data-1")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(SIZE))
    env = {**os.environ, "AENV_API_URL": tstack.svc.url, "AENV_API_KEY": API_KEY,
           "TERM": "xterm-256color", "COLUMNS": "120"}
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "host.cli", "volume", "put", "data-1",
                             str(src), "/big.bin"], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    buf = bytearray()
    try:
        while select.select([master], [], [], 60)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: aenv closed the pty
                break
            if not chunk:
                break
            buf += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    shown = bytes(buf).decode(errors="replace")
    assert proc.wait(timeout=30) == 0, shown
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)
    assert "big.bin ↑" in plain and re.search(r"3\.1/3\.1 MB", plain), shown
    assert f"{src} -> data-1:/big.bin ({SIZE} bytes)" in plain
