"""End-to-end fixtures: ONE `python -m host` service for the whole test session (real QEMU
VMs under TCG, its own temp state dir, free ports, namespace prefix `ae2e-` and address
pool 10.216.0.0/20 so it never touches another service's networks). The template is built
by the first create, once. Tests drive it through the unmodified e2b SDKs in mode B
(E2B_API_URL + E2B_SANDBOX_URL + E2B_API_KEY, spec §1.7)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.orchestrator.hostproc import REPO, HostService

PREFIX = "ae2e-"
POOL = "10.216.0.0/20"
TLS_POOL = "10.216.16.0/20"


class E2EService(HostService):
    """HostService with our own run dir, namespace prefix/pool and extra flags (--tls)."""

    def __init__(self, root: Path, *, prefix: str = PREFIX, pool: str = POOL,
                 extra: list[str] | None = None, tag: str = "ae2e") -> None:
        super().__init__(root, prefix=prefix, pool=pool, memory_mb=256, ttl_interval_s=1.0)
        self.run = Path(f"/tmp/{tag}{os.getpid()}")
        self.extra = list(extra or [])
        self.scheme = "https" if "--tls" in self.extra else "http"

    @property
    def api_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.api_port}"

    @property
    def sandbox_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.proxy_port}"

    @property
    def ca_cert(self) -> Path:
        return self.state / "tls" / "ca.pem"

    def start(self, timeout_s: float = 120.0) -> None:
        self.starts += 1
        log = open(self.root / f"service-{self.starts}.log", "wb")  # noqa: SIM115
        argv = [sys.executable, "-m", "host", "--state-dir", str(self.state),
                "--run-dir", str(self.run), "--api-port", str(self.api_port),
                "--proxy-port", str(self.proxy_port), "--memory-mb", str(self.memory_mb),
                "--network-prefix", self.prefix, "--network-pool", self.pool,
                "--ttl-interval", str(self.ttl_interval_s), "--envd-timeout", "240",
                *self.extra]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"host service exited {self.proc.returncode}: {self.log()}")
            try:
                r = httpx.get(f"{self.api_url}/health", timeout=1, verify=False)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"host service did not come up: {self.log()}")

    def client(self, timeout_s: float = 300.0) -> httpx.Client:
        verify: object = str(self.ca_cert) if self.scheme == "https" else True
        return httpx.Client(base_url=self.api_url, headers={"X-API-Key": self.api_key},
                            timeout=timeout_s, verify=verify)  # type: ignore[arg-type]

    def sdk_env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.api_url, "E2B_SANDBOX_URL": self.sandbox_url,
                "E2B_API_KEY": self.api_key}


def need_vm() -> None:
    try:
        import host.runtime  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"host.runtime is not importable yet: {exc}")
    cache = Path(os.environ.get("AENV_CACHE", "/var/cache/aenv"))
    if not (cache / "images" / "default" / "manifest.json").exists():
        pytest.skip("no guest image: run `make kernel image`")
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 not installed")


def build_template(s: E2EService) -> float:
    """First create builds the template; returns its wall time (cold boot + build)."""
    with s.client() as c:
        t0 = time.monotonic()
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60})
        took = time.monotonic() - t0
        assert r.status_code == 201, r.text
        c.delete(f"/sandboxes/{r.json()['sandboxID']}")
    return took


@pytest.fixture(scope="session")
def service() -> Iterator[E2EService]:
    need_vm()
    # not under pytest's basetemp: concurrent pytest runs rotate (delete) old basetemps
    root = Path(tempfile.mkdtemp(prefix="aenv-e2e-", dir="/var/tmp"))
    s = E2EService(root)
    try:
        s.start()
        s.template_build_s = build_template(s)  # type: ignore[attr-defined]
        print(f"\ne2e: first create (template build + cold boot): "
              f"{s.template_build_s:.1f}s")  # type: ignore[attr-defined]
        yield s
    finally:
        s.cleanup()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sdk(service: E2EService, monkeypatch: pytest.MonkeyPatch) -> E2EService:
    """Mode B env for the in-process Python SDK."""
    for k, v in service.sdk_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("E2B_DOMAIN", "sbx.localhost")
    return service
