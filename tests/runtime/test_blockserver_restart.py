"""The block server serves every sandbox disk of the node; when it dies, the runtime's
watchdog restarts it (stacks recovered from their manifests, same sockets) and the VMs'
NBD clients reconnect (QEMU `reconnect-delay`) and rerun the requests they held: the guest
sees a pause, not I/O errors, and keeps every byte (issue 14 item 19)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from host.contract import SnapshotRef
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime

from .helpers import background, run

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

SUDO = "$([ $(id -u) = 0 ] || echo sudo)"
# writes 48 MiB of random data in 1 MiB fsynced chunks, hashing what it wrote
WRITER = ("import hashlib, os\n"
          "h = hashlib.sha256()\n"
          "with open('/home/user/load.bin', 'wb') as f:\n"
          "    for i in range(48):\n"
          "        b = os.urandom(1 << 20); h.update(b); f.write(b); f.flush()\n"
          "        os.fsync(f.fileno())\n"
          "        open('/home/user/progress', 'w').write(str(i + 1))\n"
          "open('/home/user/load.sha256', 'w').write(h.hexdigest())\n")


async def _guest_int(p, path: str) -> int:
    out = (await run(p, f"cat {path} 2>/dev/null || echo 0")).strip()
    return int(out or 0)


async def test_block_server_killed_under_writes_is_restarted_and_data_kept(
        runtime: NodeRuntime, template: SnapshotRef) -> None:
    p = await runtime.start("bsr0", template, NetworkConfig())
    try:
        await run(p, "cat > /home/user/writer.py <<'EOF'\n" + WRITER + "EOF")
        await background(p, "python3 /home/user/writer.py > /home/user/writer.log 2>&1")
        async with asyncio.timeout(600):   # a guard against a hang only
            while await _guest_int(p, "/home/user/progress") < 4:
                await asyncio.sleep(0.5)
        old_pid = int(runtime.block.pid_file.read_text())
        os.kill(old_pid, signal.SIGKILL)   # mid-workload
        async with asyncio.timeout(600):
            while True:
                new = runtime.block.pid_file.read_text().strip()
                if new and int(new) != old_pid and await runtime.block.ping():
                    break
                await asyncio.sleep(0.2)
            while "\n" not in (await run(p, "cat /home/user/load.sha256 2>/dev/null; "
                                            "echo")):
                await asyncio.sleep(0.5)
            while not (await run(p, "test -s /home/user/load.sha256 && echo y || true")
                       ).strip():
                await asyncio.sleep(0.5)
        assert (await run(p, "cat /home/user/writer.log")).strip() == ""  # no I/O error
        wrote = (await run(p, "cat /home/user/load.sha256")).strip()
        # read back from the disk, not the page cache
        await run(p, f"sync; echo 3 | {SUDO} tee /proc/sys/vm/drop_caches >/dev/null")
        read_back = (await run(p, "sha256sum /home/user/load.bin")).split()[0]
        assert read_back == wrote and len(wrote) == 64
        assert await _guest_int(p, "/home/user/progress") == 48
        dmesg = await run(p, f"{SUDO} dmesg | grep -ci 'i/o error' || true")
        assert dmesg.strip() == "0", await run(p, f"{SUDO} dmesg | tail -20")
    finally:
        await runtime.kill("bsr0")
