"""SDK access to a runtime sandbox (E2B_DEBUG + E2B_SANDBOX_URL) and leftover checks."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from host.contract import Placement
from host.runtime import NodeRuntime

_env_lock = threading.Lock()


def sdk(p: Placement) -> Any:
    """A sync e2b Sandbox talking straight to the sandbox's envd."""
    from e2b import Sandbox

    host, port = p.address(49983)
    wanted = {"E2B_DEBUG": "true", "E2B_SANDBOX_URL": f"http://{host}:{port}",
              "E2B_API_KEY": os.environ.get("E2B_API_KEY", "x")}
    with _env_lock:
        # the SDK reads its connection settings from the environment at create; put
        # back what was there after, so later tests (E2B_API_URL mode) do not inherit it
        saved = {k: os.environ.get(k) for k in wanted}
        os.environ.update(wanted)
        try:
            return Sandbox.create()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


async def run(p: Placement, cmd: str, timeout: float = 120) -> str:
    def go() -> str:
        r = sdk(p).commands.run(cmd, timeout=timeout)
        assert r.exit_code == 0, (cmd, r)
        return str(r.stdout)
    return await asyncio.to_thread(go)


async def background(p: Placement, cmd: str) -> int:
    def go() -> int:
        return int(sdk(p).commands.run(cmd, background=True).pid)
    return await asyncio.to_thread(go)


async def write(p: Placement, path: str, data: str) -> None:
    await asyncio.to_thread(lambda: sdk(p).files.write(path, data))


async def read(p: Placement, path: str) -> str:
    return await asyncio.to_thread(lambda: str(sdk(p).files.read(path)))


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


async def assert_gone(rt: NodeRuntime, sid: str) -> None:
    """Nothing of sandbox `sid` is left: no VM dir, no QEMU (at once), no stack, no
    namespace (once a pause's teardown of them, which a start of `sid` waits for, ended)."""
    assert sid not in rt.sandboxes
    assert not (rt.config.vms_dir / sid).exists()
    assert not (rt.config.vm_logs_dir / sid).exists()
    ps = (await asyncio.to_thread(
        subprocess.run, ["pgrep", "-f", str(rt.config.vms_dir / sid) + "/"],
        capture_output=True, text=True, check=False)).stdout
    assert ps.strip() == ""
    await rt.parts.settle(sid)
    stacks = [i.name for i in await rt.block.client.list()]
    assert f"sbx-{sid}" not in stacks
    assert f"{rt.config.network_prefix}{sid}" not in netns_names()


def pss_kib(pid: int) -> tuple[int, int]:
    """(Rss, Pss) in KiB from /proc/PID/smaps_rollup."""
    vals: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].rstrip(":") in ("Rss", "Pss"):
            vals[parts[0].rstrip(":")] = int(parts[1])
    return vals["Rss"], vals["Pss"]
