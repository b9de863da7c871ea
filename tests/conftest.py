"""Fixtures shared by several test packages: a real moto S3 server process (the `oss`
repository backend) and the AWS credentials it accepts."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_server(log_dir: Path, *, bind: str = "127.0.0.1") -> Iterator[str]:
    """A real moto S3 server process listening on `bind` (its http endpoint URL on
    127.0.0.1), killed on exit. (bench/bench_p2p.py and tests/e2e use it too.)"""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which(
        "moto_server")
    port = _free_port()
    argv = [exe, "-H", bind, "-p", str(port)] if exe else [
        sys.executable, "-m", "moto.server", "-H", bind, "-p", str(port)]
    log = open(log_dir / "moto.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real moto S3 server process on 127.0.0.1 (http endpoint URL)."""
    with moto_server(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


