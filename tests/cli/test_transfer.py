"""`aenv upload` / `download` progress: a byte bar on stderr under a real pty, and nothing
at all on stderr through a pipe; the bytes arrive intact either way (real API, proxy and
envd; sandbox lifecycle: the test double)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO_ROOT, Stack

SIZE = 3 * 1024 * 1024 + 17


def _env(stack: Stack) -> dict[str, str]:
    return {**os.environ, **stack.env(), "TERM": "xterm-256color", "COLUMNS": "120"}


def _aenv(*args: str) -> list[str]:
    return [sys.executable, "-m", "host.cli", *args]


def _under_pty(stack: Stack, *args: str) -> tuple[int, str]:
    """Run `aenv ARGS` with stderr on a pty (stdout a pipe); its exit code, what the pty
    showed."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen(_aenv(*args), cwd=REPO_ROOT, env=_env(stack),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    buf = bytearray()
    try:
        while True:
            if not select.select([master], [], [], 60)[0]:
                raise AssertionError(f"no output from aenv: {bytes(buf)!r}")
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
    return proc.wait(timeout=30), bytes(buf).decode(errors="replace")


@pytest.mark.skipif(sys.platform != "linux", reason="needs a Linux pty")
def test_progress_bar_on_a_terminal(stack: Stack, tmp_path: Path) -> None:
    sid = stack.run("start").stdout.strip()
    data = os.urandom(SIZE)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    remote = f"/tmp/aenv-cli-bar-{sid}.bin"
    try:
        code, shown = _under_pty(stack, "upload", sid, str(src), remote)
        assert code == 0, shown
        plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)
        assert "big.bin ↑" in plain and re.search(r"3\.1/3\.1 MB", plain), shown
        assert "\x1b[" in shown  # drawn (and cleared) with terminal codes
        assert f"{src} -> {sid}:{remote} ({SIZE} bytes)" in plain

        dst = tmp_path / "back.bin"
        code, shown = _under_pty(stack, "download", sid, remote, str(dst))
        assert code == 0, shown
        plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)
        assert f"aenv-cli-bar-{sid}.bin ↓" in plain and re.search(r"3\.1/3\.1 MB", plain)
        assert dst.read_bytes() == data
    finally:
        stack.run("exec", sid, "--", f"rm -f {remote}")


def test_nothing_on_stderr_through_a_pipe(stack: Stack, tmp_path: Path) -> None:
    sid = stack.run("start").stdout.strip()
    data = os.urandom(SIZE)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    remote = f"/tmp/aenv-cli-pipe-{sid}.bin"
    try:
        for args in (("upload", sid, str(src), remote),
                     ("download", sid, remote, str(tmp_path / "back.bin"))):
            r = subprocess.run(_aenv(*args), cwd=REPO_ROOT, env=_env(stack),
                               capture_output=True, timeout=60, check=False)
            assert r.returncode == 0, r.stderr
            assert (r.stdout, r.stderr) == (b"", b"")
        assert (tmp_path / "back.bin").read_bytes() == data
    finally:
        stack.run("exec", sid, "--", f"rm -f {remote}")
