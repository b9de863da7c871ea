"""envd reseeds the kernel RNG from /init's `aenvEntropy` (envd/entropy.py), first thing.

The /init tests run `python -m envd` as the guest does (root, envd's own logging set up
by `__main__`) and read its stderr, which in a VM is the console the e2e test reads.
They touch this host's kernel RNG: crediting 64 random bytes and reseeding the CRNG
is harmless. The unit tests below them point the reseed at a regular file instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from envd import entropy
from envd.entropy import Reseed, entropy_from, reseed_kernel_rng

REPO = Path(__file__).resolve().parents[2]
RESEEDED = "kernel RNG reseeded: 64 bytes from the host credited and the CRNG reseeded"
CAP_SYS_ADMIN = 21


def _has_cap_sys_admin() -> bool:
    status = Path("/proc/self/status").read_text()
    caps = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("CapEff:"))
    return bool(int(caps, 16) >> CAP_SYS_ADMIN & 1)


needs_cap_sys_admin = pytest.mark.skipif(
    not _has_cap_sys_admin(), reason="RNDADDENTROPY needs CAP_SYS_ADMIN (run as root)")


class LoggedEnvd:
    """`python -m envd` on a free port with its stderr in a file."""

    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self._log = log

    def log(self) -> str:
        return self._log.read_text(errors="replace")

    def wait_for_log(self, needle: str, count: int = 1, timeout_s: float = 5.0) -> str:
        """The log once `needle` is in it `count` times, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (text := self.log()).count(needle) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return text


