"""The node's single block server process: adopted by its control socket, else started
in its own session (a SIGKILLed host service leaves it, and the VMs' disks, running)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from host.storage.control import CONTROL_SOCKET, NBD_SOCKET, BlockServerClient, own_socket
from host.storage.errors import StorageError

from .config import RuntimeConfig
from .errors import NodeRuntimeError

log = logging.getLogger(__name__)
_READY_S = 30.0


class BlockServerHandle:
    """Where the node's block server listens; `pid` is known when this process started it
    (or found it in its pid file)."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.socket_dir = config.storage_run_dir
        self.control_socket = self.socket_dir / CONTROL_SOCKET
        self.nbd_socket = self.socket_dir / NBD_SOCKET
        self.pid_file = config.state_dir / "blockserver.pid"
        self.log_file = config.state_dir / "blockserver.log"
        self.client = BlockServerClient(self.control_socket)
        self.started_here = False

    def export_socket(self, stack: str) -> Path:
        """The socket serving `stack` alone: what a (jailed) VMM of that stack connects to."""
        return own_socket(self.socket_dir, stack)

    async def ping(self) -> bool:
        try:
            return await asyncio.wait_for(self.client.ping(), 5.0)
        except (StorageError, OSError, TimeoutError):
            return False

    async def ensure(self) -> None:
        if self.control_socket.exists() and await self.ping():
            return
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        (self.config.state_dir / "storage").mkdir(parents=True, exist_ok=True)
        argv = [self.config.block_server_python or sys.executable, "-m",
                "host.storage.blockserver", "--socket-dir", str(self.socket_dir),
                "--state-dir", str(self.config.state_dir / "storage"),
                "--repo", self.config.repository_spec,
                "--cache-dir", str(self.config.chunk_cache_dir),
                "--cache-mib", str(self.config.cache_mib),
                *(["--peers-file", str(self.config.peers_file)] if self.config.p2p else [])]
        repo_root = Path(__file__).resolve().parents[2]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root),
                                                         env.get("PYTHONPATH", "")) if p)
        def spawn() -> subprocess.Popen[bytes]:
            with open(self.log_file, "ab") as log:
                return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        start_new_session=True, cwd=repo_root, env=env)

        proc = await asyncio.to_thread(spawn)
        self.pid_file.write_text(str(proc.pid))
        self.started_here = True
        deadline = time.monotonic() + _READY_S
        while not (self.control_socket.exists() and await self.ping()):
            if proc.poll() is not None:
                raise NodeRuntimeError(f"block server exited with {proc.returncode}; see "
                                       f"{self.log_file}")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise NodeRuntimeError(f"block server not ready in {_READY_S}s; see "
                                       f"{self.log_file}")
            await asyncio.sleep(0.05)
        # Popen's object is dropped: the server outlives us; reap it if it dies meanwhile
        self._proc = proc

    def alive(self) -> bool | None:
        """Whether the block server process lives (None: not known here: no pid)."""
        proc = getattr(self, "_proc", None)
        if proc is not None:
            return proc.poll() is None
        with contextlib.suppress(OSError, ValueError):
            return Path(f"/proc/{int(self.pid_file.read_text())}").exists()
        return None

    async def watch(self, interval_s: float = 0.5) -> None:
        """Restart the block server whenever it dies (runs until cancelled). It recovers
        every stack from its manifests and listens on the same sockets; the VMs' NBD
        clients reconnect within their reconnect-delay and rerun the requests they held,
        so a crash of the server costs the guests a pause, not I/O errors."""
        while True:
            await asyncio.sleep(interval_s)
            alive = self.alive()
            if alive is False or (alive is None and not await self.ping()):
                log.warning("the block server died; restarting it (its stacks are "
                            "recovered from %s)", self.config.state_dir / "storage")
                try:
                    await self.ensure()
                except Exception:
                    log.exception("restarting the block server failed; retrying")
                else:
                    log.info("block server restarted")

    async def stop(self) -> None:
        """Stop the block server (node shutdown, tests). Its stacks stay on disk."""
        pid = None
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pid_file.read_text())
        if pid is None:
            return
        proc = getattr(self, "_proc", None)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc is not None:
                if proc.poll() is not None:
                    break
            elif not Path(f"/proc/{pid}").exists():
                break
            await asyncio.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if proc is not None:
                proc.wait()
        self.pid_file.unlink(missing_ok=True)
        for s in (self.control_socket, self.nbd_socket):
            s.unlink(missing_ok=True)
