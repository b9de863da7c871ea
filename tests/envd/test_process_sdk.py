"""process.Process through the unmodified e2b Python SDK (sync), E2B_DEBUG → the session envd."""

from __future__ import annotations

import os
import threading
import time

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
    TimeoutException,
)


@pytest.fixture
def sbx(sdk_env):
    sandbox = Sandbox.create()  # debug mode: no API call, envd from sdk_env
    before = {p.pid for p in sandbox.commands.list()}
    yield sandbox
    for info in sandbox.commands.list():  # kill whatever a failing test left behind
        if info.pid not in before:
            sandbox.commands.kill(info.pid)


def wait_not_listed(sbx, pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pid not in [p.pid for p in sbx.commands.list()]:
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} still running")


def test_run_collects_output(sbx):
    r = sbx.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code, r.error) == ("out\n", "err\n", 0, None)


def test_output_streams_while_running(sbx):
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.4; done",
                     on_stdout=lambda s: seen.append((time.monotonic() - t0, s)))
    assert "".join(s for _, s in seen) == "1\n2\n3\n"
    # Lines arrived as they were printed (0.4 s apart), not all at once at the end;
    # relative timing, so a slow login shell under load cannot break it.
    assert seen[-1][0] - seen[0][0] > 0.6


def test_stderr_callback(sbx):
    errs: list[str] = []
    sbx.commands.run("echo oops >&2", on_stderr=errs.append)
    assert "".join(errs) == "oops\n"


def test_nonzero_exit_raises(sbx):
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo bad >&2; exit 7")
    assert info.value.exit_code == 7
    assert info.value.stderr == "bad\n"
    assert info.value.error == "exit status 7"


def test_large_output_is_complete(sbx):
    r = sbx.commands.run("head -c 3000000 /dev/zero | base64 -w 0")
    assert len(r.stdout) == 4000000


def test_default_user_and_root(sbx):
    assert sbx.commands.run("id -un").stdout.strip() == "user"
    assert sbx.commands.run("id -un", user="root").stdout.strip() == "root"
    env = sbx.commands.run("echo $HOME:$USER:$LOGNAME").stdout.strip()
    assert env == "/home/user:user:user"


def test_unknown_user_is_rejected(sbx):
    with pytest.raises(AuthenticationException, match="invalid username: 'nosuchuser'"):
        sbx.commands.run("true", user="nosuchuser")


def test_envs_and_cwd(sbx):
    assert sbx.commands.run("echo $FOO", envs={"FOO": "bar baz"}).stdout == "bar baz\n"
    assert sbx.commands.run("pwd").stdout == "/home/user\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("pwd", cwd="/no/such/dir")


def test_timeout_kills_process(sbx):
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 20", timeout=1)
    assert time.monotonic() - t0 < 5
    time.sleep(0.2)
    assert not [p for p in sbx.commands.list() if p.args[-1:] == ["sleep 20"]]


def test_background_connect_and_kill(sbx):
    handle = sbx.commands.run("for i in $(seq 100); do echo tick; sleep 0.1; done",
                              background=True)
    pid = handle.pid
    assert pid in [p.pid for p in sbx.commands.list()]
    other = sbx.commands.connect(pid)
    got: list[str] = []

    def read():
        try:
            other.wait(on_stdout=got.append)
        except CommandExitException as exc:
            got.append(f"exit:{exc.exit_code}:{exc.error}")

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)
    assert sbx.commands.kill(pid) is True
    reader.join(5)
    assert not reader.is_alive()
    assert "tick\n" in got and got[-1] == "exit:-1:signal: killed"
    with pytest.raises(CommandExitException) as info:
        handle.wait()  # the original Start stream got output and the end too
    assert info.value.exit_code == -1
    wait_not_listed(sbx, pid)


def test_two_clients_both_receive_output(sbx):
    handle = sbx.commands.run("read x; echo got-$x", background=True, stdin=True)
    other = sbx.commands.connect(handle.pid)
    sbx.commands.send_stdin(handle.pid, "hello\n")
    assert handle.wait().stdout == "got-hello\n"
    assert other.wait().stdout == "got-hello\n"


def test_send_stdin_and_close_stdin(sbx):
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "one\n")
    sbx.commands.send_stdin(handle.pid, b"two\n")
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "one\ntwo\n"


def test_stdin_closed_by_default(sbx):
    # stdin=False (the SDK default): cat sees EOF at once instead of hanging.
    assert sbx.commands.run("cat; echo done", timeout=5).stdout == "done\n"


def test_stream_input(sbx):
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(handle.pid, iter(["a", "b\n", b"c\n"]))
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "ab\nc\n"


def test_kill_and_connect_unknown_pid(sbx):
    assert sbx.commands.kill(987654) is False
    with pytest.raises(NotFoundException):
        sbx.commands.connect(987654)


def test_pty_create_resize_input_kill(sbx):
    data: list[bytes] = []
    pty = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(pty.pid, PtySize(rows=33, cols=111))
    sbx.pty.send_stdin(pty.pid, b"stty size; tty; echo $TERM\n")

    def read():
        try:
            pty.wait(on_pty=data.append)
        except CommandExitException:
            pass

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 10
    # Wait for the last line: the typed command echoes "echo $TERM", not its value.
    while b"xterm-256color" not in b"".join(data) and time.monotonic() < deadline:
        time.sleep(0.05)
    out = b"".join(data)
    assert b"33 111" in out
    assert b"/dev/pts/" in out  # a real controlling terminal
    assert b"xterm-256color" in out
    assert sbx.pty.kill(pty.pid) is True
    reader.join(5)
    assert not reader.is_alive()
    wait_not_listed(sbx, pty.pid)


def test_pty_exit_code(sbx):
    pty = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(pty.pid, b"exit 5\n")
    with pytest.raises(CommandExitException) as info:
        pty.wait()
    assert info.value.exit_code == 5


def _children(ppid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process whose parent is `ppid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == ppid:
            out.append((int(entry), fields[0]))
    return out


def test_killed_processes_are_reaped_with_their_group(sbx, envd_process):
    handles = [sbx.commands.run("sleep 313.7 & sleep 313.7; echo never", background=True)
               for _ in range(3)]
    for handle in handles:
        assert sbx.commands.kill(handle.pid) is True
    for handle in handles:
        wait_not_listed(sbx, handle.pid)
    children = dict(_children(envd_process.pid))
    assert not [pid for pid, state in children.items() if state == "Z"], children
    assert not set(children) & {h.pid for h in handles}
    # The whole process group died, background `sleep` included.
    leftover = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == "sleep 313.7"]
    assert not leftover


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
