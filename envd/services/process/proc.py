"""One object per child process: owns its pid, pipes or PTY, output pumps and reaping.

A `Proc` outlives the requests that started or attached to it. Its output is pumped by
its own task into a `Fanout` regardless of who is listening; it is always reaped
(pidfd when available, else a waiting thread), and its file descriptors are closed
once it has exited and its output is drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
import struct
import subprocess
import termios
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...users import User
from . import switch
from .fanout import Fanout, Subscription

log = logging.getLogger("envd.process")

READ_CHUNK = 64 * 1024
# After exit, how long an output fd may stay silent before we stop waiting for EOF:
# a background grandchild (`server &`) can hold the pipe open indefinitely.
DRAIN_GRACE_S = 0.2


class ProcessStateError(Exception):
    """The operation does not fit the process's state (no PTY, stdin closed, ...)."""


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended, in upstream envd's (Go ProcessState) vocabulary."""

    exit_code: int
    exited: bool
    status: str
    error: str | None

    @classmethod
    def from_returncode(cls, rc: int) -> ExitStatus:
        if rc >= 0:
            status = f"exit status {rc}"
            return cls(rc, True, status, status if rc else None)
        try:
            name = (signal.strsignal(-rc) or f"signal {-rc}").lower()
        except ValueError:
            name = f"signal {-rc}"
        status = f"signal: {name}"
        return cls(-1, False, status, status)


