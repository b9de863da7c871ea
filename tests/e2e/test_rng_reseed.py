"""Issue 14 item 17: sandboxes restored from one memory snapshot (fork children, sandboxes
of one template) must not share the kernel RNG state of that snapshot. The host sends
fresh entropy with every /init and envd reseeds the kernel RNG from it before anything
else (envd/entropy.py); envd says so on the console, which `GET /sandboxes/{id}/logs`
serves.

Checked per sandbox right after it is handed out: the console has envd's "kernel RNG
reseeded" line, and 32 bytes of /dev/urandom differ between siblings. The bytes alone
may differ without the reseed too (the kernel reseeds on a timer, mixing RDRAND in);
the console line is what proves the reseed ran."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from .conftest import E2EService

if TYPE_CHECKING:
    from e2b import Sandbox

pytestmark = [pytest.mark.vm, pytest.mark.slow]

RESEEDED = "kernel RNG reseeded: 64 bytes from the host credited and the CRNG reseeded"
READ_URANDOM = "head -c32 /dev/urandom | od -An -tx1"


def urandom32(sbx: Sandbox) -> str:
    out = sbx.commands.run(READ_URANDOM).stdout
    hexed = "".join(out.split())
    assert len(hexed) == 64, out
    return hexed


def console_reseeds(service: E2EService, sandbox_id: str, timeout_s: float = 20.0) -> list[str]:
    """envd's reseed lines on the sandbox's console (this VM's serial log only: it starts
    empty at each restore). Waits for the first: the UART may lag behind /init's reply."""
    deadline = time.monotonic() + timeout_s
    with service.client() as c:
        while True:
            r = c.get(f"/sandboxes/{sandbox_id}/logs", params={"limit": 10_000})
            assert r.status_code == 200, r.text
            lines = [e["line"] for e in r.json()["logs"] if "kernel RNG" in e["line"]]
            if lines or time.monotonic() > deadline:
                return lines
            time.sleep(0.5)


def check_siblings(service: E2EService, siblings: list[Sandbox]) -> None:
    draws = [urandom32(s) for s in siblings]  # first thing each sandbox runs
    for s in siblings:
        lines = console_reseeds(service, s.sandbox_id)
        assert any(RESEEDED in ln for ln in lines), (s.sandbox_id, lines)
        assert not any("not reseeded" in ln for ln in lines), (s.sandbox_id, lines)
    assert len(set(draws)) == len(draws), draws


def test_fork_children_are_reseeded(env: E2EService) -> None:
    from e2b import Sandbox

    parent = Sandbox.create(timeout=300)
    kids: list[Sandbox] = []
    try:
        res = parent.fork(count=2, timeout=300)
        kids = [k for k in res if isinstance(k, Sandbox)]
        assert len(kids) == 2, res
        check_siblings(env, kids)
    finally:
        for s in [parent, *kids]:
            s.kill()


def test_sandboxes_of_one_template_are_reseeded(env: E2EService) -> None:
    from e2b import Sandbox

    made: list[Sandbox] = []
    try:
        made = [Sandbox.create(timeout=300) for _ in range(2)]
        assert made[0].get_info().template_id == made[1].get_info().template_id
        check_siblings(env, made)
    finally:
        for s in made:
            s.kill()
