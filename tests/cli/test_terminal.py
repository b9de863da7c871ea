"""`aenv terminal` under a real pseudo-terminal, against the real envd `/terminal`
WebSocket through the real proxy (sandbox lifecycle: the test double, see conftest.py).

The CLI runs as a subprocess whose stdin/stdout/stderr are the slave side of a pty we
opened; we keep the slave fd too, so we can read its termios mode while the CLI runs (raw)
and after it exits (restored)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import termios
import time

import pytest

from .conftest import REPO_ROOT, Stack

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs a Linux pty")


def _read_until(fd: int, needle: bytes, buf: bytearray, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while needle not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{needle!r} not seen in {bytes(buf)[-2000:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                buf += os.read(fd, 65536)
            except OSError:
                raise AssertionError(f"pty closed before {needle!r}: {bytes(buf)!r}") from None


def _drain(fd: int, buf: bytearray) -> None:
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk


def _spawn(stack: Stack, *args: str) -> tuple[subprocess.Popen[bytes], int, int]:
    master, slave = pty.openpty()
    env = {**os.environ, **stack.env()}
    proc = subprocess.Popen([sys.executable, "-m", "host.cli", *args], cwd=REPO_ROOT, env=env,
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    return proc, master, slave


def test_terminal_echo_exit_code_and_mode_restored(stack: Stack) -> None:
    sid = stack.run("start").stdout.strip()
    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    assert before[3] & termios.ICANON and before[3] & termios.ECHO
    os.close(master)
    os.close(slave)

    proc, master, slave = _spawn(stack, "terminal", sid)
    buf = bytearray()
    try:
        before = termios.tcgetattr(slave)
        # the remote shell ran with our size and prints a prompt once it is up
        _read_until(master, b"$ ", buf)
        raw = termios.tcgetattr(slave)
        assert not raw[3] & termios.ICANON and not raw[3] & termios.ECHO  # raw while running
        os.write(master, b"stty size; echo h''i; exit 3\r")
        try:
            proc.wait(timeout=30)
        finally:
            _drain(master, buf)
        text = bytes(buf).decode(errors="replace")
        assert proc.returncode == 3, text
        assert "Traceback" not in text
        assert "\r\nhi\r\n" in text, text
        assert "24 80" in text, text  # the pty's default size went up with the connection
        after = termios.tcgetattr(slave)
        assert after == before  # the CLI restored the local terminal mode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)


def test_terminal_resize_on_sigwinch(stack: Stack) -> None:
    import fcntl
    import signal
    import struct

    sid = stack.run("start").stdout.strip()
    proc, master, slave = _spawn(stack, "terminal", sid)
    buf = bytearray()
    try:
        _read_until(master, b"$ ", buf)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 132, 0, 0))
        proc.send_signal(signal.SIGWINCH)
        time.sleep(0.5)
        os.write(master, b"stty size; exit 0\r")
        assert proc.wait(timeout=30) == 0
        _drain(master, buf)
        assert "50 132" in bytes(buf).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)


def test_terminal_cmd_without_tty_and_not_found(stack: Stack) -> None:
    sid = stack.run("start").stdout.strip()
    env = {**os.environ, **stack.env()}
    r = subprocess.run([sys.executable, "-m", "host.cli", "terminal", sid, "--cmd",
                        "echo piped; exit 5"], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=60, check=False)
    assert r.returncode == 5, r.stderr
    assert b"piped" in r.stdout

    r = subprocess.run([sys.executable, "-m", "host.cli", "terminal", "nosuchsandbox"],
                       cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=60, check=False)
    assert r.returncode == 4
    assert r.stderr.decode().startswith("aenv: API error 404: ")
    assert b"Traceback" not in r.stderr


def test_piped_stdin_to_interactive_shell_and_connect_resumes(stack: Stack) -> None:
    sid = stack.run("start").stdout.strip()
    assert stack.run("pause", sid).exit_code == 0
    assert stack.orch.sandboxes[sid].state.public == "paused"
    env = {**os.environ, **stack.env()}
    # `connect` resumes the paused sandbox first (POST /v2/sandboxes/{id}/connect), then
    # opens the terminal; stdin is not a tty: no raw mode, and EOF goes up as ^D
    r = subprocess.run([sys.executable, "-m", "host.cli", "connect", sid],
                       cwd=REPO_ROOT, env=env, input=b"echo piped-in\nexit 2\n",
                       capture_output=True, timeout=60, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert b"piped-in" in r.stdout
    assert r.stderr == f"Resumed paused sandbox {sid}\n".encode()
    assert stack.orch.sandboxes[sid].state.public == "running"
    assert ("connect", (sid, None, True)) in stack.orch.calls

    # running already: nothing to resume, straight to the terminal
    r = subprocess.run([sys.executable, "-m", "host.cli", "connect", sid, "--timeout", "60",
                        "--cmd", "echo again"], cwd=REPO_ROOT, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False)
    assert (r.returncode, r.stderr) == (0, b""), r.stderr
    assert b"again" in r.stdout
    assert ("connect", (sid, 60, True)) in stack.orch.calls

    missing = stack.run("connect", "inosuchsandbox0000000")
    assert missing.exit_code == 4 and missing.stderr.endswith("not found (see `aenv ls`)\n")


def test_web_terminal_link(stack: Stack) -> None:
    """`terminal --web`: POST /sandboxes/{id}/terminal {"ttl": N}, the link on stdout."""
    from .conftest import TERMINAL_BASE_URL, TERMINAL_LINKS

    sid = stack.run("start").stdout.strip()
    before = time.time()
    r = stack.run("terminal", "--web", sid)
    assert r.exit_code == 0, r.output
    assert r.stderr == ""  # the expiry goes to a terminal only
    url = r.stdout.strip()
    assert r.stdout == url + "\n" and url.startswith(f"{TERMINAL_BASE_URL}/terminal/{sid}?token=")
    expires = TERMINAL_LINKS.expiry(sid, url.split("token=", 1)[1])
    assert expires is not None and before + 900 - 2 <= expires <= time.time() + 900 + 2

    r = stack.run("terminal", sid, "--web", "--ttl", "60")
    expires = TERMINAL_LINKS.expiry(sid, r.stdout.strip().split("token=", 1)[1])
    assert expires is not None and expires <= time.time() + 61
    r = stack.run("terminal", sid, "--web", "--ttl", "5")  # the API's bounds: 10 s .. 1 day
    assert r.exit_code == 1 and r.stderr.startswith("aenv: API error 400: ") and "ttl" in r.stderr

    r = stack.run("terminal", "--web", "inosuchsandbox0000000")
    assert r.exit_code == 4 and r.stderr.endswith("(see `aenv ls`)\n")
    for args in (("--web", sid, "--cmd", "top"), (sid, "--ttl", "60")):
        r = stack.run("terminal", *args)
        assert r.exit_code == 2, args