@contextlib.contextmanager
def logged_envd(tmp_path: Path) -> Iterator[LoggedEnvd]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "envd.stderr"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port", str(port),
             "--default-user", "user"], cwd=REPO, start_new_session=True, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"envd exited early with {proc.returncode}: "
                                   f"{log.read_text(errors='replace')[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=0.5).status_code == 204:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("envd did not become healthy")
            time.sleep(0.05)
        yield LoggedEnvd(url, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def envd_log(tmp_path: Path) -> Iterator[LoggedEnvd]:
    with logged_envd(tmp_path) as e:
        yield e


# -- /init against a real envd --------------------------------------------------------


@needs_cap_sys_admin
def test_init_with_entropy_credits_it_and_reseeds_the_crng(envd_log: LoggedEnvd) -> None:
    sent = secrets.token_bytes(64).hex()
    r = httpx.post(f"{envd_log.url}/init", json={
        "aenvEntropy": sent, "envVars": {"A": "1"}, "accessToken": "t1"})
    assert r.status_code == 204, r.text
    log = envd_log.wait_for_log(RESEEDED)
    assert log.count(RESEEDED) == 1, log
    assert "not reseeded" not in log
    assert sent not in log and sent.upper() not in log  # never logged
    # and the rest of /init still applied
    assert httpx.get(f"{envd_log.url}/envs", headers={"X-Access-Token": "t1"}).json() == {
        "A": "1"}


def test_init_without_entropy_behaves_as_before(envd_log: LoggedEnvd) -> None:
    r = httpx.post(f"{envd_log.url}/init", json={
        "envVars": {"B": "2"}, "defaultUser": "user", "defaultWorkdir": "/home/user",
        "timestamp": "2001-02-03T04:05:06Z"})
    assert r.status_code == 204 and r.content == b""
    assert httpx.get(f"{envd_log.url}/envs").json() == {"B": "2"}
    time.sleep(0.2)
    assert "kernel RNG" not in envd_log.log()


@needs_cap_sys_admin
def test_reseed_runs_first_but_after_the_token_check(envd_log: LoggedEnvd) -> None:
    url = envd_log.url

    def body(**extra: object) -> dict[str, object]:
        return {"aenvEntropy": secrets.token_bytes(64).hex(), **extra}

    # a body refused for another field is still reseeded from (nothing else applies)
    r = httpx.post(f"{url}/init", json=body(defaultUser="nobody-x", envVars={"C": "3"}))
    assert r.status_code == 400, r.text
    assert envd_log.wait_for_log(RESEEDED).count(RESEEDED) == 1
    assert httpx.get(f"{url}/envs").json() == {}
    assert httpx.post(f"{url}/init", json=body(accessToken="t1")).status_code == 204
    assert envd_log.wait_for_log(RESEEDED, 2).count(RESEEDED) == 2
    # once a token is set, nobody else gets envd to run the ioctls
    for headers in ({}, {"X-Access-Token": "wrong"}):
        assert httpx.post(f"{url}/init", json=body(), headers=headers).status_code == 401
    r = httpx.post(f"{url}/init", json=body(), headers={"X-Access-Token": "t1"})
    assert r.status_code == 204
    log = envd_log.wait_for_log(RESEEDED, 3)
    time.sleep(0.2)
    assert envd_log.log().count(RESEEDED) == 3, log


@pytest.mark.parametrize("value", [7, None, "", "zz", "ab" * 513, ["00"]])
def test_unusable_entropy_never_fails_init(envd_log: LoggedEnvd, value: object) -> None:
    r = httpx.post(f"{envd_log.url}/init", json={"aenvEntropy": value, "envVars": {"D": "4"}})
    assert r.status_code == 204, r.text
    assert httpx.get(f"{envd_log.url}/envs").json() == {"D": "4"}
    time.sleep(0.1)
    log = envd_log.log()
    assert "kernel RNG reseeded" not in log
    if value is not None:  # null is the field left out
        assert "kernel RNG not reseeded: 'aenvEntropy' ignored" in log, log


# -- envd.entropy on its own ----------------------------------------------------------


def test_ioctl_numbers_match_linux_random_h() -> None:
    def ioc(direction: int, nr: int, size: int) -> int:  # asm-generic/ioctl.h
        return direction << 30 | size << 16 | ord("R") << 8 | nr

    assert entropy.RNDADDENTROPY == ioc(1, 0x03, struct.calcsize("ii"))  # _IOW
    assert entropy.RNDRESEEDCRNG == ioc(0, 0x07, 0)  # _IO


def test_entropy_from() -> None:
    raw = secrets.token_bytes(64)
    assert entropy_from({"aenvEntropy": raw.hex()}) == raw
    assert entropy_from({"aenvEntropy": raw.hex().upper()}) == raw
    assert entropy_from({}) is None
    assert entropy_from({"aenvEntropy": None}) is None
    for bad in (1, "", "0", "xy", "00" * 513, {"a": 1}):
        assert entropy_from({"aenvEntropy": bad}) is None, bad


def test_credits_then_forces_a_reseed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    calls: list[tuple[object, ...]] = []
    monkeypatch.setattr(fcntl, "ioctl", lambda fd, req, *arg: calls.append((req, *arg)))
    raw = secrets.token_bytes(64)
    (tmp_path / "rng").touch()
    with caplog.at_level(logging.INFO, logger="envd.entropy"):
        assert reseed_kernel_rng(raw, device=str(tmp_path / "rng")) is Reseed.RESEEDED
    # struct rand_pool_info {int entropy_count (bits); int buf_size; __u32 buf[]}
    assert calls == [(entropy.RNDADDENTROPY, struct.pack("ii", 512, 64) + raw),
                     (entropy.RNDRESEEDCRNG,)]
    assert [r.getMessage() for r in caplog.records] == [RESEEDED]
    assert (tmp_path / "rng").read_bytes() == b""  # no write when the ioctl took it


def test_refused_ioctl_falls_back_to_a_write(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    # a regular file refuses RNG ioctls for real (ENOTTY), like a kernel without
    # CAP_SYS_ADMIN (EPERM): the bytes are then written, mixed in without credit
    raw = secrets.token_bytes(64)
    device = tmp_path / "rng"
    device.touch()
    with caplog.at_level(logging.INFO, logger="envd.entropy"):
        assert reseed_kernel_rng(raw, device=str(device)) is Reseed.MIXED
    assert device.read_bytes() == raw
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "not reseeded" in msg and "without credit" in msg and "ENOTTY" in msg
    assert raw.hex() not in msg


def test_eperm_falls_back_to_a_write(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refuse(fd: int, req: int, *arg: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(fcntl, "ioctl", refuse)
    device = tmp_path / "rng"
    device.touch()
    assert reseed_kernel_rng(b"\1" * 64, device=str(device)) is Reseed.MIXED
    assert device.read_bytes() == b"\1" * 64


def test_refused_reseed_after_credit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def credit_only(fd: int, req: int, *arg: object) -> None:
        if req == entropy.RNDRESEEDCRNG:
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fcntl, "ioctl", credit_only)
    (tmp_path / "rng").touch()
    assert reseed_kernel_rng(b"\2" * 64, device=str(tmp_path / "rng")) is Reseed.CREDITED


def test_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert reseed_kernel_rng(b"\3" * 64, device=str(tmp_path / "missing")) is Reseed.FAILED
    read_only = tmp_path / "ro"
    read_only.touch()
    read_only.chmod(0o400)
    if os.geteuid() != 0:  # root opens it anyway
        assert reseed_kernel_rng(b"\3" * 64, device=str(read_only)) is Reseed.FAILED
    assert all("not reseeded" in r.getMessage() for r in caplog.records)


@needs_cap_sys_admin
def test_reseeds_this_kernel() -> None:
    assert reseed_kernel_rng(secrets.token_bytes(64)) is Reseed.RESEEDED
