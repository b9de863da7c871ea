"""Issue 14 parity items 3, 5, 6 and 8 against envd on this host, through the real Python
SDK (tests/envd/parity_checks.py, which names E2B's Go code behind each expectation) and
the real JS SDK (tests/js/parity.mjs). The same checks run in a VM from
tests/e2e/test_parity_envd.py. Here we also look at the wire and at the host filesystem.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox

from tests.envd import parity_checks as checks
from tests.envd.test_http_endpoints import private_envd

USER = pwd.getpwnam("user")
UNARY = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
JS_DIR = Path(__file__).resolve().parents[1] / "js"


@pytest.fixture(scope="module")
def envd_url():
    """A private envd for this module: parallel suites restart the shared 49983 instance."""
    with private_envd() as (url, _):
        yield url


@pytest.fixture
def sbx(sdk_env):
    return Sandbox.create()


@pytest.fixture
async def asbx(sdk_env):
    return await AsyncSandbox.create()


def no_upload_leftovers(root: Path) -> bool:
    return not [p for p in root.rglob(".envd-upload-*")]


# ---------------------------------------------------------------- item 3: symlinks

def test_symlinks_report_their_target_like_e2b(sbx, home_dir):
    checks.check_symlink_entries(sbx, str(home_dir))


def test_symlink_wire_fields_like_e2b(envd_url, home_dir):
    """E2B's EntryInfo has no isSymlink; an unresolvable link is FILE_TYPE_UNSPECIFIED (the
    default, so absent from the JSON) with its own path as target and mode 0."""
    os.symlink("/nonexistent-target", home_dir / "dangling")
    os.symlink("/etc", home_dir / "etc")
    entry = httpx.post(f"{envd_url}/filesystem.Filesystem/Stat", headers=UNARY,
                       json={"path": str(home_dir / "dangling")}).json()["entry"]
    assert "type" not in entry and "isSymlink" not in entry and "mode" not in entry
    assert entry["symlinkTarget"] == str(home_dir / "dangling")
    assert entry["permissions"] == "Lrwxrwxrwx"
    entry = httpx.post(f"{envd_url}/filesystem.Filesystem/Stat", headers=UNARY,
                       json={"path": str(home_dir / "etc")}).json()["entry"]
    assert (entry["type"], entry["symlinkTarget"], entry["mode"]) == \
        ("FILE_TYPE_DIRECTORY", "/etc", 0o755)
    assert "isSymlink" not in entry
    # Go's FileMode.String for special bits: a sticky directory is "dt...", not "d...t"
    entry = httpx.post(f"{envd_url}/filesystem.Filesystem/Stat", headers=UNARY,
                       json={"path": "/tmp"}).json()["entry"]
    assert (entry["permissions"], entry["mode"]) == ("dtrwxrwxrwx", 0o777)


# ---------------------------------------------------------------- item 5: watch events

@pytest.mark.parametrize("recursive", [False, True])
async def test_watch_events_like_e2b(asbx, home_dir, recursive):
    await checks.check_watch_events(asbx, str(home_dir), recursive=recursive)
    assert no_upload_leftovers(home_dir)


def test_polling_watch_events_like_e2b(sbx, home_dir):
    checks.check_polling_watch(sbx, str(home_dir))


async def test_watch_reports_the_watched_dir_itself_like_e2b(asbx, home_dir):
    """fsnotify passes the directory's own IN_ATTRIB and (its parent unwatched) its
    IN_DELETE_SELF on: CHMOD "." and REMOVE "."."""
    root = home_dir / "self"
    root.mkdir()
    os.chown(root, USER.pw_uid, USER.pw_gid)
    events: checks.Recorder = []
    handle = await asbx.files.watch_dir(str(root), lambda e: events.append((e.name, e.type.name)),
                                        timeout=0)
    try:
        root.chmod(0o700)
        shutil.rmtree(root)
        assert await checks._until(lambda: (".", "REMOVE") in events, 10), events
        assert events == [(".", "CHMOD"), (".", "REMOVE")], events
    finally:
        await handle.stop()


# ---------------------------------------------------------------- item 6: PTY re-attach

async def test_pty_output_reaches_a_reattached_handle(asbx):
    await checks.check_pty_reattach(asbx)


def test_pty_output_reaches_a_reattached_handle_sync(sbx):
    checks.check_pty_reattach_sync(sbx)


async def test_pty_input_before_the_shell_is_ready_is_echoed_now_and_run_later(asbx):
    """What a slow guest (TCG) shows after a re-attach: input sent while `bash -i -l` still
    reads its start-up files is echoed at once by the tty's line discipline (canonical
    mode, ECHO), but its output comes only once bash reaches its first prompt. Here the
    start-up is made slow on purpose; the output still reaches the re-attached handle."""
    from e2b import PtySize

    handle = await asbx.pty.create(PtySize(rows=24, cols=80), on_data=lambda _: None, timeout=0,
                                   envs={"PROMPT_COMMAND": "sleep 1.5; unset PROMPT_COMMAND"})
    pid = handle.pid
    try:
        await handle.disconnect()
        seen: list[tuple[float, bytes]] = []
        await asbx.pty.connect(pid, timeout=0,
                               on_data=lambda d: seen.append((time.monotonic(), bytes(d))))
        await asbx.pty.send_stdin(pid, b"echo hi-$((1+1))\n")

        def first(needle: bytes) -> float | None:
            acc = b""
            for at, chunk in seen:
                acc += chunk
                if needle in acc:
                    return at
            return None

        assert await checks._until(lambda: first(b"hi-2") is not None, 15), seen
        echoed, ran = first(b"echo hi-$((1+1))"), first(b"hi-2")
        assert echoed is not None and ran is not None and ran - echoed > 0.5, seen
    finally:
        await asbx.pty.kill(pid)


# ---------------------------------------------------------------- item 8: write_files

def test_write_files_makes_parents_the_user_cannot_like_e2b(sbx, home_dir):
    top = f"/aenv-parity-{uuid.uuid4().hex[:8]}"  # like /0: under /, which is root's
    checks.check_write_files_parents(sbx, str(home_dir), top)
    assert not os.path.exists(top)  # removed by the check
    assert no_upload_leftovers(home_dir)


def test_write_files_all_or_nothing(sbx, home_dir):
    checks.check_write_files_all_or_nothing(sbx, str(home_dir))
    assert no_upload_leftovers(home_dir)


def test_upload_into_root_owned_places_like_e2b(sbx, home_dir):
    """E2B's envd writes as root: a root-owned directory does not stop `user`, and what is
    written (and every directory made for it) is the user's; an existing root-owned file
    keeps its mode and becomes the user's."""
    locked = home_dir / "locked"
    locked.mkdir(mode=0o755)  # root's
    (locked / "old.txt").write_text("old")
    (locked / "old.txt").chmod(0o604)
    sbx.files.write(str(locked / "new.txt"), "new")
    sbx.files.write(str(locked / "a" / "b" / "c.txt"), "c")
    sbx.files.write(str(locked / "old.txt"), "replaced")
    for p in (locked / "new.txt", locked / "a", locked / "a" / "b", locked / "a" / "b" / "c.txt",
              locked / "old.txt"):
        assert (p.stat().st_uid, p.stat().st_gid) == (USER.pw_uid, USER.pw_gid), p
    assert (locked / "old.txt").read_text() == "replaced"
    assert (locked / "old.txt").stat().st_mode & 0o7777 == 0o604
    assert locked.stat().st_uid == 0  # only what the upload made changes hands
    sbx.files.write(str(home_dir / "ok.txt"), "yes", user="root")
    assert (home_dir / "ok.txt").stat().st_uid == 0


