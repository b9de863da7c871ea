"""Runs the shell script that starts Redis in deploy/compose and deploy/k8s (password from
the environment into a 0600 config file, then `exec redis-server`) with this machine's
redis-server, on a free loopback port and in a temp dir instead of the container's /tmp,
so the tests see it require the password rather than read that it would."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.api.conftest import free_port


def redis_cli(port: int, password: str | None, command: str) -> subprocess.CompletedProcess[str]:
    """`command` (a health check: `redis-cli ping | grep -qx PONG`) against the port, with
    REDISCLI_AUTH set as the container sets it."""
    env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
    if password is not None:
        env["REDISCLI_AUTH"] = password
    return subprocess.run(["sh", "-c", command.replace("redis-cli", f"redis-cli -p {port}")],
                          env=env, capture_output=True, text=True, timeout=30, check=False)


@contextmanager
def run_script(script: str, tmp: Path, env: dict[str, str]) -> Iterator[int]:
    """Start `script` (as `sh -ec` would); yields the port redis-server listens on."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is missing (make setup installs it)")
    port = free_port()
    assert "/tmp/" in script and "--appendonly no" in script
    local = script.replace("/tmp/", f"{tmp}/").replace(
        "--appendonly no", f"--appendonly no --port {port} --bind 127.0.0.1 --dir {tmp}")
    proc = subprocess.Popen(["sh", "-ec", local], env={"PATH": os.environ["PATH"], **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while "NOAUTH" not in redis_cli(port, None, "redis-cli ping").stdout:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(10)


def fails(script: str, env: dict[str, str]) -> str:
    """What `script` prints when it refuses to start (it must exit non-zero at once)."""
    p = subprocess.run(["sh", "-ec", script], env={"PATH": os.environ["PATH"], **env},
                       capture_output=True, text=True, timeout=30, check=False)
    assert p.returncode != 0, p.stdout
    return p.stderr
