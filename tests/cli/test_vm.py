"""`aenv` against the REAL service: `python -m host` with QEMU VMs (TCG where KVM is
unusable), its own state dir, ports, namespace prefix `acli-` and pool 10.217.0.0/20.
The console script runs as a subprocess: start -> exec -> terminal --cmd -> kill."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import E2EService, private_service

from .conftest import REPO_ROOT

pytestmark = [pytest.mark.vm, pytest.mark.slow]


@pytest.fixture(scope="module")
def service() -> Iterator[E2EService]:
    with private_service("acli", prefix="acli-", pool="10.217.0.0/20") as s:
        yield s


def _aenv(svc: E2EService, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AENV_API_URL": svc.api_url, "E2B_SANDBOX_URL": svc.sandbox_url,
           "AENV_STATE_DIR": str(svc.state)}  # the key comes from the service's key file
    env.pop("AENV_API_KEY", None)
    env.pop("E2B_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "host.cli", *args], cwd=REPO_ROOT, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def test_start_exec_terminal_kill(service: E2EService) -> None:
    r = _aenv(service, "start", "--timeout", "120", "--env", "GREETING=hello vm")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        r = _aenv(service, "exec", sid, "--", 'echo "$GREETING"; id -un; echo oops >&2; exit 9')
        assert r.returncode == 9, r.stderr
        assert r.stdout.splitlines() == ["hello vm", "user"]
        assert r.stderr == "oops\n"

        r = _aenv(service, "terminal", sid, "--cmd", "echo from-pty; exit 4")
        assert r.returncode == 4, r.stderr
        assert "from-pty" in r.stdout

        r = _aenv(service, "ls", "--state", "running")
        assert sid in r.stdout
    finally:
        r = _aenv(service, "kill", sid)
    assert r.returncode == 0, r.stderr
    r = _aenv(service, "info", sid)
    assert r.returncode == 4 and r.stderr.startswith("aenv: API error 404: ")
