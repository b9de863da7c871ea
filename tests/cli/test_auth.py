"""`aenv auth login|status|logout` and where the settings come from (option > environment
> saved credentials > the service's key file), against the real REST API. Every test has
its own XDG_CONFIG_HOME (conftest.clean_environ)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from host.cli import credentials
from tests.api.conftest import API_KEY, free_port

from .conftest import REPO_ROOT, Stack, invoke


def _creds_file() -> Path:
    return Path(os.environ["XDG_CONFIG_HOME"]) / "aenv" / "credentials"


def _login(stack: Stack, key: str = API_KEY) -> None:
    r = invoke("auth", "login", "--api-url", stack.api_url, "--sandbox-url", stack.sandbox_url,
               "--api-key", key)
    assert r.exit_code == 0, r.output


def _status(*global_args: str) -> dict[str, object]:
    r = invoke(*global_args, "auth", "status", "-o", "json")
    value = json.loads(r.stdout)
    assert isinstance(value, dict)
    value["exit"] = r.exit_code
    return value


def test_login_saves_0600_and_commands_use_it(stack: Stack) -> None:
    path = _creds_file()
    r = invoke("auth", "login", "--api-url", stack.api_url, "--sandbox-url", stack.sandbox_url,
               "--api-key", API_KEY)
    assert r.exit_code == 0, r.output
    assert r.stdout == f"Logged in to {stack.api_url} (key e2b_…); saved in {path}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {"api_url": stack.api_url, "api_key": API_KEY,
                                            "sandbox_url": stack.sandbox_url}
    assert [p.name for p in path.parent.iterdir()] == ["credentials"]  # no temp file left

    # no options, no environment: the saved URLs and key, for the API and for envd
    r = invoke("start")
    assert r.exit_code == 0, r.output
    sid = r.stdout.strip()
    r = invoke("exec", sid, "--", "echo", "hi")
    assert (r.exit_code, r.stdout) == (0, "hi\n"), r.output

    r = invoke("auth", "status")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [f"API URL:      {stack.api_url}",
                                     f"Sandbox URL:  {stack.sandbox_url}",
                                     f"API key:      e2b_… (from {path})",
                                     "Key accepted: yes"]
    assert API_KEY not in r.output
    assert _status() == {"apiUrl": stack.api_url, "sandboxUrl": stack.sandbox_url,
                         "apiKey": "e2b_…", "keySource": str(path), "credentials": str(path),
                         "status": "ok", "exit": 0}

    r = invoke("auth", "logout")
    assert (r.exit_code, r.stdout) == (0, f"Logged out: removed {path}\n")
    assert not path.exists()
    r = invoke("auth", "logout")
    assert r.exit_code == 0 and "Not logged in" in r.stdout


def test_login_replaces_atomically_with_0600_whatever_the_umask(stack: Stack) -> None:
    path = _creds_file()
    path.parent.mkdir(mode=0o755)
    path.write_text("old")
    os.chmod(path, 0o644)
    inode = path.stat().st_ino
    old_umask = os.umask(0)
    try:
        _login(stack)
    finally:
        os.umask(old_umask)
    # a new file renamed over the old one (not rewritten in place), 0600 from the start
    assert path.stat().st_ino != inode
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text())["api_key"] == API_KEY


def test_login_key_from_stdin_and_from_the_environment(stack: Stack,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    r = invoke("auth", "login", "--api-url", stack.api_url, "--api-key-stdin",
               stdin=API_KEY + "\n")
    assert r.exit_code == 0, r.output
    assert json.loads(_creds_file().read_text())["api_key"] == API_KEY
    assert API_KEY not in r.output
    _creds_file().unlink()

    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_API_URL", stack.api_url)
    r = invoke("auth", "login")
    assert r.exit_code == 0, r.output
    saved = json.loads(_creds_file().read_text())
    assert (saved["api_url"], saved["api_key"]) == (stack.api_url, API_KEY)

    r = invoke("auth", "login", "--api-key", "a", "--api-key-stdin", stdin="b\n")
    assert r.exit_code == 2 and "one of them" in r.stderr
    r = invoke("auth", "login", "--api-key-stdin", stdin="\n")
    assert r.exit_code == 2 and "stdin held no key" in r.stderr


def test_login_refused_or_unreachable_saves_nothing(stack: Stack) -> None:
    r = invoke("auth", "login", "--api-url", stack.api_url, "--api-key", "e2b_wrong")
    assert r.exit_code == 3
    assert r.stderr == ("aenv: API error 401: invalid API key: nothing was saved; check the "
                        "key and run `aenv auth login` again\n")
    assert not _creds_file().exists()

    url = f"http://127.0.0.1:{free_port()}"
    r = invoke("auth", "login", "--api-url", url, "--api-key", API_KEY)
    assert r.exit_code == 1
    assert r.stderr.startswith(f"aenv: cannot reach the API at {url} (")
    assert r.stderr.endswith("nothing saved\n") and len(r.stderr.splitlines()) == 1
    assert not _creds_file().exists()

    r = invoke("auth", "login", "--api-url", stack.api_url)  # no key anywhere, no terminal
    assert r.exit_code == 3
    assert r.stderr.startswith("aenv: no API key: pass --api-key-stdin")
    assert not _creds_file().exists()


def test_status_rejected_unreachable_and_no_key(stack: Stack) -> None:
    _login(stack)
    credentials.save(credentials.Credentials(stack.api_url, "e2b_revoked", stack.sandbox_url))
    status = _status()
    assert (status["status"], status["exit"], status["apiKey"]) == ("rejected", 3, "e2b_…")
    r = invoke("auth", "status")
    assert r.exit_code == 3
    assert "Key accepted: no, the API rejected it: run `aenv auth login`" in r.stdout
    assert r.stderr == (f"aenv: API error 401: invalid API key (the key from {_creds_file()}): "
                        "run `aenv auth login` or set E2B_API_KEY\n")

    url = f"http://127.0.0.1:{free_port()}"
    credentials.save(credentials.Credentials(url, API_KEY, stack.sandbox_url))
    status = _status()
    assert (status["status"], status["exit"]) == ("unreachable", 1)
    r = invoke("auth", "status")
    assert r.exit_code == 1 and r.stderr.startswith(f"aenv: cannot reach the API at {url}")

    credentials.remove()
    status = _status("--api-url", stack.api_url)
    assert (status["status"], status["exit"], status["apiKey"]) == ("no key", 3, None)
    assert status["credentials"] is None


def test_precedence(stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """option > environment > saved credentials > the service's key file."""
    path = str(_creds_file())
    (tmp_path / "api_keys").write_text("e2b_from_service_file\n")
    monkeypatch.setenv("AENV_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("E2B_API_URL", stack.api_url)
    assert _status()["keySource"] == str(tmp_path / "api_keys")  # nothing else: the key file

    _login(stack)
    assert _status()["keySource"] == path  # saved credentials beat the key file
    monkeypatch.setenv("E2B_API_KEY", "e2b_wrong")
    status = _status()  # the environment beats the saved key
    assert (status["keySource"], status["status"]) == ("$E2B_API_KEY", "rejected")
    monkeypatch.setenv("AENV_API_KEY", API_KEY)  # AENV_* before E2B_*
    assert _status()["keySource"] == "$AENV_API_KEY"
    status = _status("--api-key", API_KEY)  # the option beats everything
    assert (status["keySource"], status["status"]) == ("--api-key", "ok")
    monkeypatch.delenv("AENV_API_KEY")
    monkeypatch.delenv("E2B_API_KEY")

    # the saved key goes only to the API it was saved for
    other = f"http://127.0.0.1:{free_port()}"
    status = _status("--api-url", other)
    assert status["apiUrl"] == other and status["keySource"] == str(tmp_path / "api_keys")
    assert status["sandboxUrl"] == "http://127.0.0.1:3001"
    monkeypatch.delenv("E2B_API_URL")
    status = _status()  # no URL given: the saved one, with its key and proxy
    assert (status["apiUrl"], status["sandboxUrl"], status["keySource"]) == (
        stack.api_url, stack.sandbox_url, path)


def test_unreadable_credentials_are_skipped_with_a_warning(stack: Stack) -> None:
    path = _creds_file()
    path.parent.mkdir()
    path.write_text("{not json")
    r = invoke("--api-url", stack.api_url, "--api-key", API_KEY, "ls")
    assert r.exit_code == 0
    assert r.stderr == (f"aenv: warning: {path} is not an aenv credentials file, ignored: run "
                        "`aenv auth login` or `aenv auth logout`\n")
    r = invoke("auth", "logout")
    assert r.exit_code == 0 and not path.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="needs a Linux pty")
def test_login_prompts_for_the_key_on_a_terminal(stack: Stack) -> None:
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "host.cli", "auth", "login", "--api-url",
                             stack.api_url], cwd=REPO_ROOT, env=dict(os.environ),
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    buf = bytearray()
    try:
        while b"API key: " not in buf:
            assert select.select([master], [], [], 30)[0], bytes(buf)
            buf += os.read(master, 4096)
        os.write(master, API_KEY.encode() + b"\r")
        assert proc.wait(timeout=30) == 0, bytes(buf)
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert API_KEY.encode() not in buf  # not echoed
    assert b"Logged in to " in buf
    assert json.loads(_creds_file().read_text())["api_key"] == API_KEY
