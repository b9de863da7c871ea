"""Sandboxes with something to lose across a node's restart (tests/e2e/test_drain.py, and
tests/deploy/test_docker_restart.py through Docker): a file each, a background process
each, and one serving HTTP through the proxy. `make` sets them up through the E2B SDK (its
env pointing at the service), `check_resumed` asserts each came back with all of it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from .conftest import E2EService

PORT = 8000


@dataclass
class Fleet:
    ids: list[str]
    pids: dict[str, int]  # sandbox id -> the pid of its `sleep 3600`
    url: str  # the served file, through the proxy
    host: str  # ... with this Host header


def make(service: E2EService, n: int) -> Fleet:
    from e2b import Sandbox

    boxes = [Sandbox.create(timeout=900) for _ in range(n)]
    pids = {}
    for i, b in enumerate(boxes):
        b.files.write("/home/user/mine", f"sandbox {i}")
        pids[b.sandbox_id] = b.commands.run("sleep 3600", background=True, timeout=0).pid
    boxes[0].commands.run(f"cd /home/user && python3 -m http.server {PORT}", background=True,
                          timeout=0)
    fleet = Fleet([b.sandbox_id for b in boxes], pids, f"{service.sandbox_url}/mine",
                  boxes[0].get_host(PORT))
    for _ in range(100):  # the server is up
        if httpx.get(fleet.url, headers={"Host": fleet.host}, timeout=10).status_code == 200:
            break
        time.sleep(0.2)
    return fleet


def check_resumed(fleet: Fleet) -> None:
    """Every sandbox has its file and its process (same pid, same command line), and the
    server answers through the proxy."""
    from e2b import Sandbox

    for i, sid in enumerate(fleet.ids):
        again = Sandbox.connect(sid, timeout=900)
        assert again.files.read("/home/user/mine") == f"sandbox {i}"
        cmdline = again.commands.run(f"tr '\\0' ' ' < /proc/{fleet.pids[sid]}/cmdline")
        assert cmdline.stdout.strip() == "sleep 3600"
    r = httpx.get(fleet.url, headers={"Host": fleet.host}, timeout=60)
    assert r.status_code == 200 and r.text == "sandbox 0"


def with_files(n: int) -> list[str]:
    """n sandboxes, each with its file written and synced to its disk (it must survive a
    VM that dies uncommitted); their ids."""
    from e2b import Sandbox

    boxes = [Sandbox.create(timeout=900) for _ in range(n)]
    for i, b in enumerate(boxes):
        b.files.write("/home/user/mine", f"sandbox {i}")
        b.commands.run("sync")
    return [b.sandbox_id for b in boxes]


def check_files_and_kill(ids: list[str]) -> None:
    """Each sandbox (resumed first if paused) has its file; then it is killed."""
    from e2b import Sandbox

    for i, sid in enumerate(ids):
        again = Sandbox.connect(sid, timeout=900)
        assert again.files.read("/home/user/mine") == f"sandbox {i}"
        Sandbox.kill(sid)