@dataclass(frozen=True)
class SpawnSpec:
    """Everything needed to start a process; built and validated by the service."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: User
    stdin: bool = True
    pty_size: tuple[int, int] | None = None  # (cols, rows)
    tag: str | None = None
    meta: object = None  # opaque, e.g. the request's ProcessConfig for List


Output = tuple[str, bytes]  # ("stdout" | "stderr" | "pty", data)


def _set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _acquire_controlling_tty() -> None:  # runs in the child, after setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _popen(spec: SpawnSpec, stdio: dict[str, Any], creds: dict[str, Any],
           ) -> subprocess.Popen[bytes]:
    # Own session (setsid): the process group can be signalled as a whole, and a PTY
    # child can take its terminal as controlling tty.
    return switch.popen(spec.argv, creds, env=spec.env, cwd=spec.cwd,
                        start_new_session=True, close_fds=True, **stdio)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _abandon(launch: asyncio.Future[subprocess.Popen[bytes]], fds: list[int]) -> None:
    """Clean up after a spawn whose caller was cancelled while the fork was in flight."""
    _close_all(fds)
    if launch.cancelled() or launch.exception() is not None:
        return
    popen = launch.result()
    with contextlib.suppress(OSError):
        os.killpg(popen.pid, signal.SIGKILL)
    threading.Thread(target=popen.wait, name=f"reap-{popen.pid}", daemon=True).start()


class Proc:
    """A spawned process and everything it owns. Create with `await Proc.spawn(...)`."""

    def __init__(self, spec: SpawnSpec, popen: subprocess.Popen[bytes], *,
                 outputs: list[tuple[int, str]], stdin_fd: int | None, master_fd: int | None,
                 fanout: Fanout[Output, ExitStatus]) -> None:
        self.spec = spec
        self.pid = popen.pid
        self.tag = spec.tag
        self.fanout = fanout
        self._popen = popen
        self._outputs = outputs
        self._stdin_fd = stdin_fd
        self._master_fd = master_fd
        self._write_lock = asyncio.Lock()
        self._open_fds = {fd for fd, _ in outputs} | ({stdin_fd} if stdin_fd is not None else set())
        self._exit_seen = False
        self._wakeups: set[asyncio.Future[None]] = set()
        self._kill_timer: asyncio.TimerHandle | None = None
        self.exit_status: ExitStatus | None = None
        self.done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._on_exit: Callable[[Proc], None] | None = None

    # -- lifecycle ------------------------------------------------------------
    @classmethod
    async def spawn(cls, spec: SpawnSpec, *, on_exit: Callable[[Proc], None] | None = None,
                    ) -> tuple[Proc, Subscription[Output, ExitStatus]]:
        """Start the process; returns it with a first subscription that misses no output.

        `on_exit` runs once the process was reaped and its end value published.
        """
        creds = switch.credentials(spec.user)
        parent_fds: list[int] = []
        child_fds: list[int] = []
        try:
            if spec.pty_size is not None:
                master, slave = os.openpty()
                parent_fds.append(master)
                child_fds.append(slave)
                _set_winsize(master, *spec.pty_size)
                stdio: dict[str, Any] = {"stdin": slave, "stdout": slave, "stderr": slave,
                                            "preexec_fn": _acquire_controlling_tty}
                outputs, stdin_fd, master_fd = [(master, "pty")], master, master
            else:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                parent_fds += [out_r, err_r]
                child_fds += [out_w, err_w]
                if spec.stdin:
                    in_r, in_w = os.pipe()
                    parent_fds.append(in_w)
                    child_fds.append(in_r)
                    stdin_obj: object = in_r
                    stdin_fd = in_w
                else:
                    stdin_obj, stdin_fd = subprocess.DEVNULL, None
                stdio = {"stdin": stdin_obj, "stdout": out_w, "stderr": err_w}
                outputs, master_fd = [(out_r, "stdout"), (err_r, "stderr")], None
            launch = asyncio.ensure_future(asyncio.to_thread(_popen, spec, stdio, creds))
        except BaseException:
            _close_all(parent_fds + child_fds)
            raise
        try:
            # The fork runs in a thread that cannot be interrupted: on cancellation let it
            # finish, then kill and reap whatever it started and close the fds.
            popen = await asyncio.shield(launch)
        except asyncio.CancelledError:
            launch.add_done_callback(lambda f: _abandon(f, parent_fds + child_fds))
            raise
        except BaseException:
            _close_all(parent_fds + child_fds)
            raise
        _close_all(child_fds)
        for fd in parent_fds:
            os.set_blocking(fd, False)
        fanout: Fanout[Output, ExitStatus] = Fanout()
        proc = cls(spec, popen, outputs=outputs, stdin_fd=stdin_fd, master_fd=master_fd,
                   fanout=fanout)
        proc._on_exit = on_exit
        first = fanout.subscribe()  # before the pumps start: nothing is missed
        proc._task = asyncio.create_task(proc._run(), name=f"proc-{proc.pid}")
        return proc, first

    def kill_after(self, timeout_s: float) -> None:
        """SIGKILL the process (group) once `timeout_s` elapses (its lifetime limit)."""
        loop = asyncio.get_running_loop()
        self._kill_timer = loop.call_later(timeout_s, self.signal, signal.SIGKILL)

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Kill the process and wait until it is reaped and its fds are closed."""
        self.signal(signal.SIGKILL)
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)

    @property
    def running(self) -> bool:
        return self.exit_status is None

    @property
    def is_pty(self) -> bool:
        return self._master_fd is not None

    # -- control --------------------------------------------------------------
    def subscribe(self) -> Subscription[Output, ExitStatus]:
        return self.fanout.subscribe()

    def signal(self, sig: int) -> None:
        """Signal the process and its process group; a no-op once it was reaped."""
        if self._popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, sig)

    def resize(self, cols: int, rows: int) -> None:
        if self._master_fd is None:
            raise ProcessStateError("process has no PTY")
        if not (0 < cols < 65536 and 0 < rows < 65536):
            raise ValueError("PTY size must be positive")
        _set_winsize(self._master_fd, cols, rows)

    async def write_input(self, data: bytes) -> None:
        """Write to the PTY or stdin pipe (waits while the pipe is full)."""
        async with self._write_lock:
            fd = self._stdin_fd
            if fd is None:
                raise ProcessStateError("stdin is not enabled or already closed")
            view = memoryview(data)
            while view:
                try:
                    n = os.write(fd, view)
                except BlockingIOError:
                    await self._wait_fd(fd, writable=True)
                    if self._stdin_fd != fd:
                        raise ProcessStateError("stdin was closed") from None
                    continue
                except (BrokenPipeError, OSError) as exc:
                    if isinstance(exc, BrokenPipeError) or exc.errno in (errno.EIO, errno.EBADF):
                        raise ProcessStateError("process is no longer reading input") from exc
                    raise
                view = view[n:]

    def close_stdin(self) -> None:
        if self._master_fd is not None:
            raise ProcessStateError("cannot close stdin of a PTY process; send Ctrl+D (0x04)")
        fd, self._stdin_fd = self._stdin_fd, None
        if fd is not None:
            self._release_fds({fd})

    def _release_fds(self, fds: set[int]) -> None:
        """Unregister `fds` from the loop, wake their waiters, then close them.

        Unregistering first matters: a closed fd number can be reused at once.
        """
        loop = asyncio.get_running_loop()
        fds = fds & self._open_fds
        self._open_fds -= fds
        for fd in fds:
            loop.remove_reader(fd)
            loop.remove_writer(fd)
        for fut in list(self._wakeups):
            if not fut.done():
                fut.set_result(None)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- internals --------------------------------------------------------------
    async def _wait_fd(self, fd: int, *, writable: bool = False,
                       timeout_s: float | None = None) -> bool:
        """Wait until `fd` is ready; False on timeout or when woken by the exit."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        (loop.add_writer if writable else loop.add_reader)(fd, ready)
        self._wakeups.add(fut)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
            return True
        except TimeoutError:
            return False
        finally:
            self._wakeups.discard(fut)
            if fd in self._open_fds:  # else _release_fds already unregistered it
                (loop.remove_writer if writable else loop.remove_reader)(fd)

    async def _pump(self, fd: int, kind: str) -> None:
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                if self._exit_seen:
                    if not await self._wait_fd(fd, timeout_s=DRAIN_GRACE_S):
                        return
                else:
                    await self._wait_fd(fd)
                continue
            except OSError as exc:
                if exc.errno == errno.EIO:  # PTY: every slave fd closed
                    return
                raise
            if not data:
                return
            await self.fanout.publish((kind, data))

    async def _wait_exit(self) -> int:
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            return await asyncio.to_thread(self._popen.wait)
        loop = asyncio.get_running_loop()
        try:
            fut: asyncio.Future[None] = loop.create_future()

            def exited() -> None:
                if not fut.done():
                    fut.set_result(None)

            loop.add_reader(pidfd, exited)
            try:
                await fut
            finally:
                loop.remove_reader(pidfd)
        finally:
            os.close(pidfd)
        rc = self._popen.poll()
        if rc is None:  # cannot happen once the pidfd is readable; be safe
            rc = await asyncio.to_thread(self._popen.wait)
        return rc

    async def _run(self) -> None:
        pumps = [asyncio.create_task(self._pump(fd, kind)) for fd, kind in self._outputs]
        status: ExitStatus | None = None
        try:
            rc = await self._wait_exit()
            status = ExitStatus.from_returncode(rc)
            self._exit_seen = True
            for fut in list(self._wakeups):  # pumps idle on an fd: re-check with a grace
                if not fut.done():
                    fut.set_result(None)
            results = await asyncio.gather(*pumps, return_exceptions=True)
            for res in results:
                if isinstance(res, Exception):
                    log.warning("output pump of pid %d failed: %r", self.pid, res)
        finally:
            for task in pumps:
                task.cancel()
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            fds = {fd for fd, _ in self._outputs}
            if self._stdin_fd is not None:
                fds.add(self._stdin_fd)
            self._stdin_fd = None
            self._release_fds(fds)
            self.exit_status = status or ExitStatus(-1, False, "unknown", "envd stopped waiting")
            self.fanout.close(self.exit_status)
            self.done.set()
            if self._on_exit is not None:
                self._on_exit(self)


__all__ = ["ExitStatus", "Output", "Proc", "ProcessStateError", "SpawnSpec"]
