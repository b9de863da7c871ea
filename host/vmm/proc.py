"""Process, port and log helpers shared by the VMM drivers (Linux-only bits kept small)."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import os
import signal
import socket
from collections import deque
from pathlib import Path
from typing import Protocol

_PR_SET_PDEATHSIG = 1


class ProcessHandle(Protocol):
    """What the drivers need of a VMM process: asyncio's Process, or `AdoptedProcess`."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


def start_time(pid: int) -> int | None:
    """The process start time (clock ticks since boot, /proc/PID/stat field 22): with the
    pid it identifies a process across pid reuse. None if the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # zombie/dead: gone for our purposes
        return None
    return int(fields[19])


class AdoptedProcess:
    """A VMM process this host service did not spawn (re-attached after a restart).

    It is not our child, so there is no exit status: `returncode` is -1 once it is gone,
    found by polling /proc (the pid plus its start time, so a reused pid is not mistaken
    for it).
    """

    POLL_S = 0.02

    def __init__(self, pid: int, started: int) -> None:
        self._pid = pid
        self._started = started
        self._rc: int | None = None

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        if self._rc is None and start_time(self._pid) != self._started:
            self._rc = -1
        return self._rc

    async def wait(self) -> int:
        while (rc := self.returncode) is None:
            await asyncio.sleep(self.POLL_S)
        return rc


def _prctl(option: int, arg: int) -> None:
    """prctl(2) on this process; a no-op where prctl is missing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """preexec_fn: SIGKILL the child when the process that spawned it dies, so a crashed
    host service or test run never leaves VMs behind."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_THP_DISABLE = 41


@functools.cache
def no_huge_pages_for_children() -> None:
    """Turn transparent huge pages off for this process, and so for every VMM it spawns
    from now on (the flag is inherited through fork and kept across exec). QEMU madvises
    its TCG code buffer for huge pages: each 2 MiB page a little code touches stays
    resident. Guest RAM is unaffected: it is a file mapping, copied on write by 4 KiB
    page. Set on ourselves rather than in a preexec_fn, which would rule out vfork."""
    _prctl(_PR_SET_THP_DISABLE, 1)


_PR_SET_MEMORY_MERGE = 67


@functools.cache
def merge_memory_of_children() -> None:
    """Let KSM merge every anonymous page of this process and of every VMM it spawns from
    now on (inherited through fork and exec, Linux 6.7+): QEMU's heap and the pages its
    libraries dirtied are as alike between VMs as their guest RAM (which QEMU marks
    mergeable itself with `merge=on`). Inert while ksmd does not run."""
    _prctl(_PR_SET_MEMORY_MERGE, 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller must handle losing the race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rotate_log(path: Path, max_bytes: int) -> bool:
    """Past `max_bytes`, move the log's newest `max_bytes // 2` bytes to `<path>.1` and
    empty the log. Its writer opened it O_APPEND (QEMU's `append=on`, Firecracker's
    stdout), so it goes on at the new end. Between two calls a log and its predecessor
    hold about 1.5x `max_bytes` plus what was written meanwhile (a jail's RLIMIT_FSIZE
    bounds that); what a writer adds between the copy and the truncate is lost, which a
    flood's console can afford. True when it rotated."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size <= max_bytes:
        return False
    keep = max_bytes // 2
    with path.open("rb") as f:
        f.seek(max(0, size - keep))
        data = f.read(keep)
    old = path.with_name(path.name + ".1")
    tmp = path.with_name(path.name + ".1.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, old)
    os.truncate(path, 0)
    return True


def tail(path: Path, lines: int = 30, max_bytes: int = 64 * 1024) -> str:
    """The last `lines` lines of a text file and, where it is short of them, of its
    rotated predecessor `<path>.1` ('' if neither exists)."""
    data = _tail_bytes(path, max_bytes)
    if data.count(b"\n") < lines and len(data) < max_bytes:
        data = _tail_bytes(path.with_name(path.name + ".1"), max_bytes - len(data)) + data
    text = data.decode(errors="replace").replace("\r\n", "\n")
    return "\n".join(deque(text.splitlines(), maxlen=lines))


def _tail_bytes(path: Path, max_bytes: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read(max_bytes)
    except OSError:
        return b""


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except OSError as exc:  # pragma: no cover - EPERM would be a bug in our setup
        if exc.errno != errno.ESRCH:
            raise


async def terminate(proc: ProcessHandle, *, grace_s: float, kill_s: float = 5.0,
                    already_asked: bool = False) -> bool:
    """Stop `proc` (leader of its own session) and reap it.

    SIGTERM (unless the caller already asked it to exit), wait up to `grace_s`, then
    SIGKILL the whole group and wait up to `kill_s`. Returns True when the process is
    reaped and no process of its group remains (helpers such as `exec:` migration
    children included).
    """
    pgid = proc.pid
    if proc.returncode is None:
        if not already_asked:
            signal_group(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            signal_group(pgid, signal.SIGKILL)
            try:
                await asyncio.wait_for(proc.wait(), kill_s)
            except TimeoutError:
                return False
    # The leader is gone; children it forked (if any) may still hold files open.
    if group_alive(pgid):
        signal_group(pgid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + kill_s
        while group_alive(pgid) and loop.time() < deadline:
            await asyncio.sleep(0.01)
    return proc.returncode is not None and not group_alive(pgid)


async def run_command(argv: list[str], *, timeout_s: float = 30.0) -> tuple[int, str]:
    """(exit code, stdout+stderr) of a short helper command (nbd-client, mount, ...):
    127 when it cannot be run, 124 when it ran past `timeout_s` (it is then killed)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        return 127, f"cannot run {argv[0]}: {exc}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"{argv[0]} timed out after {timeout_s:g}s"
    rc = proc.returncode
    return (rc if rc is not None else -1), out.decode(errors="replace")
