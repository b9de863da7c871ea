"""envd's plain HTTP routes with an access token: /init, /envs, /metrics, /health, token
and signed-URL auth on /files, and the SDK talking to a secured envd.

Runs its own envd on a free port (never the shared 49983 instance): /init changes
sandbox-wide state and the token must not leak into other tests. `private_envd` is
also used by the other envd test modules of this suite.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import AuthenticationException
from e2b.sandbox.signature import get_signature
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
USER = pwd.getpwnam("user")
TOKEN = "tok-" + uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def private_envd(*, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """A fresh `python -m envd` on a free port (default user `user`); killed on exit."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port", str(port),
         "--default-user", "user"],
        cwd=REPO, start_new_session=True, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"envd exited early with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=0.5).status_code == 204:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("envd did not become healthy")
            time.sleep(0.05)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def secured_sandbox(url: str, token: str | None) -> Sandbox:
    """An SDK Sandbox bound to envd at `url` that sends `token` like a real secured sandbox."""
    headers = {"E2b-Sandbox-Id": "debug_sandbox_id", "E2b-Sandbox-Port": "49983"}
    if token:
        headers["X-Access-Token"] = token
    config = ConnectionConfig(debug=True, sandbox_url=url, extra_sandbox_headers=headers)
    return Sandbox(sandbox_id="debug_sandbox_id", sandbox_domain=None,
                   envd_version=Version("0.6.13"), envd_access_token=token,
                   traffic_access_token=None, connection_config=config)


@pytest.fixture(scope="module")
def secured_envd() -> Iterator[str]:
    with private_envd() as (url, _):
        r = httpx.post(f"{url}/init", json={
            "envVars": {"FOO": "bar"}, "accessToken": TOKEN,
            "defaultUser": "user", "defaultWorkdir": "/home/user",
            # far in the past: envd must not touch this machine's clock
            "timestamp": "2001-02-03T04:05:06.123456789Z",
        })
        assert r.status_code == 204, r.text
        yield url


AUTH = {"X-Access-Token": TOKEN}


def test_init_did_not_move_the_clock(secured_envd):
    assert time.time() > 1_700_000_000


def test_health_needs_no_token(secured_envd):
    r = httpx.get(f"{secured_envd}/health")
    assert r.status_code == 204 and r.content == b""


@pytest.mark.parametrize("method, route", [
    ("GET", "/envs"), ("GET", "/metrics"), ("GET", "/files?path=/etc/hostname"),
    ("POST", "/files?path=/tmp/x"), ("POST", "/init"),
])
def test_token_required(secured_envd, method, route):
    for headers in ({}, {"X-Access-Token": "wrong"}):
        r = httpx.request(method, f"{secured_envd}{route}", headers=headers)
        assert r.status_code == 401, (route, headers, r.text)
        assert r.headers["content-type"] == "application/json"
        assert r.json()["code"] == 401 and r.json()["message"]


def test_rpc_requires_token(secured_envd):
    url = f"{secured_envd}/filesystem.Filesystem/Stat"
    headers = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    r = httpx.post(url, headers=headers, json={"path": "/tmp"})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = httpx.post(url, headers={**headers, **AUTH}, json={"path": "/tmp"})
    assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"


def test_envs_and_metrics(secured_envd):
    assert httpx.get(f"{secured_envd}/envs", headers=AUTH).json() == {"FOO": "bar"}
    m = httpx.get(f"{secured_envd}/metrics", headers=AUTH).json()
    assert set(m) == {"ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache",
                      "mem_total_mib", "mem_used_mib", "disk_used", "disk_total"}
    assert m["cpu_count"] >= 1 and 0 < m["mem_used"] < m["mem_total"]
    assert m["mem_total_mib"] == m["mem_total"] // (1024 * 1024)
    assert 0 < m["disk_used"] < m["disk_total"] and abs(m["ts"] - time.time()) < 60


def test_reclaim_needs_the_token(secured_envd):
    """POST /aenv/reclaim (ours, envd/http/reclaim.py) is token-protected like /envs; only
    the refusals are sent here: a real call would drop this host's page cache."""
    r = httpx.post(f"{secured_envd}/aenv/reclaim")
    assert r.status_code == 401 and r.json()["code"] == 401
    assert httpx.get(f"{secured_envd}/aenv/reclaim", headers=AUTH).status_code == 405


