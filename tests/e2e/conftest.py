"""End-to-end fixtures: ONE `python -m host` service for the whole test session (real QEMU
VMs under TCG, its own temp state dir, free ports, namespace prefix `ae2e-` and address
pool 10.216.0.0/20 so it never touches another service's networks). The template is built
by the first create, once. Tests drive it through the unmodified e2b SDKs in mode B
(E2B_API_URL + E2B_SANDBOX_URL + E2B_API_KEY, spec §1.7)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.images.conftest import auth_registry, images, registry  # noqa: F401 - fixtures
from tests.orchestrator.hostproc import HostService
from tests.vmassets import require_vm_assets

PREFIX = "ae2e-"
POOL = "10.216.0.0/20"
TLS_POOL = "10.216.16.0/20"


class E2EService(HostService):
    """HostService with our own run dir, namespace prefix/pool and extra flags (--tls)."""

    def __init__(self, root: Path, *, prefix: str = PREFIX, pool: str = POOL,
                 extra: list[str] | None = None, tag: str = "ae2e") -> None:
        super().__init__(root, prefix=prefix, pool=pool, memory_mb=256, ttl_interval_s=1.0,
                         extra=extra, tag=tag)

    def sdk_env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.api_url, "E2B_SANDBOX_URL": self.sandbox_url,
                "E2B_API_KEY": self.api_key,
                # the SDKs reach the volume content API here (else https://api.<domain>)
                "E2B_VOLUME_API_URL": self.api_url}


def need_vm() -> None:
    require_vm_assets()


def use_sdk(s: E2EService, mp: pytest.MonkeyPatch) -> None:
    """Point the in-process Python SDK at `s` (mode B env, the sandbox domain)."""
    for k, v in s.sdk_env().items():
        mp.setenv(k, v)
    mp.setenv("E2B_DOMAIN", "sbx.localhost")


@contextlib.contextmanager
def private_service(tag: str, *, prefix: str, pool: str, extra: list[str] | None = None,
                    memory_mb: int | None = None,
                    wrapper: list[str] | None = None) -> Iterator[E2EService]:
    """A service of its own (namespace `prefix`, address `pool`, more `python -m host`
    flags, guest RAM, an argv `wrapper`), its template built; everything it started is
    stopped and its dirs removed afterwards. Its root is under /var/tmp, not pytest's
    basetemp: concurrent pytest runs rotate (delete) old basetemps."""
    need_vm()
    root = Path(tempfile.mkdtemp(prefix=f"aenv-{tag}-", dir="/var/tmp"))
    s = E2EService(root, prefix=prefix, pool=pool, extra=extra, tag=tag)
    if memory_mb is not None:
        s.memory_mb = memory_mb
    s.wrapper = list(wrapper or [])
    try:
        s.start()
        s.template_build_s = build_template(s)  # type: ignore[attr-defined]
        yield s
    finally:
        s.cleanup()
        shutil.rmtree(root, ignore_errors=True)


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
    with private_service("ae2e", prefix=PREFIX, pool=POOL) as s:
        print(f"\ne2e: first create (template build + cold boot): "
              f"{s.template_build_s:.1f}s")  # type: ignore[attr-defined]
        yield s


@pytest.fixture(scope="module")
def env(service: E2EService) -> Iterator[E2EService]:
    """The service, with the in-process Python SDK's mode B env set for the module."""
    with pytest.MonkeyPatch.context() as mp:
        use_sdk(service, mp)
        yield service


@pytest.fixture
def sdk(service: E2EService, monkeypatch: pytest.MonkeyPatch) -> E2EService:
    """Mode B env for the in-process Python SDK."""
    use_sdk(service, monkeypatch)
    return service
