"""Fixtures: a real block server process (`python -m host.storage.blockserver`) and a real
moto S3 server process. Both are started in their own session and always killed and reaped."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from host.storage.control import SyncBlockServerClient

REPO = Path(__file__).resolve().parents[2]


def _kill(proc: subprocess.Popen[bytes], *, graceful: bool = True) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM if graceful else signal.SIGKILL)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@dataclass
class BlockServerProc:
    """One block server process; `restart()` kills it (SIGKILL by default) and starts anew."""

    root: Path
    repo: str | None = None
    cache_mib: int | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_dir(self) -> Path:
        return self.root / "sock"

    @property
    def nbd_socket(self) -> Path:
        return self.socket_dir / "nbd.sock"

    @property
    def client(self) -> SyncBlockServerClient:
        return SyncBlockServerClient(self.socket_dir / "control.sock", timeout_s=60)

    def uri(self, name: str) -> str:
        return f"nbd+unix:///{name}?socket={self.nbd_socket}"

    def start(self) -> None:
        argv = [sys.executable, "-m", "host.storage.blockserver",
                "--socket-dir", str(self.socket_dir), "--state-dir", str(self.root / "state"),
                "--log-level", "WARNING"]
        if self.repo:
            argv += ["--repo", self.repo]
        if self.cache_mib is not None:
            argv += ["--cache-dir", str(self.root / "cache"), "--cache-mib", str(self.cache_mib)]
        self.log = open(self.root / "blockserver.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log, stderr=self.log,
                                     start_new_session=True,
                                     env={**os.environ, **self.extra_env})
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"block server exited: {(self.root / 'blockserver.log').read_text()}")
            try:
                if self.client.ping():
                    return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self, *, graceful: bool = True) -> None:
        if self.proc is not None:
            _kill(self.proc, graceful=graceful)
            self.proc = None
            self.log.close()

    def restart(self, *, graceful: bool = False) -> None:
        self.stop(graceful=graceful)
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def blockserver(tmp_path: Path) -> Iterator[BlockServerProc]:
    """A running block server over a posix_fs repository in tmp_path; killed at teardown."""
    bs = BlockServerProc(tmp_path / "bs", repo=f"posix_fs:{tmp_path / 'repo'}")
    bs.root.mkdir()
    bs.start()
    try:
        yield bs
    finally:
        bs.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def qemu_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed")
    return path