def test_init_validation_and_reinit_with_new_token():
    with private_envd() as (url, _):
        # No token yet: /init is open. Bad bodies change nothing.
        for body in (b"[1]", b"{not json", b'{"envVars": {"A": 1}}', b'{"defaultUser": "nobody-x"}',
                     b'{"timestamp": "yesterday"}'):
            r = httpx.post(f"{url}/init", content=body)
            assert r.status_code == 400 and r.json()["code"] == 400, body
        assert httpx.get(f"{url}/envs").json() == {}
        assert httpx.post(f"{url}/init", json={"accessToken": "t1", "envVars": {"A": "1"}}
                          ).status_code == 204
        # From now on a re-init must present the current token.
        assert httpx.post(f"{url}/init", json={"accessToken": "t2"}).status_code == 401
        assert httpx.post(f"{url}/init", json={"accessToken": "t2"},
                          headers={"X-Access-Token": "t2"}).status_code == 401
        r = httpx.post(f"{url}/init", json={"accessToken": "t2", "envVars": {"B": "2"}},
                       headers={"X-Access-Token": "t1"})
        assert r.status_code == 204
        assert httpx.get(f"{url}/envs", headers={"X-Access-Token": "t1"}).status_code == 401
        assert httpx.get(f"{url}/envs", headers={"X-Access-Token": "t2"}).json() == {
            "A": "1", "B": "2"}


def test_sdk_with_token(secured_envd, home_dir):
    sbx = secured_sandbox(secured_envd, TOKEN)
    sbx.files.write(str(home_dir / "a.txt"), "hello")
    assert sbx.files.read(str(home_dir / "a.txt")) == "hello"
    assert [e.name for e in sbx.files.list(str(home_dir))] == ["a.txt"]
    bad = secured_sandbox(secured_envd, "wrong-token")
    with pytest.raises(AuthenticationException):
        bad.files.read(str(home_dir / "a.txt"))
    with pytest.raises(AuthenticationException):
        bad.files.write(str(home_dir / "b.txt"), "x")
    with pytest.raises(AuthenticationException):
        bad.files.list(str(home_dir))
    assert not (home_dir / "b.txt").exists()


def test_signed_urls(secured_envd, home_dir):
    sbx = secured_sandbox(secured_envd, TOKEN)
    target = str(home_dir / "signed.txt")
    up = sbx.upload_url(target, use_signature_expiration=120)
    assert "signature=v1_" in up
    r = httpx.post(up, files={"file": (target, b"signed")})  # no X-Access-Token header
    assert r.status_code == 200, r.text
    assert Path(target).stat().st_uid == USER.pw_uid
    down = sbx.download_url(target)
    assert httpx.get(down).text == "signed"
    # a read signature does not authorize a write, and vice versa
    assert httpx.post(down, files={"file": (target, b"evil")}).status_code == 401
    assert httpx.get(up).status_code == 401
    # tampered signature
    tampered = down.replace("signature=v1_", "signature=v1_X")
    r = httpx.get(tampered)
    assert r.status_code == 401 and r.json()["code"] == 401
    # signature for another path
    other = sbx.download_url(str(home_dir / "other.txt")).split("?", 1)[1]
    assert httpx.get(f"{secured_envd}/files?path={target}&" + other.split("&", 1)[1]
                     ).status_code == 401
    # expired signature (computed with the SDK's own helper)
    sig = get_signature(target, "read", None, TOKEN, -10)
    r = httpx.get(f"{secured_envd}/files", params={
        "path": target, "signature": sig["signature"],
        "signature_expiration": str(sig["expiration"])})
    assert r.status_code == 401 and "expired" in r.json()["message"]
    # a signature for user `root` lets root read; the username is part of the hash
    sig = get_signature(target, "read", "root", TOKEN)
    r = httpx.get(f"{secured_envd}/files", params={
        "path": target, "username": "root", "signature": sig["signature"]})
    assert r.status_code == 200 and r.text == "signed"
    r = httpx.get(f"{secured_envd}/files", params={
        "path": target, "username": "user", "signature": sig["signature"]})
    assert r.status_code == 401
    assert Path(target).read_text() == "signed"