def _pending(path: Path):  # -> PendingFile
    from envd.services.filesystem.atomic import PendingFile

    pending = PendingFile.open(str(path))
    pending.write([path.name.encode()])
    return pending


def test_publish_all_rolls_back_when_a_later_rename_fails(tmp_path):
    """A failure while publishing file k undoes files 0..k-1: the replaced file has its old
    content again, the created one is gone, and no temp or backup file stays."""
    from envd.services.filesystem.atomic import PublishError, publish_all

    (tmp_path / "replaced").write_text("old")
    files = [_pending(tmp_path / "replaced"), _pending(tmp_path / "created"),
             _pending(tmp_path / "blocked")]
    (tmp_path / "blocked").mkdir()  # appears after open: its rename fails (EISDIR)
    (tmp_path / "blocked" / "x").write_text("keeps the directory non-empty")
    with pytest.raises(PublishError) as exc:
        publish_all(files, None)
    assert exc.value.index == 2
    for pending in files:
        pending.abort()
    assert (tmp_path / "replaced").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "replaced"]


# ---------------------------------------------------------------- JS SDK, all items

@pytest.mark.js
def test_js_parity(envd_url, home_dir):
    if shutil.which("node") is None or not (JS_DIR / "node_modules" / "e2b").is_dir():
        pytest.skip("node or the e2b npm package is not installed")
    top = f"/aenv-parity-js-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "E2B_DEBUG": "true", "E2B_API_KEY": "x", "E2B_SANDBOX_URL": envd_url}
    try:
        r = subprocess.run(["node", "parity.mjs", str(home_dir), top], cwd=JS_DIR, env=env,
                           capture_output=True, text=True, timeout=300, check=False)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    for name in ("symlinks", "watch flat", "watch recursive", "pty reattach", "write parents",
                 "write all-or-nothing"):
        assert f"ok {name}\n" in r.stdout
    assert r.stdout.endswith("all ok\n")
