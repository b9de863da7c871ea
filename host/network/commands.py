"""Running `ip`, `nft` and `sysctl` (argv lists, never shell strings), in a namespace.

All foreign errors are translated here: a missing binary becomes
`NetworkUnavailableError`, a non-zero exit or a timeout `NetworkCommandError`.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import os
import shutil
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import NetworkCommandError, NetworkError, NetworkUnavailableError

COMMAND_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


async def run(
    argv: Sequence[str],
    *,
    input_text: str | None = None,
    check: bool = True,
    timeout_s: float = COMMAND_TIMEOUT_S,
) -> Result:
    """Run argv; raise NetworkCommandError on failure when `check`."""
    argv = list(argv)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if input_text is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        raise NetworkUnavailableError(f"{argv[0]} not found: {exc}") from exc
    except OSError as exc:
        raise NetworkCommandError(argv, None, str(exc)) from exc
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate(
                input_text.encode() if input_text is not None else None
            )
    except TimeoutError as exc:
        proc.kill()
        await proc.wait()
        raise NetworkCommandError(argv, None, f"timed out after {timeout_s}s") from exc
    except asyncio.CancelledError:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    result = Result(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))
    if check and result.returncode != 0:
        raise NetworkCommandError(argv, result.returncode, result.stderr)
    return result


def netns_exec_argv(netns: str | None, argv: Sequence[str]) -> list[str]:
    """argv run inside `netns` (`ip netns exec NAME ...`); unchanged when netns is None."""
    if netns is None:
        return list(argv)
    return ["ip", "netns", "exec", netns, *argv]


class Namespace:
    """Commands that act on one network namespace (None: the caller's own)."""

    def __init__(self, name: str | None) -> None:
        self.name = name

    def _ip(self, *args: str) -> list[str]:
        return ["ip", *(["-n", self.name] if self.name else []), *args]

    async def ip(self, *args: str, check: bool = True) -> Result:
        return await run(self._ip(*args), check=check)

    async def ip_json(self, *args: str) -> list[dict[str, Any]]:
        result = await run(self._ip("-j", *args))
        text = result.stdout.strip()
        return json.loads(text) if text else []

    async def ip_batch(self, lines: Sequence[str]) -> Result:
        """Several `ip` commands in one process (stops at the first failure)."""
        return await run(self._ip("-batch", "-"), input_text="\n".join(lines) + "\n")

    async def nft(self, script: str) -> Result:
        """Apply an nft script as one atomic transaction."""
        return await run(netns_exec_argv(self.name, ["nft", "-f", "-"]), input_text=script)

    async def nft_out(self, *args: str, check: bool = True) -> Result:
        return await run(netns_exec_argv(self.name, ["nft", *args]), check=check)

    async def sysctl_read(self, key: str) -> str:
        result = await run(netns_exec_argv(self.name, ["sysctl", "-n", key]))
        return result.stdout.strip()

    async def sysctl_write(self, values: dict[str, str]) -> None:
        if values:
            argv = ["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in values.items())]
            await run(netns_exec_argv(self.name, argv))


CLONE_NEWNET = 0x40000000


def netns_preexec(netns: str) -> Callable[[], None]:
    """A `preexec_fn` that moves the child into `netns` with setns(2) before exec.

    An alternative to `netns_exec_argv` for callers that want the VMM to keep the parent's
    mount namespace (`ip netns exec` unshares it to remount /sys). Note that preexec_fn is
    not safe in processes that run threads while forking (see subprocess docs)."""
    path = netns_path(netns)
    libc = _libc()

    def enter() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({path}): {os.strerror(err)}")
        finally:
            os.close(fd)

    return enter


async def listen_in(netns: str, host: str, port: int, backlog: int = 64) -> socket.socket:
    """A TCP socket listening on host:port inside `netns`.

    A socket belongs to the namespace it was made in, whichever thread uses it later, so
    a short-lived thread of its own enters the namespace (setns moves only the calling
    thread), makes the socket and ends: no thread of the service stays inside."""
    enter = netns_preexec(netns)
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            enter()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(backlog)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
            made.append(sock)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            failed.append(exc)

    thread = threading.Thread(target=work, name=f"listen-{netns}", daemon=True)
    thread.start()
    await asyncio.to_thread(thread.join)
    if failed:
        raise NetworkError(f"listening on {host}:{port} in {netns} failed: {failed[0]}")
    return made[0]


def have_binaries(*names: str) -> list[str]:
    """Names of the binaries that are missing from PATH."""
    return [n for n in names if shutil.which(n) is None]


NETNS_DIR = "/run/netns"
MNT_DETACH = 2


def netns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def netns_inode(name: str) -> int | None:
    """The inode of a named network namespace (None: no such name), for `pids_in_netns`."""
    try:
        return os.stat(netns_path(name)).st_ino
    except FileNotFoundError:
        return None


def remove_netns(name: str) -> None:
    """What `ip netns del NAME` does, without a process per call (that spawn was most of
    a pause's network teardown): detach the bind mount that pins the namespace and remove
    its file. A missing name is not an error."""
    path = netns_path(name)
    if not os.path.exists(path):
        return
    if _libc().umount2(path.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err != 22:  # EINVAL: not a mount point (a half-made namespace): just unlink
            raise NetworkCommandError(["umount2", path], None, os.strerror(err))
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise NetworkCommandError(["unlink", path], None, str(exc)) from exc


def pids_in_netns(ino: int) -> list[str]:
    """Processes still in the network namespace with inode `ino` (it lives while they do)."""
    want = f"net:[{ino}]"
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/ns/net") == want:
                    pids.append(pid)
            except OSError:  # gone meanwhile, or a kernel thread
                continue
    return pids


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
