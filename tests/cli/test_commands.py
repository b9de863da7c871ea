"""`aenv` commands run in-process (click's CliRunner) against the real REST API, proxy and
envd; the sandbox lifecycle behind them is the in-memory test double (see conftest.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from host.orchestrator.states import SandboxState
from tests.api.conftest import API_KEY, free_port

from .conftest import Stack, invoke


def _start(stack: Stack, *args: str) -> str:
    r = stack.run("start", *args)
    assert r.exit_code == 0, r.output
    return r.stdout.strip()


def test_start_prints_id_and_sends_options(stack: Stack) -> None:
    sid = _start(stack, "--template", "py", "--timeout", "60", "--env", "A=1",
                 "--metadata", "owner=me", "--no-auto-pause")
    info = stack.orch.sandboxes[sid]
    assert info.template_id == "py"
    assert info.metadata == {"owner": "me"}
    assert info.auto_pause is False
    req = stack.orch.calls[0][1][0]
    assert req.env_vars == {"A": "1"} and req.timeout_s == 60  # type: ignore[attr-defined]

    r = stack.run("start", "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["sandboxID"] in stack.orch.sandboxes


def test_start_bad_pair_is_usage_error(stack: Stack) -> None:
    r = stack.run("start", "--env", "novalue")
    assert r.exit_code == 2
    assert "KEY=VALUE" in r.stderr


def test_ls_and_info(stack: Stack) -> None:
    a = _start(stack, "--metadata", "k=v")
    b = _start(stack)
    stack.run("pause", b)
    r = stack.run("ls")
    assert r.exit_code == 0
    assert a in r.stdout and b in r.stdout and "k=v" in r.stdout
    assert r.stdout.splitlines()[0].startswith("SANDBOX ID")
    r = stack.run("ls", "--state", "paused", "--json")
    assert [i["sandboxID"] for i in json.loads(r.stdout)] == [b]
    r = stack.run("ls", "--state", "bogus")
    assert r.exit_code == 1 and "API error 400" in r.stderr

    r = stack.run("info", a)
    assert r.exit_code == 0
    assert f"sandboxID: {a}" in r.stdout and "state: running" in r.stdout
    assert "envd-token" not in r.stdout  # the secret only with --json
    assert json.loads(stack.run("info", a, "--json").stdout)["envdAccessToken"] == "envd-token"


def test_kill_then_not_found_exit_4(stack: Stack) -> None:
    sid = _start(stack)
    assert stack.run("kill", sid).exit_code == 0
    assert stack.orch.sandboxes[sid].state is SandboxState.KILLED
    for args in (("info", sid), ("kill", sid), ("exec", sid, "--", "true"),
                 ("download", sid, "/etc/hostname", "/tmp/x")):
        r = stack.run(*args)
        assert r.exit_code == 4, (args, r.output)
        assert r.stderr == f"aenv: API error 404: sandbox '{sid}' not found (see `aenv ls`)\n"
        assert "Traceback" not in r.output
        assert len(r.stderr.strip().splitlines()) == 1


def test_pause_twice_409_and_resume(stack: Stack) -> None:
    sid = _start(stack)
    assert stack.run("pause", sid).exit_code == 0
    assert stack.orch.sandboxes[sid].state is SandboxState.PAUSED
    r = stack.run("pause", sid)
    assert r.exit_code == 5
    assert r.stderr.startswith("aenv: API error 409: ") and sid in r.stderr
    assert stack.run("resume", sid, "--timeout", "30").exit_code == 0
    assert stack.orch.sandboxes[sid].state is SandboxState.RUNNING
    r = stack.run("resume", sid)
    assert r.exit_code == 5 and "already running" in r.stderr


def test_filesystem_pause_and_reboot(stack: Stack) -> None:
    sid = _start(stack)
    assert stack.run("pause", sid, "--filesystem").exit_code == 0
    assert stack.orch.sandboxes[sid].pause_mode == "filesystem"
    assert ("pause", (sid, False, False)) in stack.orch.calls
    assert stack.run("resume", sid, "--reboot").exit_code == 0
    assert ("connect", (sid, 15, False)) in stack.orch.calls


def test_timeout(stack: Stack) -> None:
    sid = _start(stack)
    assert stack.run("timeout", sid, "42").exit_code == 0
    assert ("set_timeout", (sid, 42)) in stack.orch.calls
    assert stack.run("timeout", sid, "soon").exit_code == 2


def test_bad_and_missing_key(stack: Stack) -> None:
    r = stack.run("ls", key="e2b_wrong")
    assert r.exit_code == 3
    assert r.stderr == ("aenv: API error 401: invalid API key (the key from --api-key): "
                        "run `aenv auth login` or set E2B_API_KEY\n")
    r = stack.run("ls", key=None)
    assert r.exit_code == 3
    assert r.stderr == ("aenv: API error 401: missing X-API-Key header: "
                        "run `aenv auth login` or set E2B_API_KEY\n")


def test_key_from_env_and_key_file(stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_API_KEY", "e2b_test_key")
    assert stack.run("ls", key=None).exit_code == 0
    monkeypatch.setenv("E2B_API_KEY", "e2b_wrong")
    r = stack.run("ls", key=None)
    assert r.exit_code == 3 and "(the key from $E2B_API_KEY)" in r.stderr
    monkeypatch.delenv("E2B_API_KEY")
    (tmp_path / "api_keys").write_text("# service keys\n\ne2b_test_key\n")
    monkeypatch.setenv("AENV_STATE_DIR", str(tmp_path))
    assert stack.run("ls", key=None).exit_code == 0


def test_unreachable_api_and_proxy(stack: Stack) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = invoke("--api-url", url, "ls")
    assert r.exit_code == 1
    assert r.stderr == (f"aenv: cannot reach the API at {url} (Connection refused): is the "
                        "service running? (`make run`), or set --api-url / run `aenv auth "
                        "login`\n")
    sid = _start(stack)
    r = invoke("--api-url", stack.api_url, "--api-key", API_KEY, "--sandbox-url", url,
               "exec", sid, "--", "true")
    assert r.exit_code == 1
    assert r.stderr.startswith(f"aenv: cannot reach the sandbox proxy at {url} (")
    assert "set --sandbox-url (env E2B_SANDBOX_URL)" in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_exec_streams_and_propagates_exit_code(stack: Stack) -> None:
    sid = _start(stack)
    r = stack.run("exec", sid, "--", "echo out; echo err >&2; exit 7")
    assert r.exit_code == 7, r.output
    assert r.stdout == "out\n" and r.stderr == "err\n"

    r = stack.run("exec", sid, "--env", "FOO=bar baz", "--cwd", "/tmp", "--",
                  "sh", "-c", 'echo "$FOO"; pwd; id -un')
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == ["bar baz", "/tmp", "user"]

    r = stack.run("exec", sid, "--user", "root", "--", "id", "-u")
    assert (r.exit_code, r.stdout) == (0, "0\n")
    assert stack.run("exec", sid, "--", "true").exit_code == 0


def test_exec_envd_error_is_one_line(stack: Stack) -> None:
    sid = _start(stack)
    r = stack.run("exec", sid, "--cwd", "/does/not/exist", "--", "true")
    assert r.exit_code != 0
    assert r.stderr.startswith("aenv: envd error ")
    assert len(r.stderr.strip().splitlines()) == 1


def test_upload_download_round_trip(stack: Stack, tmp_path: Path) -> None:
    sid = _start(stack)
    data = os.urandom(3 * 1024 * 1024 + 17)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    remote = f"/tmp/aenv-cli-{sid}.bin"
    try:
        r = stack.run("upload", sid, str(src), remote)
        assert r.exit_code == 0, r.output
        r = stack.run("exec", sid, "--", f"stat -c %s {remote}")
        assert r.stdout.strip() == str(len(data))
        dst = tmp_path / "dst.bin"
        r = stack.run("download", sid, remote, str(dst))
        assert r.exit_code == 0, r.output
        assert dst.read_bytes() == data
        out_dir = tmp_path / "d"
        out_dir.mkdir()
        assert stack.run("download", sid, remote, str(out_dir)).exit_code == 0
        assert (out_dir / Path(remote).name).read_bytes() == data
    finally:
        stack.run("exec", sid, "--", f"rm -f {remote}")

    r = stack.run("download", sid, "/no/such/file", str(tmp_path / "x"))
    assert r.exit_code == 4 and r.stderr.startswith("aenv: envd error 404: ")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))


def test_fork_logs_metrics(stack: Stack) -> None:
    sid = _start(stack)
    r = stack.run("fork", sid, "-n", "3")
    # the double answers count-1 children and one 503 error
    assert r.exit_code == 1
    children = r.stdout.split()
    assert len(children) == 2 and all(c in stack.orch.sandboxes for c in children)
    assert "fork failed: 503 no capacity" in r.stderr

    r = stack.run("fork", sid, "-n", "2", "-o", "json")
    assert r.exit_code == 1
    results = json.loads(r.stdout)  # stdout holds only the JSON; the failure on stderr
    assert results[0]["sandbox"]["sandboxID"] in stack.orch.sandboxes
    assert results[1]["error"] == {"code": 503, "message": "no capacity"}

    r = stack.run("logs", sid)
    assert r.exit_code == 0 and "line 0" in r.stdout and "error" in r.stdout
    r = stack.run("metrics", sid)
    assert r.exit_code == 0
    assert r.stdout.splitlines()[0].split() == ["TIMESTAMP", "CPUS", "CPU%", "MEM", "USED",
                                                "MEM", "TOTAL", "DISK", "USED", "DISK",
                                                "TOTAL"]
    assert len(r.stdout.splitlines()) == 4


def test_exec_signal_killed_command(stack: Stack) -> None:
    sid = _start(stack)
    r = stack.run("exec", sid, "--", "kill -9 $$")
    assert r.exit_code != 0
    assert r.stderr.startswith("aenv: remote command ")
    assert "Traceback" not in r.output


def test_exec_ctrl_c_kills_remote_process(stack: Stack) -> None:
    import signal
    import subprocess
    import sys
    import time

    from .conftest import REPO_ROOT

    sid = _start(stack)
    marker = f"aenv-cli-sleep-{sid}"
    env = {**os.environ, **stack.env()}
    proc = subprocess.Popen([sys.executable, "-m", "host.cli", "exec", sid, "--",
                             f"echo started; exec -a {marker} sleep 60"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"started\n"
        # positive control: the pattern finds the running process before the interrupt
        r = stack.run("exec", sid, "--", f"pgrep -f '^{marker}' || true")
        assert r.stdout.strip(), "the remote sleep is not visible to pgrep"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert b"interrupted" in err and b"Traceback" not in err
    deadline = time.monotonic() + 10
    while True:
        r = stack.run("exec", sid, "--", f"pgrep -f '^{marker}' || true")
        if not r.stdout.strip():
            break
        assert time.monotonic() < deadline, "remote process still running"
        time.sleep(0.2)


def test_guest_commands_on_a_paused_sandbox_say_how_to_resume(stack: Stack,
                                                               tmp_path: Path) -> None:
    sid = _start(stack)
    stack.run("pause", sid)
    line = (f"aenv: sandbox {sid} is paused: run `aenv resume {sid}` first (or `aenv connect "
            f"{sid}` for a terminal)\n")
    for args in (("exec", sid, "--", "true"), ("upload", sid, "/etc/hostname", "/tmp/x"),
                 ("download", sid, "/etc/hostname", str(tmp_path / "x"))):
        r = stack.run(*args)
        assert (r.exit_code, r.stderr) == (5, line), args
    assert stack.run("resume", sid).exit_code == 0
    assert stack.run("exec", sid, "--", "true").exit_code == 0
